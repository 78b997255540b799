"""How processes hand tensors to each other: the `Transport` protocol (with
its lifecycle), message keys, receive contracts and their check, the
process's receiving side (`endpoint`: mailbox, buffer pool, contracts,
failure) and the one admission check every incoming message passes
(`admission`), the in-process loopback transport, the tensor codec (`dtypes`,
`buffers`, `framing`), the gRPC transport (`grpc/`), shared memory between
processes of one host (`shm/`), and the per-peer router over those two
(`router`), which never import each other.
The gRPC glue it shares with the scheduler (wire code, token, TLS) is the room
below, `runtime.rpc`."""

from __future__ import annotations

from splitrun.splitter.lazy_exports import lazy_exports

# Imported when first used: the launcher's scheduler needs only the gRPC
# service's wire code, not torch behind the contracts and the mailbox.
_EXPORTS = {
    "ChannelContract": ".contract",
    "ReceiveContracts": ".contract",
    "check_message": ".contract",
    "find_contract": ".contract",
    "receive_contracts": ".contract",
    "LoopbackHub": ".loopback",
    "LoopbackTransport": ".loopback",
    "Mailbox": ".mailbox",
    "Endpoint": ".endpoint",
    "RoutedTransport": ".router",
    "TransportChoice": ".router",
    "TransportKind": ".router",
    "OUT_OF_PLAN": ".protocol",
    "MessageKey": ".protocol",
    "Transport": ".protocol",
}

__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
