"""Dense gradients averaged between the workers (parameter-server and
embedding-cache modes with `dense="worker"`).

The split holds one `all_reduce_mean` node per step on every worker
(`splitrun.splitter.ops.worker_all_reduce`). `attach_worker_all_reduce` binds it
to a `torch.distributed` process group of all the workers (gloo on the CPU,
NCCL on CUDA; `collectives.ProcessGroupCollectives`, formed through the
rendezvous on the first step): the gradients are flattened into one buffer,
summed by one all-reduce, divided by the number of workers and cut back
into their shapes. With two workers the sum is the servers' (a + b in
either order), so the result equals the servers' mean bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from splitrun.splitter.labels import Label, Role
from splitrun.splitter.ops.worker_all_reduce import all_reduce_mean
from splitrun.splitter.splitting.graph_splitter import SplitProgram

from ..cluster.rendezvous import Rendezvous
from ..errors import SplitrunError
from .collectives import CollectiveStats, ProcessGroupCollectives

__all__ = ["WorkerAllReduce", "WorkerAllReduceParts", "attach_worker_all_reduce"]

# The process group's name in the rendezvous (one per job incarnation).
_GROUP = "workers"


class WorkerAllReduce:
    """This worker's side of the workers' gradient average."""

    def __init__(self, group: ProcessGroupCollectives) -> None:
        self.group = group

    @property
    def stats(self) -> CollectiveStats:
        return self.group.stats

    def average(self, grads: list[torch.Tensor], *, num_workers: int) -> tuple[torch.Tensor, ...]:
        if num_workers != self.group.size:
            raise SplitrunError(f"[{self.group.label.describe()}] the plan averages over "
                                f"{num_workers} workers but this job has {self.group.size}")
        flat = torch.cat([g.reshape(-1) for g in grads])
        total = self.group.all_reduce(flat, 0, num_workers)
        mean = total.div_(num_workers)
        return tuple(part.view_as(g) for part, g in zip(
            mean.split([g.numel() for g in grads]), grads))

    def close(self) -> None:
        self.group.close()


@dataclass
class WorkerAllReduceParts:
    average: WorkerAllReduce | None = None
    bindings: dict = field(default_factory=dict)

    def close(self) -> None:
        if self.average is not None:
            self.average.close()


def attach_worker_all_reduce(split: SplitProgram, label: Label, rendezvous: Rendezvous | None,
                             *, device: torch.device | str = "cpu",
                             timeout_s: float = 120.0) -> WorkerAllReduceParts:
    """The workers' process group, when `label` is a worker of a split that
    averages dense gradients between its workers."""
    if label.role is not Role.WORKER or not any(
            node.target is all_reduce_mean for node in split.program.graph.nodes):
        return WorkerAllReduceParts()
    if rendezvous is None:
        raise SplitrunError(
            f"[{label.describe()}] the split averages dense gradients between the workers on "
            f"a torch.distributed process group, but no rendezvous was given to form it; run "
            f"it through `Job.start` or `run_threaded`")
    num_workers = split.plan.cluster.num_workers
    group = ProcessGroupCollectives(label, _GROUP, 0, label.rank, num_workers, rendezvous,
                                    device=torch.device(device), timeout_s=timeout_s)
    average = WorkerAllReduce(group)
    return WorkerAllReduceParts(average, {all_reduce_mean: average.average})
