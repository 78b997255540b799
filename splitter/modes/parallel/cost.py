"""What a change of placement costs: bytes that leave the group's processes.

Costs are totals over the group's members per step (what the executors' send
counters add up to); per rank it is the total divided by N. With |v| the
value's full size in bytes:

- equal placements: 0; `R -> S(d)`, `R -> P`: no bytes (a local slice, or
  member 0 keeping the value and the others zeros), a tie-breaking epsilon.
- `S(d) -> R` (all-gather): (N-1)·|v|.
- `P -> S(d)` (reduce-scatter): (N-1)·|v|.
- `P -> R` (all-reduce as reduce-scatter then all-gather): 2(N-1)·|v|, i.e.
  2(N-1)/N·|v| per rank as in a ring; a value with no dimension that divides
  by N is summed point to point instead: N(N-1)·|v| (at N = 2, which every
  value of a group of 2 is, the same bytes as the ring, in one message).
- `S(d) -> S(e)` (all-to-all): (N-1)/N·|v|.
- `S(d) -> P`: not offered (never cheaper than keeping the shard).
"""

from __future__ import annotations

import math
from enum import Enum

from .placement import Placement

__all__ = ["CollectiveKind", "INFEASIBLE", "LOCAL_CHANGE_COST", "COLLECTIVE_COST", "bytes_of",
           "redistribute_kind", "redistribute_bytes", "chunk_dim"]

INFEASIBLE = math.inf
# A local change of placement sends nothing, but it keeps a whole copy where a
# shard would do: a tie-breaker far below one byte, so that among equal
# layouts the one without needless copies wins. `bytes_of` rounds it away.
LOCAL_CHANGE_COST = 1e-6
# Every collective also costs a message round: a tie-breaker below one byte,
# so that among layouts sending equal bytes the one with fewer collectives wins
# (one all-reduce, not a reduce-scatter and an all-gather around an op).
COLLECTIVE_COST = 1e-3


def bytes_of(cost: float) -> int:
    """The bytes in a total cost (without the tie-breakers, which add up to
    less than one byte for any step of fewer than 500 collectives)."""
    return int(math.floor(cost + 1e-6))


class CollectiveKind(Enum):
    NONE = "none"
    SLICE = "slice"              # R -> S, local
    ZERO_OTHERS = "zero_others"  # R -> P, local
    ALL_GATHER = "all-gather"
    REDUCE_SCATTER = "reduce-scatter"
    ALL_REDUCE = "all-reduce"
    ALL_TO_ALL = "all-to-all"
    EXCHANGE = "exchange"        # every member sends a small summary to every other
    GROUP_TO_GROUP = "group-to-group"  # member j of one group to member j of another


def redistribute_kind(src: Placement, dst: Placement) -> CollectiveKind | None:
    if src == dst:
        return CollectiveKind.NONE
    if src.is_replicate:
        return CollectiveKind.SLICE if dst.is_shard else CollectiveKind.ZERO_OTHERS
    if src.is_partial:
        return CollectiveKind.REDUCE_SCATTER if dst.is_shard else CollectiveKind.ALL_REDUCE
    if dst.is_replicate:
        return CollectiveKind.ALL_GATHER
    if dst.is_shard:
        return CollectiveKind.ALL_TO_ALL
    return None


def chunk_dim(shape: tuple[int, ...], n: int) -> int | None:
    """The dimension an all-reduce's reduce-scatter cuts: the largest that
    divides by n (the first of equals), or None."""
    best = None
    for d, size in enumerate(shape):
        if size % n == 0 and size >= n and (best is None or size > shape[best]):
            best = d
    return best


def redistribute_bytes(src: Placement, dst: Placement, shape: tuple[int, ...],
                       itemsize: int, n: int) -> float:
    """Bytes all members send together to turn a value placed `src` into `dst`."""
    kind = redistribute_kind(src, dst)
    if kind is None:
        return INFEASIBLE
    if n == 1:
        return 0
    size = math.prod(shape) * itemsize
    if kind is CollectiveKind.NONE:
        return 0
    if kind in (CollectiveKind.SLICE, CollectiveKind.ZERO_OTHERS):
        return LOCAL_CHANGE_COST
    if kind in (CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER):
        return (n - 1) * size + COLLECTIVE_COST
    if kind is CollectiveKind.ALL_TO_ALL:
        return (n - 1) * size // n + COLLECTIVE_COST
    if chunk_dim(shape, n) is None:
        return n * (n - 1) * size + COLLECTIVE_COST
    return 2 * (n - 1) * size + COLLECTIVE_COST
