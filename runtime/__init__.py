"""Everything that happens while processes run: transports, mailbox, executor."""

from .errors import (
    ClusterError,
    JobFinished,
    MessageRejected,
    PeerFailed,
    RecvTimeout,
    SplitrunError,
    StepFailed,
    TransportError,
)
from .executor import ChannelStats, Executor, ExecutorStats
from .transport.grpc.transport import ExpectedChannel, GrpcSettings, GrpcTransport, expected_channels
from .job import Job, JobSettings, Trainer
from .transport.loopback import LoopbackHub, LoopbackTransport
from .transport.mailbox import Mailbox
from .threaded import ThreadedRun, run_threaded
from .transport.protocol import MessageKey, Transport

__all__ = [
    "ClusterError",
    "JobFinished",
    "MessageRejected",
    "PeerFailed",
    "RecvTimeout",
    "SplitrunError",
    "StepFailed",
    "TransportError",
    "ChannelStats",
    "Executor",
    "ExecutorStats",
    "ExpectedChannel",
    "GrpcSettings",
    "GrpcTransport",
    "expected_channels",
    "Job",
    "JobSettings",
    "Trainer",
    "LoopbackHub",
    "LoopbackTransport",
    "Mailbox",
    "ThreadedRun",
    "run_threaded",
    "MessageKey",
    "Transport",
]
