"""Everything that happens while processes run: transports, mailbox, executor."""

from .errors import (
    CacheError,
    CheckpointError,
    ChannelMismatch,
    ClusterError,
    JobFinished,
    MessageRejected,
    PeerFailed,
    RecvTimeout,
    SplitrunError,
    StepFailed,
    TransportError,
    UnknownChannel,
    WrongSender,
)
from .executor import ChannelStats, Executor, ExecutorStats
from .transport.contract import ChannelContract, check_message, receive_contracts
from .transport.grpc import GrpcSettings, GrpcTransport
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
    "ChannelMismatch",
    "UnknownChannel",
    "WrongSender",
    "PeerFailed",
    "RecvTimeout",
    "SplitrunError",
    "StepFailed",
    "TransportError",
    "ChannelStats",
    "Executor",
    "ExecutorStats",
    "ChannelContract",
    "check_message",
    "receive_contracts",
    "GrpcSettings",
    "GrpcTransport",
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
