"""Everything that happens while processes run: transports, mailbox, executor."""

from .errors import (
    ClusterError,
    MessageRejected,
    PeerFailed,
    RecvTimeout,
    SplitrunError,
    StepFailed,
    TransportError,
)
from .executor import ChannelStats, Executor, ExecutorStats
from .loopback import LoopbackHub, LoopbackTransport
from .mailbox import Mailbox
from .threaded import ThreadedRun, run_threaded
from .transport import MessageKey, Transport

__all__ = [
    "ClusterError",
    "MessageRejected",
    "PeerFailed",
    "RecvTimeout",
    "SplitrunError",
    "StepFailed",
    "TransportError",
    "ChannelStats",
    "Executor",
    "ExecutorStats",
    "LoopbackHub",
    "LoopbackTransport",
    "Mailbox",
    "ThreadedRun",
    "run_threaded",
    "MessageKey",
    "Transport",
]
