"""Everything that happens while processes run: transports, mailbox, executor."""

from .errors import (
    CacheError,
    CheckpointError,
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
from .job import Job, JobSettings, PlanWritten, Trainer
from .process import ProcessRuntime
from .transport.loopback import LoopbackHub, LoopbackTransport
from .transport.mailbox import Mailbox
from .threaded import ThreadedRun, run_threaded
from .transport.protocol import MessageKey, Transport

__all__ = [
    "CacheError",
    "CheckpointError",
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
    "PlanWritten",
    "ProcessRuntime",
    "Trainer",
    "LoopbackHub",
    "LoopbackTransport",
    "Mailbox",
    "ThreadedRun",
    "run_threaded",
    "MessageKey",
    "Transport",
]
