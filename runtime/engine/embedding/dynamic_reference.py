"""The dynamic tables' admission and expiry policy in plain Python, one id at
a time: the specification `dynamic_rows.DynamicRows` (vectorized) is tested
against, and the benchmark's check (bench/dynamic_tables.py).

One server's rows of one table, at step `step` with the ids of the step it
owns (`DynamicTable` names the knobs: k = admit_after, T =
expire_after_steps, R = row_budget):

1. age: rows last touched more than T steps ago (step - last > T) expire;
   ids waiting for admission last seen more than T steps ago are forgotten.
2. each distinct id, once: a row's frequency grows by one and it is touched
   (last = step); any other id's sightings grow by one, and at k it is
   admitted (its frequency starts at k).
3. budget: if the rows plus the admitted ids pass R, the rows not touched at
   this step with the smallest (frequency, last touched, id) expire until R
   hold; if the step's own rows alone pass R, `RowBudgetError`.
4. the admitted ids become rows, touched at this step.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass

from splitrun.splitter.ops.dynamic_table import DynamicTable

from ...errors import CacheError

__all__ = ["RowBudgetError", "ReferencePolicy", "StepOutcome"]


class RowBudgetError(CacheError):
    """A row budget that cannot hold the rows one step needs."""


def budget_message(table: str, server: int, budget: int, touched: int, admitted: int) -> str:
    return (f"dynamic table {table!r} on server {server}: this step needs {touched + admitted} "
            f"rows ({touched} in use and {admitted} admitted) but its row budget is {budget} "
            f"rows; raise DynamicTable(row_budget=...) to at least {touched + admitted}, or "
            f"use more servers or smaller batches")


@dataclass
class StepOutcome:
    admitted: list[int]
    expired: list[int]      # ids whose rows were dropped at this step (age, then budget)


class ReferencePolicy:
    def __init__(self, policy: DynamicTable, table: str = "table", server: int = 0) -> None:
        self.policy = policy
        self.table = table
        self.server = server
        self.rows: dict[int, tuple[int, int]] = {}        # id -> (frequency, last touched)
        self.waiting: dict[int, tuple[int, int]] = {}     # id -> (sightings, last seen)
        self.num_admitted = 0
        self.num_expired = 0
        self._heap: list[tuple[int, int, int]] = []       # (frequency, last, id), lazily valid
        # With an age limit: step -> the ids last touched (rows) or seen (waiting) then.
        self._rows_at: dict[int, set[int]] = {}
        self._waiting_at: dict[int, set[int]] = {}

    def step(self, step: int, ids: Iterable[int]) -> StepOutcome:
        k, age, budget = (self.policy.admit_after, self.policy.expire_after_steps,
                          self.policy.row_budget)
        expired = []
        if age is not None:
            for last in [s for s in self._rows_at if step - s > age]:
                for i in self._rows_at.pop(last):
                    del self.rows[i]
                    expired.append(i)
            for last in [s for s in self._waiting_at if step - s > age]:
                for i in self._waiting_at.pop(last):
                    del self.waiting[i]
        admitted, touched = [], 0
        for i in sorted(set(int(i) for i in ids)):
            if i in self.rows:
                frequency, last = self.rows[i]
                self.rows[i] = (frequency + 1, step)
                self._moved(self._rows_at, i, last, step)
                self._push(i)
                touched += 1
                continue
            seen, last = self.waiting.pop(i, (0, None))
            self._moved(self._waiting_at, i, last, None)
            if seen + 1 >= k:
                admitted.append((i, seen + 1))
            else:
                self.waiting[i] = (seen + 1, step)
                self._moved(self._waiting_at, i, None, step)
        if budget is not None and len(self.rows) + len(admitted) > budget:
            if touched + len(admitted) > budget:
                raise RowBudgetError(budget_message(self.table, self.server, budget, touched,
                                                    len(admitted)))
            expired += self._least_used(len(self.rows) + len(admitted) - budget, step)
        for i, seen in admitted:
            self.rows[i] = (seen, step)
            self._moved(self._rows_at, i, None, step)
            self._push(i)
        self.num_admitted += len(admitted)
        self.num_expired += len(expired)
        if len(self._heap) > 4 * len(self.rows) + 1024:
            self._heap = [(f, last, i) for i, (f, last) in self.rows.items()]
            heapq.heapify(self._heap)
        return StepOutcome([i for i, _ in admitted], expired)

    def _moved(self, buckets: dict[int, set[int]], i: int, old: int | None,
               new: int | None) -> None:
        """Id `i` moves from step `old`'s bucket to step `new`'s (None: none)."""
        if self.policy.expire_after_steps is None:
            return
        if old is not None:
            buckets[old].discard(i)
        if new is not None:
            buckets.setdefault(new, set()).add(i)

    def _push(self, i: int) -> None:
        if self.policy.row_budget is not None:
            frequency, last = self.rows[i]
            heapq.heappush(self._heap, (frequency, last, i))

    def _least_used(self, count: int, step: int) -> list[int]:
        """Drop the `count` rows not touched at `step` with the smallest keys."""
        dropped, held = [], []
        while len(dropped) < count:
            frequency, last, i = heapq.heappop(self._heap)
            if self.rows.get(i) != (frequency, last):
                continue  # a stale entry: the row moved on or is gone
            if last == step:
                held.append((frequency, last, i))
                continue
            del self.rows[i]
            self._moved(self._rows_at, i, last, None)
            dropped.append(i)
        for entry in held:
            heapq.heappush(self._heap, entry)
        return dropped
