"""How processes hand tensors to each other: the `Transport` protocol, the
mailbox, the in-process loopback transport, the tensor codec, the gRPC
transport (`transport.grpc`) and the generated wire code (`transport.wire`)."""

from .loopback import LoopbackHub, LoopbackTransport
from .mailbox import Mailbox
from .protocol import OUT_OF_PLAN, MessageKey, Transport

__all__ = ["LoopbackHub", "LoopbackTransport", "Mailbox", "OUT_OF_PLAN", "MessageKey",
           "Transport"]
