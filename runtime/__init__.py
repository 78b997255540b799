"""Everything that happens while processes run."""

from __future__ import annotations

from splitrun.splitter.lazy_exports import lazy_exports

# Each public name and the module it lives in; imported when first used, so
# that the launcher, which needs only the scheduler and a few helpers, does
# not import the executor, the job and the splitter behind them.
_EXPORTS = {
    "CacheError": ".errors",
    "CheckpointError": ".errors",
    "ClusterError": ".errors",
    "JobFinished": ".errors",
    "MessageRejected": ".errors",
    "ChannelMismatch": ".errors",
    "UnknownChannel": ".errors",
    "WrongSender": ".errors",
    "PeerFailed": ".errors",
    "RecvTimeout": ".errors",
    "SplitrunError": ".errors",
    "StepFailed": ".errors",
    "TransportError": ".errors",
    "ChannelStats": ".engine.executor",
    "Executor": ".engine.executor",
    "ExecutorStats": ".engine.executor",
    "ChannelContract": ".transport.contract",
    "check_message": ".transport.contract",
    "receive_contracts": ".transport.contract",
    "GrpcSettings": ".transport.grpc",
    "GrpcTransport": ".transport.grpc",
    "Job": ".job",
    "JobSettings": ".job",
    "PlanWritten": ".job",
    "ProcessRuntime": ".engine.process",
    "Trainer": ".job",
    "LoopbackHub": ".transport.loopback",
    "LoopbackTransport": ".transport.loopback",
    "Mailbox": ".transport.mailbox",
    "ThreadedRun": ".job.threaded",
    "run_threaded": ".job.threaded",
    "MessageKey": ".transport.protocol",
    "Transport": ".transport.protocol",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
