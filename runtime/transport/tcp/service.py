"""How a sender learns a peer's data port: over gRPC, the control plane.

The receiving process's gRPC server answers `/splitrun.DataPlane/Address`
with its data port (ASCII digits). The server's `TokenInterceptor` checks
the job's token first, as for every call. A server that does not know the
method (the data plane off) answers UNIMPLEMENTED: the sender then keeps
gRPC for that peer.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

from ...errors import TransportError
from ...rpc.service import TOKEN_METADATA_KEY
from ...rpc.tls import TlsFiles

__all__ = ["DATA_ADDRESS_METHOD", "DataPlaneService", "ask_data_port"]

_SERVICE = "splitrun.DataPlane"
DATA_ADDRESS_METHOD = f"/{_SERVICE}/Address"


class DataPlaneService:
    """The handler a gRPC server adds to say where its data plane listens."""

    def __init__(self, port: Callable[[], int | None]) -> None:
        self._port = port

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(_SERVICE, {
            "Address": grpc.unary_unary_rpc_method_handler(self._address)})

    def _address(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        port = self._port()
        if port is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the data plane is not started")
        return str(port).encode()


def ask_data_port(address: str, *, token: str, tls: TlsFiles | None, timeout_s: float,
                  tag: str, peer: str) -> int | None:
    """The data port of the process whose gRPC server is at `address`; None
    when it has no data plane. `TransportError` when it cannot be asked."""
    channel = (grpc.insecure_channel(address) if tls is None
               else grpc.secure_channel(address, tls.channel_credentials()))
    with channel:
        call = channel.unary_unary(DATA_ADDRESS_METHOD, request_serializer=None,
                                   response_deserializer=None)
        try:
            raw = call(b"", timeout=timeout_s, metadata=((TOKEN_METADATA_KEY, token),),
                       wait_for_ready=True)
        except grpc.RpcError as err:
            if err.code() in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAVAILABLE):
                return None
            raise TransportError(f"{tag} asking {peer} at {address} for its data port: "
                                 f"{err.code().name}: {err.details()}") from None
    try:
        return int(raw)
    except ValueError:
        raise TransportError(f"{tag} {peer} at {address} answered {raw[:32]!r} for its data "
                             f"port") from None
