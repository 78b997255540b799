"""One table's ids of one step, made unique once.

The lookup (which rows to gather), the cache (hits and misses are counted and
pulled by unique id) and the gradient (summed per unique id before it is
applied or sent) all read the same `StepIds`: one stable sort of the ids per
table and step (`ops.bags.sorted_groups`: the unique ids, the inverse,
the counts, and the order a bag's gradient is summed per unique id in),
computed when the step's lookup runs, or a step early when the client
prefetches the next batch's rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitrun.splitter.ops.bags import sorted_groups

__all__ = ["StepIds"]


@dataclass(frozen=True)
class StepIds:
    ids: torch.Tensor       # the lookups' ids, flat, int64 on the CPU, in batch order
    unique: torch.Tensor    # the distinct ids, sorted
    inverse: torch.Tensor   # batch position -> index into `unique`
    counts: torch.Tensor    # lookups of each unique id
    order: torch.Tensor     # batch positions grouped by id (batch order within an id)
    starts: torch.Tensor    # where each unique id's positions start in `order`

    @classmethod
    def of(cls, ids: torch.Tensor) -> StepIds:
        flat = ids.reshape(-1).to("cpu", torch.int64)
        groups = sorted_groups(flat)
        return cls(flat, groups.unique, groups.inverse, groups.counts, groups.order,
                   groups.starts)

    @property
    def num_lookups(self) -> int:
        return self.ids.numel()

    def holds(self, ids: torch.Tensor) -> bool:
        """True if `ids` are these ids, in this order (whatever their shape):
        then this unique serves them."""
        if ids.numel() != self.ids.numel():
            return False
        return bool(torch.equal(ids.reshape(-1).to("cpu", torch.int64), self.ids))

    def reduce(self, values: torch.Tensor) -> torch.Tensor:
        """Per-lookup rows `values` ([lookups, ...] or the ids' shape plus the
        row's) summed per unique id, in `unique`'s order: one `index_add_`
        over the lookups, each unique id's values added in batch order (as
        torch's own coalescing of a sparse gradient adds them)."""
        flat = values.reshape(self.num_lookups, -1)
        summed = torch.zeros((self.unique.numel(), flat.shape[1]), dtype=flat.dtype,
                             device=flat.device)
        return summed.index_add_(0, self.inverse.to(flat.device), flat)
