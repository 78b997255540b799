"""Run every process of a plan as a thread of this process, over loopback.

The way to test a split without sockets: results must equal the unsplit step.
The first failure aborts every other thread's pending receive with an error
naming the failed process.

Batches and hyperparameters come in the order a launched job's loop of
`trainer.step(batch)` takes them: `batches(step)` is called once per step, in
step order, and the step's hyperparameters (a `torch.optim` optimizer's
current learning rates) are read right after it, before the next step's batch
is asked for. So a learning-rate schedule stepped in `batches` applies from
that step on, for every thread alike.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from splitrun.splitter.graph_splitter import SplitProgram
from splitrun.splitter.labels import Label, Role
from splitrun.splitter.plan import ModeKind, SplitPlan

from ..cluster.rendezvous import InProcessRendezvous
from ..engine.executor import ExecutorStats
from ..engine.process import ProcessRuntime
from ..errors import PeerFailed, SplitrunError
from ..transport.contract import receive_contracts
from ..transport.loopback import LoopbackHub
from .data import shard_batch

__all__ = ["run_threaded", "ThreadedRun"]

# Bounds joining a thread after its last step should have finished: generous,
# because a thread blocked in a receive gives up after recv_timeout_s anyway.
_JOIN_GRACE_S = 30.0


@dataclass
class ThreadedRun:
    history: list[dict[str, torch.Tensor]]  # per step: outputs of all processes
    state: dict[str, torch.Tensor]          # final state gathered from the owners
    stats: dict[Label, ExecutorStats]
    cache_counters: dict[Label, dict] = field(default_factory=dict)  # per worker, per table


def run_threaded(split: SplitProgram, num_steps: int,
                 batches: Callable[[int], Mapping[str, torch.Tensor]] | None = None, *,
                 state: Mapping[str, torch.Tensor] | None = None, recv_timeout_s: float = 30.0,
                 device: str = "cpu",
                 worker_batches: Callable[[int, int], Mapping[str, torch.Tensor]] | None = None
                 ) -> ThreadedRun:
    """Train `num_steps` steps of `split` (from `split_program`); `batches(step)`
    gives the global batch's feeds, the program's optimizer the hyperparameters.

    In parameter-server and embedding-cache modes each worker gets its shard of
    the global batch, as `Trainer.shard` gives it in a real job. `batches` is
    called once per step, in order, each step's hyperparameters read right
    after it (module docstring). A batch that cannot be cut by rows (jagged
    ids: `TorchRecInput.shard` cuts them) comes instead from
    `worker_batches(rank, step)`: worker `rank`'s feeds.
    """
    if isinstance(split, SplitPlan):
        raise SplitrunError("run_threaded needs what split_program(program, cluster, mode) "
                            "returns (the plan with the program it runs); split(...) gives "
                            "the plan alone")
    if not isinstance(split, SplitProgram):
        raise SplitrunError(f"run_threaded needs what split_program(program, cluster, mode) "
                            f"returns, got {type(split).__name__}")
    if (batches is None) == (worker_batches is None):
        raise SplitrunError("run_threaded takes batches(step) or worker_batches(rank, step)")
    plan = split.plan
    hub = LoopbackHub(plan.labels)
    rendezvous = InProcessRendezvous(recv_timeout_s)  # parallel mode's process groups
    processes = {label: ProcessRuntime(split, label, hub.transport(label), device=device,
                                       state=state, recv_timeout_s=recv_timeout_s,
                                       rendezvous=rendezvous)
                 for label in plan.labels}
    for label in plan.labels:  # every message is checked against its contract
        hub.transport(label).expect(receive_contracts(plan, split.program, label))
    dumped: dict[str, torch.Tensor] = {}
    history: list[dict[str, torch.Tensor]] = [{} for _ in range(num_steps)]
    failures: list[tuple[Label, BaseException]] = []
    lock = threading.Lock()
    sharded = plan.mode in (ModeKind.PARAMETER_SERVER, ModeKind.EMBEDDING_CACHE)
    steps = _StepFeeds(batches or (lambda step: {}), split.program.hparams, len(plan.labels))

    def batch_for(label: Label, step: int) -> Mapping[str, torch.Tensor] | None:
        if label.role is not Role.WORKER or step >= num_steps:
            return None
        batch = steps.batch(step)  # asked for in step order, hyperparameters with it
        if worker_batches is not None:
            return worker_batches(label.rank, step)
        return shard_batch(batch, label.rank, plan.cluster.num_workers) if sharded else batch

    def work(label: Label, process: ProcessRuntime) -> None:
        try:
            for step in range(num_steps):
                outputs = process.run_step(step, batch_for(label, step),
                                           next_batch=batch_for(label, step + 1),
                                           hparams=steps.hparams(step))
                steps.done(step)
                with lock:
                    history[step].update(outputs)
            if label == Label.worker(0):
                dumped.update(process.dump_tables(num_steps))  # the whole tables
        except BaseException as exc:  # noqa: BLE001 - reported to the caller below
            with lock:
                failures.append((label, exc))
            if not isinstance(exc, PeerFailed):
                hub.abort(PeerFailed(f"stopped because {label.describe()} failed: {exc}"))

    threads = [threading.Thread(target=work, args=(label, process), name=f"splitrun-{label}",
                                daemon=True)
               for label, process in processes.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=num_steps * recv_timeout_s + _JOIN_GRACE_S)
    for process in processes.values():
        process.close()
    stuck = [t.name for t in threads if t.is_alive()]
    if stuck:
        raise SplitrunError(f"threads {', '.join(stuck)} did not finish; a step hangs")
    if failures:
        original = [f for f in failures if not isinstance(f[1], PeerFailed)] or failures
        raise original[0][1]
    final_state: dict[str, torch.Tensor] = dict(dumped)
    for process in processes.values():
        final_state.update(process.state)
    counters = {label: process.cache_counters for label, process in processes.items()
                if process.has_cache}
    return ThreadedRun(history, final_state,
                       {label: process.stats for label, process in processes.items()}, counters)


class _StepFeeds:
    """Each step's global batch and hyperparameters, made once for all
    `num_threads` threads: `batches(step)` in step order, each step's
    hyperparameters read right after its batch (the order of a launched job's
    loop). A step's are dropped once every thread is done with it."""

    def __init__(self, batches: Callable[[int], Mapping[str, torch.Tensor]],
                 hparams: Callable[[int], dict[str, torch.Tensor]], num_threads: int) -> None:
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
        return self._get(step)[1]

    def done(self, step: int) -> None:
        """One thread finished `step` (and needs nothing of it any more)."""
        with self._lock:
            self._done[step] = self._done.get(step, 0) + 1
            if self._done[step] == self._num_threads:
                self._made.pop(step, None)
                del self._done[step]
