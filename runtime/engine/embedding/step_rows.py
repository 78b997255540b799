"""A worker's rows of a dynamic table (`DynamicTable`: ids any int64) for
the step it runs, where it caches none (several workers, or policy
"none"): the step's distinct ids' rows, pulled from their servers every
step, at slot = the id's rank among them, and nothing kept across steps.

It stands where a `RowCache` stands (the client plans, installs and reads
it the same way). Its gradients go to the servers every step
(write-through), and a server makes the step's new rows once it has heard
every worker's ids of the step (`store.py`). One worker caches a dynamic
table's rows in a `RowCache` instead: there its servers' word after each
pull (which ids have rows, which expired) keeps the cache exact.
"""

from __future__ import annotations

import torch

from splitrun.splitter.ops.cache import CachedTable, EvictionPolicy

from ...errors import CacheError
from .dynamic_rows import check_dynamic_ids
from .row_cache import BatchPlan, TableCounters
from .step_ids import StepIds

__all__ = ["StepRows"]

_NO_IDS = torch.empty(0, dtype=torch.int64)


class StepRows:
    def __init__(self, table: CachedTable, device: torch.device | str = "cpu") -> None:
        self.table = table
        self.policy = EvictionPolicy.NONE  # nothing is reused across steps
        self.device = torch.device(device)
        self.rows = torch.empty(0, table.dim, dtype=table.dtype, device=self.device)
        self.state: dict[str, torch.Tensor] = {}  # on the servers (write-through)
        self.counters = TableCounters()
        self._buffer = self.rows
        self._step: int | None = None

    def check_ids(self, ids: torch.Tensor) -> None:
        check_dynamic_ids(ids, self.table.key)

    def plan(self, ids: torch.Tensor | StepIds, step: int, *, write_back: bool,
             max_staleness: int, keep_since: int | None = None) -> BatchPlan:
        """Slots for the step's distinct ids (sorted: slot k is the k-th
        smallest); every one of them is pulled."""
        if isinstance(ids, StepIds):
            step_ids = ids
        else:
            self.check_ids(ids)
            step_ids = StepIds.of(ids)
        if self._step == step:
            raise CacheError(
                f"dynamic table {self.table.key!r} is looked up twice in step {step}; its "
                f"servers make a step's rows from the step's ids once: look it up once "
                f"(concatenate the ids)")
        self._step = step
        unique = step_ids.unique
        count = unique.numel()
        if self._buffer.shape[0] < count:
            self._buffer = torch.empty(max(count, 2 * self._buffer.shape[0]), self.table.dim,
                                       dtype=self.table.dtype, device=self.device)
        self.rows = self._buffer[:count]
        slots = torch.arange(count)
        return BatchPlan(step_ids.ids, step_ids.inverse, count, unique, slots, _NO_IDS, _NO_IDS,
                         0, slots, step_ids)

    def install(self, slots: torch.Tensor, rows: torch.Tensor,
                state: dict[str, torch.Tensor], fresh_for: int | None) -> None:
        self.rows.index_copy_(0, slots.to(self.device), rows.to(self.device, self.rows.dtype))

    def dirty_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """None: its rows are updated on its servers (a flush writes nothing back)."""
        return _NO_IDS, _NO_IDS
