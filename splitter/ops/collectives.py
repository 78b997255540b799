"""Collectives as graph nodes, for the `torch.distributed` backend.

Under the default backend a collective is spelled out as sends and receives
between the members (`rewrite.py`). Under `CollectiveBackend.TORCH_DISTRIBUTED`
each member instead gets one node that reads only its own piece and calls one
of the functions below; the runtime binds them to a process group formed for
the member's group (`splitrun.runtime.engine.collectives`), so the members call
all-reduce, all-gather, reduce-scatter or all-to-all on it together.

These functions are markers: called on real tensors they raise (nothing here
knows a process group); on fake tensors they give the output's shape, which is
all planning needs. Each takes the member's piece first, then plain
arguments; `group` is the index of the parallel group (in `ParallelMode`'s
groups) and `num` its size.

The rewrite puts a collective's nodes for all members next to each other in
the graph's order, so the global order the splitter schedules by stays a valid
sequential schedule with each collective as one step: no deadlock.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

import torch
from torch._subclasses.fake_tensor import FakeTensor

from ..errors import PlanError, SplitrunError

__all__ = ["CollectiveBackend", "CollectiveUnbound", "all_reduce", "all_gather",
           "reduce_scatter", "all_to_all", "all_gather_stacked",
           "FinishGathered"]


class CollectiveBackend(Enum):
    """How a parallel group's collectives travel."""

    CHANNELS = "channels"                    # sends and receives on splitrun channels
    TORCH_DISTRIBUTED = "torch_distributed"  # a gloo (CPU) or NCCL (CUDA) process group

    @classmethod
    def parse(cls, value: CollectiveBackend | str) -> CollectiveBackend:
        if isinstance(value, cls):
            return value
        text = str(value).strip().lower().replace(".", "_").replace("-", "_")
        for backend in cls:
            if text == backend.value:
                return backend
        raise PlanError(f"parallel mode: unknown collective backend {value!r}; use one of "
                        f"{', '.join(repr(b.value) for b in cls)}")


class CollectiveUnbound(SplitrunError):
    """A torch.distributed collective node run without a process group."""


def _planning(piece: torch.Tensor, name: str) -> None:
    if not isinstance(piece, FakeTensor):
        raise CollectiveUnbound(
            f"collective {name} runs on the torch.distributed backend, but this executor "
            f"has no process group bound to it; run the split through `Job.start` or "
            f"`run_threaded` (they form the group), or split with the default channel "
            f"backend (ParallelMode(backend='channels'))")


def _resized(piece: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    shape = list(piece.shape)
    shape[dim] = size
    return piece.new_empty(shape)


def all_reduce(piece: torch.Tensor, group: int, num: int) -> torch.Tensor:
    """The sum of every member's `piece` (P -> R)."""
    _planning(piece, "all_reduce")
    return piece.new_empty(piece.shape)


def all_gather(piece: torch.Tensor, dim: int, group: int, num: int) -> torch.Tensor:
    """Every member's shard concatenated along `dim` in rank order (S(dim) -> R)."""
    _planning(piece, "all_gather")
    return _resized(piece, dim, piece.shape[dim] * num)


def reduce_scatter(piece: torch.Tensor, dim: int, group: int, num: int) -> torch.Tensor:
    """This member's chunk along `dim` of the sum of every member's `piece`
    (P -> S(dim))."""
    _planning(piece, "reduce_scatter")
    return _resized(piece, dim, piece.shape[dim] // num)


def all_to_all(piece: torch.Tensor, src_dim: int, dst_dim: int, group: int,
               num: int) -> torch.Tensor:
    """A shard on `src_dim` becomes a shard on `dst_dim` (S(src) -> S(dst))."""
    _planning(piece, "all_to_all")
    shape = list(piece.shape)
    shape[src_dim] *= num
    shape[dst_dim] //= num
    return piece.new_empty(shape)


def all_gather_stacked(piece: torch.Tensor, group: int, num: int) -> torch.Tensor:
    """Every member's `piece` (equal shapes), stacked in rank order on a new
    first dimension: the summaries of an exchange."""
    _planning(piece, "all_gather_stacked")
    return piece.new_empty((num, *piece.shape))


class FinishGathered:
    """An exchange's `finish` fed by `all_gather_stacked`'s one tensor instead
    of one summary per member (`finish(index, num, args, *summaries)`)."""

    def __init__(self, finish: Callable) -> None:
        self.finish = finish
        self.__name__ = f"{getattr(finish, '__name__', 'finish')}_gathered"

    def __call__(self, index: int, num: int, args: tuple, gathered: torch.Tensor):
        return self.finish(index, num, args, *gathered.unbind(0))
