"""How processes hand tensors to each other: the `Transport` protocol, message
keys, receive contracts and their check, the mailbox, the in-process loopback
transport, the tensor codec (`dtypes`, `buffers`, `framing`), the gRPC
transport (`transport.grpc`) and the generated wire code (`transport.wire`)."""

from .contract import (
    ChannelContract,
    ReceiveContracts,
    check_message,
    find_contract,
    receive_contracts,
)
from .loopback import LoopbackHub, LoopbackTransport
from .mailbox import Mailbox
from .protocol import OUT_OF_PLAN, MessageKey, Transport

__all__ = ["ChannelContract", "ReceiveContracts", "check_message", "find_contract",
           "receive_contracts", "LoopbackHub", "LoopbackTransport", "Mailbox", "OUT_OF_PLAN",
           "MessageKey", "Transport"]
