"""Run every process of a plan as a thread of this process, over loopback.

The way to test a split without sockets: results must equal the unsplit step.
The first failure aborts every other thread's pending receive with an error
naming the failed process.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from splitrun.splitter.labels import Label, Role
from splitrun.splitter.plan import ModeKind, SplitPlan
from splitrun.splitter.program import Program

from .embedding.attach import attach_cache
from .data import shard_batch
from .errors import PeerFailed, SplitrunError
from .executor import Executor, ExecutorStats
from .transport.loopback import LoopbackHub

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


def run_threaded(plan: SplitPlan, num_steps: int,
                 batches: Callable[[int], Mapping[str, torch.Tensor]], *,
                 state: Mapping[str, torch.Tensor] | None = None,
                 program: Program | None = None, recv_timeout_s: float = 30.0,
                 device: str = "cpu") -> ThreadedRun:
    """Train `num_steps` steps of the split program; `batches(step)` gives the
    global batch's feeds, the program's optimizer the hyperparameters.

    In parameter-server mode each worker gets its shard of the global batch,
    as `Trainer.shard` gives it in a real job.
    """
    program = program or plan.program
    state = program.initial_state if state is None else state
    hub = LoopbackHub(plan.labels)
    caches = {label: attach_cache(plan, label, hub.transport(label), 0, state=state,
                                  device=device, timeout_s=recv_timeout_s)
              for label in plan.labels}
    executors = {label: Executor(plan, label, hub.transport(label), program=program,
                                 device=device, recv_timeout_s=recv_timeout_s,
                                 bindings=caches[label].bindings)
                 for label in plan.labels}
    for executor in executors.values():
        executor.load_state(state)
    dumped: dict[str, torch.Tensor] = {}
    history: list[dict[str, torch.Tensor]] = [{} for _ in range(num_steps)]
    failures: list[tuple[Label, BaseException]] = []
    lock = threading.Lock()

    sharded = plan.mode in (ModeKind.PARAMETER_SERVER, ModeKind.EMBEDDING_CACHE)

    def feeds_for(label: Label, step: int) -> dict[str, torch.Tensor]:
        if label.role is not Role.WORKER:
            return program.hparams(step)
        batch = batches(step)
        if sharded:
            batch = shard_batch(batch, label.rank, plan.cluster.num_workers)
        return {**batch, **program.hparams(step)}

    def work(label: Label, executor: Executor) -> None:
        client = caches[label].client
        try:
            for step in range(num_steps):
                feeds = feeds_for(label, step)
                if client is not None:
                    client.step = step
                    client.next_feeds = feeds_for(label, step + 1) if step + 1 < num_steps \
                        else None
                outputs = executor.run_step(step, feeds)
                with lock:
                    history[step].update(outputs)
            if client is not None and label == Label.worker(0):
                dumped.update(client.dump(num_steps))  # the whole tables, from the servers
        except BaseException as exc:  # noqa: BLE001 - reported to the caller below
            with lock:
                failures.append((label, exc))
            if not isinstance(exc, PeerFailed):
                hub.abort(PeerFailed(f"stopped because {label.describe()} failed: {exc}"))

    threads = [threading.Thread(target=work, args=(label, ex), name=f"splitrun-{label}",
                                daemon=True)
               for label, ex in executors.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=num_steps * recv_timeout_s + _JOIN_GRACE_S)
    for parts in caches.values():
        parts.close()
    stuck = [t.name for t in threads if t.is_alive()]
    if stuck:
        raise SplitrunError(f"threads {', '.join(stuck)} did not finish; a step hangs")
    if failures:
        original = [f for f in failures if not isinstance(f[1], PeerFailed)] or failures
        raise original[0][1]
    final_state: dict[str, torch.Tensor] = dict(dumped)
    for executor in executors.values():
        final_state.update(executor.state)
    counters = {label: parts.client.counters for label, parts in caches.items()
                if parts.client is not None}
    return ThreadedRun(history, final_state, {l: e.stats for l, e in executors.items()},
                       counters)
