"""`GrpcTransport`: the `Transport` protocol over real gRPC between processes.

This module is its public face. The transport delivers into one `Endpoint`
(the process's receiving side: mailbox, pool, contracts, failure), which it
hands to its parts; they know nothing of the transport: the receiving side
(the `TensorService` server, which admits messages like every transport,
`receive`), the sending side (per-peer queues, streams, retries, `send`).
The names both ends of a call share, the token's check and TLS are the room
below (`runtime.rpc`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent import futures

import grpc
import torch

from splitrun.splitter.labels import Label

from ...errors import TransportError
from ...rpc.auth import TokenInterceptor
from ...rpc.service import PING_METHOD
from ...rpc.tls import TlsFiles
from ...rpc.wire import splitrun_pb2
from ..buffers import BufferPool
from ..contract import ChannelContract
from ..dtypes import TensorSpec
from ..endpoint import Endpoint
from ..filled import Fill, fill_then_send
from ..framing import CHUNK_OVERHEAD, EnvelopeWriter
from ..keys import MessageKey
from .outgoing import outgoing
from .receive import TensorServicer, server_options
from .send import JOIN_GRACE_S, PeerSender, call_metadata, open_channel
from .settings import GrpcSettings

__all__ = ["GrpcTransport", "GrpcSettings"]

logger = logging.getLogger(__name__)


def _format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class GrpcTransport:
    """The `Transport` protocol over gRPC: a server for this process, a stream
    to each peer.

        transport = GrpcTransport(label, token=token, incarnation=inc,
                                  contracts=receive_contracts(plan, program, label))
        address = transport.start()          # tell the peers (scheduler)
        transport.set_peers({peer: address_of_peer, ...})
        ... Executor(plan, label, transport, incarnation=inc) ...
        transport.close()

    Sent tensors are read after `send` returns, when their turn on the wire
    comes: do not modify them in place afterwards (the split program never does).
    """

    def __init__(self, label: Label, *, token: str, incarnation: int, host: str = "127.0.0.1",
                 port: int = 0, contracts: Mapping[str, ChannelContract] | None = None,
                 settings: GrpcSettings | None = None, tls: TlsFiles | None = None) -> None:
        self.settings = settings or GrpcSettings()
        if self.settings.chunk_bytes + CHUNK_OVERHEAD >= self.settings.max_request_bytes:
            raise TransportError(
                f"chunk_bytes {self.settings.chunk_bytes} must leave room for the "
                f"envelope below max_request_bytes {self.settings.max_request_bytes}")
        self.host = host
        self.port = port
        self.tls = tls
        self.address: str | None = None
        pool = BufferPool(self.settings.pool_bytes, pin_memory=self.settings.pin_receive_buffers)
        # The process's receiving side: another transport of the process
        # (shared memory) delivers into the same one.
        self.endpoint = Endpoint(label, incarnation, token=token, pool=pool,
                                 expect_timeout_s=self.settings.expect_timeout_s,
                                 max_message_bytes=self.settings.max_message_bytes)
        self._envelopes = EnvelopeWriter(str(label))
        if contracts is not None:
            self.expect(contracts)
        self._peers: dict[Label, str] = {}
        self._senders: dict[Label, PeerSender] = {}
        self._lock = threading.Lock()
        self._server: grpc.Server | None = None
        self._server_pool: futures.ThreadPoolExecutor | None = None
        # Other services of this process's server (the tcp data plane's address).
        self._services: list[grpc.GenericRpcHandler] = []
        self._is_closed = False

    def __enter__(self) -> GrpcTransport:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def label(self) -> Label:
        return self.endpoint.label

    @property
    def incarnation(self) -> int:
        return self.endpoint.incarnation

    # -- setup --

    def add_service(self, handler: grpc.GenericRpcHandler) -> None:
        """Serve another service beside the tensor service (before `start`);
        its calls need the job's token like every call."""
        if self._server is not None:
            raise TransportError(f"{self._tag} add_service after start()")
        self._services.append(handler)

    def start(self) -> str:
        """Bind and start the server; returns the bound "host:port" (port 0 picks one)."""
        if self._server is not None:
            return self.address
        settings = self.settings
        self._server_pool = futures.ThreadPoolExecutor(
            max_workers=settings.max_server_threads,
            thread_name_prefix=f"splitrun-recv-{self.label}")
        # The token is checked before any handler runs: a caller without it
        # never holds a server thread or one of the concurrent-call slots.
        auth = TokenInterceptor(self.endpoint.token, f"tensor server of {self._tag}",
                                "every process of a job must use the job's token")
        server = grpc.server(self._server_pool, options=server_options(settings),
                             maximum_concurrent_rpcs=settings.max_server_threads,
                             interceptors=(auth,))
        server.add_generic_rpc_handlers((TensorServicer(self.endpoint).handler(),
                                         *self._services))
        wanted = _format_address(self.host, self.port)
        try:
            if self.tls is None:
                port = server.add_insecure_port(wanted)
            else:
                port = server.add_secure_port(wanted, self.tls.server_credentials())
        except RuntimeError as exc:
            port, cause = 0, exc
        else:
            cause = None
        if not port:
            self._server_pool.shutdown(wait=False)
            raise TransportError(
                f"{self._tag} cannot listen on {wanted}: {cause or 'bind failed'}; is the "
                f"port taken? (port 0 picks a free one)")
        server.start()
        self._server = server
        self.port = port
        self.address = _format_address(self.host, port)
        logger.info("%s serving tensors on %s", self._tag, self.address)
        return self.address

    def set_peers(self, peers: Mapping[Label, str]) -> None:
        """Where each peer's server listens ("host:port"); merged with earlier calls."""
        with self._lock:
            for peer, address in peers.items():
                sender = self._senders.get(peer)
                if sender is not None and sender.address != address:
                    raise TransportError(
                        f"{self._tag} {peer.describe()} moved from {sender.address} to "
                        f"{address} while messages were sent to it; a restarted peer "
                        f"belongs to a new incarnation of the job")
                self._peers[peer] = address

    def set_identity(self, label: Label, incarnation: int) -> None:
        """The label and incarnation the scheduler assigned, once the server is
        up (its address is part of the registration); before any message."""
        with self._lock:
            if self._senders:
                raise TransportError(
                    f"{self._tag} set_identity({label}, {incarnation}) after messages were "
                    f"sent; a process's identity is fixed once it talks to peers")
            self._envelopes = EnvelopeWriter(str(label))
            self.endpoint.set_identity(label, incarnation)

    def expect(self, contracts: Mapping[str, ChannelContract]) -> None:
        """The contracts of this process's plan channels (see `receive_contracts`);
        messages that arrived first were waiting for them."""
        self.endpoint.expect(contracts)

    def register(self, contracts: Mapping[str, ChannelContract]) -> None:
        """Contracts of channels outside the plan, registered by their owners."""
        self.endpoint.register(contracts)

    def pending(self) -> list[MessageKey]:
        """The keys of messages received and not taken by `recv` yet (for tests
        and diagnostics), by step and channel."""
        return self.endpoint.pending()

    # -- the Transport protocol --

    def send(self, dst: Label, key: MessageKey, tensors: Sequence[torch.Tensor]) -> None:
        """Queue `tensors` for `dst`; blocks only while dst's queue is full."""
        self.endpoint.raise_if_failed()
        if self._is_closed:
            raise TransportError(
                f"{self._tag} send {key} to {dst.describe()}: the transport is closed")
        self._sender(dst).put(outgoing(self.settings, self._tag, self._envelopes, dst, key,
                                       tensors))

    def send_filled(self, dst: Label, key: MessageKey, specs: Sequence[TensorSpec],
                    fill: Fill) -> None:
        """`send` of new tensors `fill` wrote (gRPC lends no memory to fill)."""
        fill_then_send(self.send, dst, key, specs, fill)

    def recv(self, src: Label, key: MessageKey, timeout_s: float,
             control=None) -> list[torch.Tensor]:
        """The tensors `src` sent under `key` (CPU tensors); `RecvTimeout` past the
        deadline. While waiting, a message under `control`'s key goes to its handler."""
        return self.endpoint.take(key, src, timeout_s, control)

    def is_lent(self, tensor: torch.Tensor) -> bool:
        return False  # received tensors own their (pooled) buffers

    def abort(self, error: BaseException) -> None:
        """Wake every pending receive of this process with `error` (and every
        message waiting for `expect`: refused)."""
        self.endpoint.abort(error)

    def finish_at(self, num_steps: int) -> None:
        """Receives for steps >= `num_steps` end with `JobFinished`."""
        self.endpoint.finish_at(num_steps)

    def route(self, prefix: str, handler) -> None:
        """Hand incoming messages on channels starting with `prefix` to `handler`."""
        self.endpoint.route(prefix, handler)

    def flush(self, timeout_s: float) -> None:
        """Wait until every message queued so far is confirmed delivered."""
        self.endpoint.raise_if_failed()
        deadline = time.monotonic() + timeout_s
        with self._lock:
            senders = list(self._senders.values())
        try:
            for sender in senders:
                sender.flush(deadline)
        except TransportError as exc:
            self.endpoint.note_raised(exc)
            raise

    def ping(self, dst: Label, timeout_s: float = 5.0) -> str:
        """The label `dst`'s server answers with; `TransportError` if it does not."""
        address = self._address_of(dst)
        with open_channel(address, self.settings, self.tls) as channel:
            call = channel.unary_unary(PING_METHOD, request_serializer=None,
                                       response_deserializer=None)
            try:
                raw = call(b"", timeout=timeout_s, metadata=call_metadata(self.endpoint.token),
                           wait_for_ready=True)
            except grpc.RpcError as err:
                raise TransportError(
                    f"{self._tag} ping {dst.describe()} at {address}: {err.code().name}: "
                    f"{err.details()}") from None
        return splitrun_pb2.PingReply.FromString(raw).label

    def close(self) -> None:
        """Flush queued sends (within close_timeout_s), stop the senders and the
        server; raises a failure nobody has been told about yet."""
        if self._is_closed:
            return
        self._is_closed = True
        deadline = time.monotonic() + self.settings.close_timeout_s
        with self._lock:
            senders = list(self._senders.values())
        for sender in senders:
            sender.close()
        problems = [error for error in (sender.join(deadline) for sender in senders) if error]
        for sender in senders:
            sender.shutdown()
        self.endpoint.contracts.stop_waiting()
        if self._server is not None:
            # Grace lets peers' streams to us confirm what they carried.
            grace = max(deadline - time.monotonic(), 0.0)
            self._server.stop(grace).wait(grace + JOIN_GRACE_S)
            self._server_pool.shutdown(wait=False)
        self.endpoint.pool.clear()
        logger.info("%s transport closed", self._tag)
        unreported = self.endpoint.unreported_failure()
        if problems:
            raise TransportError("; ".join(str(p) for p in problems))
        if unreported is not None:
            raise unreported

    # -- internals --

    @property
    def _tag(self) -> str:
        return self.endpoint.tag

    def _address_of(self, peer: Label) -> str:
        address = self._peers.get(peer)
        if address is None:
            known = ", ".join(f"{p}={a}" for p, a in sorted(self._peers.items())) or "none"
            raise TransportError(
                f"{self._tag} no address for {peer.describe()}; set_peers() knows {known}")
        return address

    def _sender(self, peer: Label) -> PeerSender:
        sender = self._senders.get(peer)
        if sender is None:
            with self._lock:
                sender = self._senders.get(peer)
                if sender is None:
                    sender = PeerSender(self.endpoint, self.settings, self.tls, peer,
                                        self._address_of(peer))
                    self._senders[peer] = sender
        return sender

    @property
    def has_failed(self) -> bool:
        """True once a fatal error failed this transport (see `fail`)."""
        return self.endpoint.has_failed

    def raise_if_failed(self) -> None:
        """Raise the transport's failure, if it has one."""
        self.endpoint.raise_if_failed()

    def fail(self, error: TransportError) -> None:
        """A fatal error: remember the first failure, wake every receive with
        it, raise it from sends and flushes."""
        self.endpoint.fail(error)
