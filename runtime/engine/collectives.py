"""Parallel mode's `torch.distributed` backend: one process group per parallel group.

A split made with `ParallelMode(backend="torch_distributed")` holds, per
member, collective nodes that read only the member's own piece
(`splitrun.splitter.ops.collectives`). `attach_collectives` binds
them, for one process, to a process group of its parallel group: gloo when
the process computes on the CPU, NCCL on CUDA. The group is formed on the
first collective (every member reaches it in the same step), through a
`Rendezvous` (the job's scheduler, or an in-process store for threads), and
shut down when the process closes.

Every wait has a deadline: forming the group is bounded by the rendezvous's
timeout, every collective by `timeout_s` (the process's receive deadline).
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from splitrun.splitter.labels import Label
from splitrun.splitter.ops import collectives as collective_ops
from splitrun.splitter.splitting.graph_splitter import SplitProgram

from ..cluster.rendezvous import Rendezvous
from ..errors import ClusterError, CollectiveFailed, SplitrunError

__all__ = ["CollectiveStats", "ProcessGroupCollectives", "CollectiveParts",
           "attach_collectives"]

logger = logging.getLogger(__name__)


@dataclass
class CollectiveStats:
    """Collectives this process ran and the bytes of its inputs (what it
    contributed; how many bytes the backend's algorithm sends is its own)."""

    calls: int = 0
    input_bytes: int = 0


class ProcessGroupCollectives:
    """`label`'s side of its parallel group's collectives.

    `group_index`, `position` and `size`: the group (index in the layout's
    groups), this member's place in it and its size. The methods take the
    marker ops' arguments (`collective_ops`), so they bind one to one.
    """

    def __init__(self, label: Label, group_name: str, group_index: int, position: int,
                 size: int, rendezvous: Rendezvous, *, device: torch.device,
                 timeout_s: float) -> None:
        self.label = label
        self.group_name = group_name
        self.group_index = group_index
        self.position = position
        self.size = size
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self.stats = CollectiveStats()
        self._rendezvous = rendezvous
        self._store: dist.Store | None = None
        self._group = None
        self._tag = f"[{label.describe()}]"

    # -- the group --

    @property
    def backend_name(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    def _form(self):
        """Meet the other members and build the process group (bounded by the
        rendezvous's timeout)."""
        init = datetime.timedelta(seconds=self._rendezvous.timeout_s)
        ops = datetime.timedelta(seconds=self.timeout_s)
        try:
            self._store = self._rendezvous.store(self.group_name, self.position, self.size)
            self._store.set_timeout(init)
            if self.device.type == "cuda":
                if not dist.is_nccl_available():
                    raise ClusterError("this torch build has no NCCL")
                torch.cuda.set_device(self.device)
                self._refuse_shared_gpu()
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = ops
                group = dist.ProcessGroupNCCL(self._store, self.position, self.size, options)
            else:
                if not dist.is_gloo_available():
                    raise ClusterError("this torch build has no gloo")
                options = dist.ProcessGroupGloo._Options()
                options._devices = [dist.ProcessGroupGloo.create_device(
                    hostname=self._rendezvous.host)]
                options._timeout = init  # connecting to the others is bounded by this
                group = dist.ProcessGroupGloo(self._store, self.position, self.size, options)
                group.set_timeout(ops)  # and every collective by this
        except (RuntimeError, ClusterError) as exc:
            raise CollectiveFailed(
                f"{self._tag} forming the {self.backend_name} process group {self.group_name} "
                f"(member {self.position} of {self.size}) failed within "
                f"{self._rendezvous.timeout_s:g} s: {exc}; every member of the group must "
                f"start and reach its first collective") from exc
        logger.info("%s joined %s process group %s as member %d of %d", self._tag,
                    self.backend_name, self.group_name, self.position, self.size)
        return group

    def _refuse_shared_gpu(self) -> None:
        """NCCL refuses two members of one communicator on one GPU ("Duplicate
        GPU detected", reported late and as an internal error). Every member
        publishes its GPU's UUID and reads the others' first, so a job that
        would hit it is told which members share which GPU, and what to do."""
        uuid = str(torch.cuda.get_device_properties(self.device).uuid)
        self._store.set(f"gpu/{self.position}", uuid)
        for other in range(self.size):
            if other == self.position:
                continue
            if self._store.get(f"gpu/{other}").decode() == uuid:
                first, second = sorted((self.position, other))
                raise CollectiveFailed(
                    f"{self._tag} process group {self.group_name}: members {first} and "
                    f"{second} would share one GPU ({self.device}, {uuid}), and NCCL runs "
                    f"one member per GPU; give "
                    f"each process of the group its own GPU (as many GPUs on each host as "
                    f"processes there), or use ParallelMode's default channels backend, "
                    f"which runs any number of processes on one GPU")

    def _pg(self, group: int):
        if group != self.group_index:
            raise SplitrunError(
                f"{self._tag} a collective of parallel group {group} reached a member of "
                f"group {self.group_index}; the plan and this process disagree")
        if self._group is None:
            self._group = self._form()
        return self._group

    def _run(self, what: str, group: int, piece: torch.Tensor,
             start: Callable[[object], object]) -> None:
        """Start one collective on the group (`start(process_group)` returns
        its work) and wait for it with the deadline."""
        work = start(self._pg(group))
        try:
            work.wait(datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            raise CollectiveFailed(
                f"{self._tag} {what} on {self.backend_name} process group {self.group_name} "
                f"failed or did not finish within {self.timeout_s:g} s: {exc}; a member of "
                f"the group may have died or be stuck") from exc
        self.stats.calls += 1
        self.stats.input_bytes += piece.numel() * piece.element_size()

    # -- the collectives (the marker ops' signatures) --

    def all_reduce(self, piece: torch.Tensor, group: int, num: int) -> torch.Tensor:
        total = piece.clone(memory_format=torch.contiguous_format)  # others may read piece
        self._run("all-reduce", group, piece, lambda pg: pg.allreduce([total]))
        return total

    def all_gather(self, piece: torch.Tensor, dim: int, group: int, num: int) -> torch.Tensor:
        piece = piece.contiguous()
        pieces = [torch.empty_like(piece) for _ in range(num)]
        self._run("all-gather", group, piece, lambda pg: pg.allgather([pieces], [piece]))
        return torch.cat(pieces, dim)

    def reduce_scatter(self, piece: torch.Tensor, dim: int, group: int,
                       num: int) -> torch.Tensor:
        chunks = [c.contiguous() for c in piece.chunk(num, dim)]
        mine = torch.empty_like(chunks[self.position])
        self._run("reduce-scatter", group, piece, lambda pg: pg.reduce_scatter([mine], [chunks]))
        return mine

    def all_to_all(self, piece: torch.Tensor, src_dim: int, dst_dim: int, group: int,
                   num: int) -> torch.Tensor:
        outgoing = torch.stack(piece.chunk(num, dst_dim)).contiguous()  # chunk j to member j
        incoming = torch.empty_like(outgoing)
        self._run("all-to-all", group, piece,
                  lambda pg: pg.alltoall_base(incoming, outgoing, [], []))
        return torch.cat(incoming.unbind(0), src_dim)

    def all_gather_stacked(self, piece: torch.Tensor, group: int, num: int) -> torch.Tensor:
        piece = piece.contiguous()
        pieces = [torch.empty_like(piece) for _ in range(num)]
        self._run("all-gather", group, piece, lambda pg: pg.allgather([pieces], [piece]))
        return torch.stack(pieces)

    def bindings(self) -> dict[Callable, Callable]:
        """The executor's bindings: marker op -> this group's implementation."""
        return {
            collective_ops.all_reduce: self.all_reduce,
            collective_ops.all_gather: self.all_gather,
            collective_ops.reduce_scatter: self.reduce_scatter,
            collective_ops.all_to_all: self.all_to_all,
            collective_ops.all_gather_stacked: self.all_gather_stacked,
        }

    def close(self) -> None:
        """Shut the process group down (at the end of the job)."""
        group, self._group = self._group, None
        if group is not None:
            try:
                group.shutdown()
            except RuntimeError as exc:  # already broken: nothing more to release
                logger.debug("%s process group shutdown: %s", self._tag, exc)
        self._store = None


@dataclass
class CollectiveParts:
    """What `attach_collectives` gives a process: the group (None when the
    split runs its collectives as channels) and the executor's bindings."""

    group: ProcessGroupCollectives | None = None
    bindings: dict = field(default_factory=dict)

    def close(self) -> None:
        if self.group is not None:
            self.group.close()


def attach_collectives(split: SplitProgram, label: Label, rendezvous: Rendezvous | None, *,
                       device: torch.device | str = "cpu",
                       timeout_s: float = 120.0) -> CollectiveParts:
    """`label`'s process group, when `split` asks for one and `label` is in a group."""
    groups = split.artifacts.process_groups
    index = next((i for i, group in enumerate(groups) if label in group), None)
    if index is None:
        return CollectiveParts()
    if rendezvous is None:
        raise SplitrunError(
            f"[{label.describe()}] the split runs its collectives on torch.distributed "
            f"process groups, but no rendezvous was given to form them; run it through "
            f"`Job.start` or `run_threaded`, or split with backend='channels'")
    group = groups[index]
    collectives = ProcessGroupCollectives(
        label, f"group-{group[0]}", index, group.index(label), len(group), rendezvous,
        device=torch.device(device), timeout_s=timeout_s)
    return CollectiveParts(collectives, collectives.bindings())
