"""Run every process of a plan as a thread of this process, over loopback.

The way to test a split without sockets: results must equal the unsplit step.
Each thread runs the loop of a launched job's script, through the same
`start_trainer` and `Trainer` (`trainer.run(trainer.shard(batches))`, then
`trainer.finish()`), over an `InProcessMembership` instead of the scheduler:
servers serve until the workers finish, worker 0 gathers the final state
(whole, in every mode) and the first failure stops every other thread with
an error naming the failed process.

Batches and hyperparameters come in the order a launched job's loop of
`trainer.step(batch)` takes them: `batches(step)` is called once per step, in
step order, and the step's hyperparameters (a `torch.optim` optimizer's
current learning rates) are read right after it, before the next step's batch
is asked for. So a learning-rate schedule stepped in `batches` applies from
that step on, for every thread alike.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from splitrun.splitter.labels import Label, Role
from splitrun.splitter.plan import SplitPlan
from splitrun.splitter.splitting.graph_splitter import SplitProgram

from ..cluster.in_process import InProcessMembership
from ..cluster.rendezvous import InProcessRendezvous
from ..engine.executor import ExecutorStats
from ..errors import PeerFailed, SplitrunError
from ..transport.loopback import LoopbackHub
from ..transport.protocol import Transport
from .member import JobMember
from .settings import JobSettings
from .trainer import Trainer, start_trainer

__all__ = ["run_threaded", "ThreadedRun"]

# Bounds joining a thread after its last step should have finished: generous,
# because a thread blocked in a receive gives up after recv_timeout_s anyway.
_JOIN_GRACE_S = 30.0


@dataclass
class ThreadedRun:
    history: list[dict[str, torch.Tensor]]  # per step: outputs of all processes
    state: dict[str, torch.Tensor]          # final state, whole (gathered by worker 0)
    stats: dict[Label, ExecutorStats]
    # Per worker, per cached table; per server, per dynamic table.
    cache_counters: dict[Label, dict] = field(default_factory=dict)
    # Per process: the state it holds at the end, as it holds it (parallel
    # mode: its members' pieces, keyed `key@wN`).
    held: dict[Label, dict[str, torch.Tensor]] = field(default_factory=dict)


def run_threaded(split: SplitProgram, num_steps: int,
                 batches: Callable[[int], Mapping[str, torch.Tensor]] | None = None, *,
                 state: Mapping[str, torch.Tensor] | None = None, recv_timeout_s: float = 30.0,
                 device: str = "cpu",
                 worker_batches: Callable[[int, int], Mapping[str, torch.Tensor]] | None = None
                 ) -> ThreadedRun:
    """Train `num_steps` steps of `split` (from `split_program`); `batches(step)`
    gives the global batch's feeds, the program's optimizer the hyperparameters.

    Each worker takes its share of the global batch as `Trainer.shard` gives it
    in a real job (its rows in parameter-server and embedding-cache modes).
    `batches` is called once per step, in order, each step's hyperparameters
    read right after it (module docstring). A batch that cannot be cut by rows
    (jagged ids: `TorchRecInput.shard` cuts them) comes instead from
    `worker_batches(rank, step)`: worker `rank`'s feeds.
    """
    _check_arguments(split, batches, worker_batches)
    plan = split.plan
    # Every thread but an idle server's runs each step (and reads its feeds).
    stepping = [label for label in plan.labels
                if label.role is Role.WORKER or not plan.process(label).is_idle]
    steps = _StepFeeds(batches or (lambda step: {}), split.program.hparams, len(stepping),
                       num_steps)
    history: list[dict[str, torch.Tensor]] = [{} for _ in range(num_steps)]
    lock = threading.Lock()

    def record(step: int, outputs: dict[str, torch.Tensor]) -> None:
        with lock:
            history[step].update(outputs)
        steps.done(step)

    hub = LoopbackHub(plan.labels)
    transports = {label: hub.transport(label) for label in plan.labels}
    membership = InProcessMembership(transports)
    trainers = _start_trainers(split, membership, transports, steps, record, num_steps=num_steps,
                               state=state, recv_timeout_s=recv_timeout_s, device=device)

    def batches_of(label: Label) -> _GlobalBatches:
        if worker_batches is None:
            return _GlobalBatches(steps, num_steps)
        return _OwnBatches(steps, num_steps, label.rank, worker_batches)
    final_state = _run_threads(trainers, membership, batches_of,
                               join_timeout_s=num_steps * recv_timeout_s + _JOIN_GRACE_S)
    counters = {label: trainer.cache_counters for label, trainer in trainers.items()
                if trainer.process.has_cache or trainer.cache_counters}
    return ThreadedRun(history, final_state,
                       {label: trainer.stats for label, trainer in trainers.items()}, counters,
                       {label: trainer.process.state for label, trainer in trainers.items()})


def _check_arguments(split, batches, worker_batches) -> None:
    if isinstance(split, SplitPlan):
        raise SplitrunError("run_threaded needs what split_program(program, cluster, mode) "
                            "returns (the plan with the program it runs); split(...) gives "
                            "the plan alone")
    if not isinstance(split, SplitProgram):
        raise SplitrunError(f"run_threaded needs what split_program(program, cluster, mode) "
                            f"returns, got {type(split).__name__}")
    if (batches is None) == (worker_batches is None):
        raise SplitrunError("run_threaded takes batches(step) or worker_batches(rank, step)")


def _start_trainers(split: SplitProgram, membership: InProcessMembership,
                    transports: Mapping[Label, Transport], steps: _StepFeeds,
                    record: Callable[[int, dict[str, torch.Tensor]], None], *, num_steps: int,
                    state: Mapping[str, torch.Tensor] | None, recv_timeout_s: float,
                    device: str) -> dict[Label, Trainer]:
    """Every process of `split` put into the job, as `Job.start` puts a launched one."""
    plan = split.plan
    rendezvous = InProcessRendezvous(recv_timeout_s)  # parallel mode's process groups
    # A server's first receive of a step waits as long as any receive: a
    # thread's peers are never busy elsewhere between steps.
    settings = JobSettings(recv_timeout_s=recv_timeout_s, idle_timeout_s=recv_timeout_s)
    trainers: dict[Label, Trainer] = {}
    for label in plan.labels:
        member = JobMember(label, plan.cluster, torch.device(device), settings,
                           client=membership, transport=transports[label],
                           heartbeat_interval_s=None)
        trainers[label] = start_trainer(member, split, state=state, rendezvous=rendezvous,
                                        num_steps=num_steps, hparams=steps.hparams,
                                        on_outputs=record)
    return trainers


def _run_threads(trainers: dict[Label, Trainer], membership: InProcessMembership,
                 batches_of: Callable[[Label], _GlobalBatches], *,
                 join_timeout_s: float) -> dict[str, torch.Tensor]:
    """Each trainer's loop in a thread of its own, as a launched script runs
    it; the final state worker 0 gathered, or the first process's own error
    (not one raised because another failed)."""
    final_state: dict[str, torch.Tensor] = {}
    failures: list[tuple[Label, BaseException]] = []
    lock = threading.Lock()

    def work(label: Label, trainer: Trainer) -> None:
        in_loop = True
        try:
            for _ in trainer.run(trainer.shard(batches_of(label))):
                pass
            in_loop = False
            gathered = trainer.finish()  # closes the process, failing or not
        except BaseException as exc:  # noqa: BLE001 - reported to the caller below
            with lock:
                failures.append((label, exc))
            # The trainer told the membership (which stopped every other
            # thread) unless it failed outside a step.
            membership.report_failure(label, f"{type(exc).__name__}: {exc}")
            if in_loop:
                trainer.process.close()
            return
        if gathered is not None:
            final_state.update(gathered)

    threads = [threading.Thread(target=work, args=(label, trainer), name=f"splitrun-{label}",
                                daemon=True)
               for label, trainer in trainers.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=join_timeout_s)
    stuck = [t.name for t in threads if t.is_alive()]
    if stuck:
        raise SplitrunError(f"threads {', '.join(stuck)} did not finish; a step hangs")
    if failures:
        original = [f for f in failures if not isinstance(f[1], PeerFailed)] or failures
        raise original[0][1]
    return final_state


class _GlobalBatches:
    """The global batches, one per step, as a launched worker's script loops
    over them (`Trainer.shard` cuts this worker's rows)."""

    def __init__(self, steps: _StepFeeds, num_steps: int) -> None:
        self._steps = steps
        self._num_steps = num_steps

    def __iter__(self) -> Iterator[Mapping[str, torch.Tensor]]:
        for step in range(self._num_steps):
            yield self._steps.batch(step)  # in step order, hyperparameters with it


class _OwnBatches(_GlobalBatches):
    """Worker `rank`'s own batches, `worker_batches(rank, step)`: a
    `ShardedSource`, which `Trainer.shard` takes as it is."""

    def __init__(self, steps: _StepFeeds, num_steps: int, rank: int,
                 worker_batches: Callable[[int, int], Mapping[str, torch.Tensor]]) -> None:
        super().__init__(steps, num_steps)
        self._rank = rank
        self._worker_batches = worker_batches

    def __iter__(self) -> Iterator[Mapping[str, torch.Tensor]]:
        for step, _ in enumerate(super().__iter__()):
            yield self._worker_batches(self._rank, step)

    def worker_shard(self, rank: int, num_workers: int) -> Iterator[Mapping[str, torch.Tensor]]:
        return iter(self)


class _StepFeeds:
    """Each step's global batch and hyperparameters, made once for all
    `num_threads` threads: `batches(step)` in step order, each step's
    hyperparameters read right after its batch (the order of a launched job's
    loop). A step's are dropped once every thread is done with it. A server
    reads the hyperparameters of the step after the last before it learns
    that the workers finished: they are read then, with no batch."""

    def __init__(self, batches: Callable[[int], Mapping[str, torch.Tensor]],
                 hparams: Callable[[int], dict[str, torch.Tensor]], num_threads: int,
                 num_steps: int) -> None:
        self._num_steps = num_steps
        self._batches = batches
        self._read_hparams = hparams
        self._num_threads = num_threads
        self._made: dict[int, tuple[Mapping[str, torch.Tensor], dict[str, torch.Tensor]]] = {}
        self._next = 0
        self._done: dict[int, int] = {}
        self._lock = threading.Lock()

    def _get(self, step: int):
        with self._lock:
            while self._next <= step:
                batch = self._batches(self._next)
                self._made[self._next] = (batch, self._read_hparams(self._next))
                self._next += 1
            return self._made[step]

    def batch(self, step: int) -> Mapping[str, torch.Tensor]:
        return self._get(step)[0]

    def hparams(self, step: int) -> dict[str, torch.Tensor]:
        if step >= self._num_steps:
            return self._read_hparams(step)
        return self._get(step)[1]

    def done(self, step: int) -> None:
        """One thread finished `step` (and needs nothing of it any more)."""
        with self._lock:
            self._done[step] = self._done.get(step, 0) + 1
            if self._done[step] == self._num_threads:
                self._made.pop(step, None)
                del self._done[step]
