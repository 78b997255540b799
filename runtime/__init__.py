"""Everything that happens while processes run, in rooms by layer; a room
imports only the rooms below it (setup.cfg's layers contract):

    job/          the job a script runs: Job, Trainer, start_trainer, and
                  run_threaded (the same loop, every process a thread)
    checkpoints/  plain files, sharded directories, periodic saves, a job's saves
    engine/       one process's share of the step: ProcessRuntime, Executor,
                  collectives, the embedding cache
    cluster/      membership: the scheduler, its client and heartbeat, the
                  environment a launcher gives a process, threads' membership
    transport/    messages between processes: the Transport protocol, the
                  endpoint (mailbox, pool, contracts) and its one admission
                  check, loopback, gRPC, shared memory, the per-peer router
    rpc/          the gRPC glue below both: wire code, the job's token, TLS
    errors        the one error tree

`datasets/` (Criteo's format, read and synthesized) sits beside `job/`.
docs/architecture.md follows a gradient through them.
"""

from __future__ import annotations

from splitrun.splitter.lazy_exports import lazy_exports

# Each public name and the module it lives in; imported when first used, so
# that the launcher, which needs only the scheduler and a few helpers, does
# not import the executor, the job and the splitter behind them.
_EXPORTS = {
    "CacheError": ".errors",
    "CheckpointError": ".errors",
    "ShardedTable": ".checkpoints",
    "LiveTable": ".checkpoints",
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
