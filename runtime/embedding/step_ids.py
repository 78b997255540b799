"""One table's ids of one step, made unique once.

The lookup (which rows to gather), the cache (hits and misses are counted and
pulled by unique id) and the gradient (summed per unique id before it is
applied or sent) all read the same `StepIds`: one `torch.unique` per table
and step, computed when the step's lookup runs, or a step early when the
client prefetches the next batch's rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["StepIds"]


@dataclass(frozen=True)
class StepIds:
    ids: torch.Tensor       # the lookups' ids, flat, int64 on the CPU, in batch order
    unique: torch.Tensor    # the distinct ids, sorted
    inverse: torch.Tensor   # batch position -> index into `unique`
    counts: torch.Tensor    # lookups of each unique id

    @classmethod
    def of(cls, ids: torch.Tensor) -> StepIds:
        flat = ids.reshape(-1).to("cpu", torch.int64)
        unique, inverse, counts = torch.unique(flat, sorted=True, return_inverse=True,
                                               return_counts=True)
        return cls(flat, unique, inverse, counts)

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
