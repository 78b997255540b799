"""The next step's cache plans, made in a thread while a step computes.

One worker (write-back caches): while step N computes, a thread plans step
N+1's lookups against the caches and moves their rows (evict, write back,
pull, install), one message per server, as step N+1's own plan would; step
N+1 then finds its rows in place.

Exact because a row the running step reads or updates is kept: a plan that
would evict one is refused (`RowCache.plan`'s `keep_since`) and that step
plans the table itself. So every evicted row is final (no update of the
running step touches it) when it is written back, and every pulled row is
one the worker does not cache, whose latest value its server holds (its
write-back went earlier, on the same ordered channel). The plan is the one
the next step would make: the same victims, the same hits (LFU's counts and
LRU's clock advance in the same order).

The client (`client.py`) decides which tables may be planned ahead and
moves the rows (`exchange`); this module owns the thread and the plans
until their step takes them.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from splitrun.splitter.labels import Label

from ...errors import CacheError
from .row_cache import BatchPlan, RowCache

__all__ = ["PlansAhead", "Exchange"]

# Bounds `close`'s wait for the thread: idle, it ends at once; one blocked on
# a server that is gone is a daemon and does not hold the process.
_CLOSE_S = 5.0

# Writes back the plans' evicted rows and pulls their misses, fresh for the
# step, one message per server; (bytes pulled, bytes pushed) by table. The
# last argument names the wait the time blocked counts as (None: not counted).
Exchange = Callable[[list[tuple[str, BatchPlan]], int, "str | None"],
                    tuple[dict[str, int], dict[str, int]]]
# Per table: (plan, bytes pulled, bytes pushed).
Planned = dict[str, tuple[BatchPlan, int, int]]


@dataclass
class _Ahead:
    """Some tables' plans for one step, made by the thread: per table (plan,
    bytes pulled, bytes pushed) once done, tables whose plan was refused left
    out. If one was refused, the others' rows did not move yet (`moved`
    False): their step moves them with the refused tables' own plans, one
    message per server."""

    step: int
    tables: tuple[str, ...]
    # Set by the thread once the plans are made (or failed).
    done: threading.Event = field(default_factory=threading.Event)
    is_settled: bool = False
    planned: Planned = field(default_factory=dict)
    moved: bool = True
    error: BaseException | None = None


class PlansAhead:
    """The plans made ahead, by the tables of the lookup they serve, and the
    thread that makes them. `waits["prefetched"]` gains the seconds a step
    blocks for a plan (what planning ahead did not hide)."""

    def __init__(self, caches: dict[str, RowCache], exchange: Exchange, *, owner: Label,
                 timeout_s: float, waits: dict[str, float]) -> None:
        self.caches = caches
        self.exchange = exchange
        self.owner = owner
        self.timeout_s = timeout_s
        self.waits = waits
        # Tables whose lookups turned out not to be their feed: planned in
        # their step only, from then on.
        self.excluded: set[str] = set()
        self._ahead: dict[tuple[str, ...], _Ahead] = {}
        self._thread: threading.Thread | None = None
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()

    def start(self, step: int, lookups: list[tuple[str, torch.Tensor]]) -> set[str]:
        """Plan `lookups` (table, that step's ids) for `step` in the thread,
        now; the tables it will plan."""
        if not lookups:
            return set()
        ahead = _Ahead(step, tuple(table for table, _ in lookups))
        self._ahead[ahead.tables] = ahead
        if self._thread is None:
            # One thread for the job's plans, started with the first: no
            # thread to start (and warm up) each step.
            self._thread = threading.Thread(target=self._loop, daemon=True,
                                            name=f"splitrun-cache-ahead-{self.owner}")
            self._thread.start()
        self._jobs.put((ahead, lookups))
        return set(ahead.tables)

    def take(self, step: int, lookups: list[tuple[str, torch.Tensor]]
             ) -> tuple[Planned, dict[str, BatchPlan]]:
        """`step`'s plans made ahead for `lookups`' tables, those whose ids
        are the lookup's: (plans whose rows moved, with their bytes; plans
        whose rows are still to move). A plan ahead that overlaps these
        tables otherwise is settled and dropped (the cache stays valid: it
        only holds rows the step did not ask for), and so is one whose ids
        were not the lookup's; such tables are not planned ahead again."""
        tables = {table for table, _ in lookups}
        done: Planned = {}
        unmoved: dict[str, BatchPlan] = {}
        for key in [key for key in self._ahead if tables & set(key)]:
            ahead = self._ahead.pop(key)
            self._settle(ahead)
            if ahead.step != step or key != tuple(t for t, _ in lookups):
                self.excluded.update(key)  # the step looks these tables up otherwise
                self._move_rows(list(ahead.planned), ahead)
                continue
            wrong = []
            for table, ids in lookups:
                if table not in ahead.planned:
                    continue
                plan = ahead.planned[table]
                if not torch.equal(plan[0].flat_ids, ids.reshape(-1).to("cpu", torch.int64)):
                    self.excluded.add(table)
                    wrong.append(table)
                elif ahead.moved:
                    done[table] = plan
                else:
                    unmoved[table] = plan[0]
            self._move_rows(wrong, ahead)
        return done, unmoved

    def settle_all(self) -> None:
        """Wait until no plan is being made (before the job's messages about
        the tables: flush, save, dump); the plans stay for their step."""
        for ahead in list(self._ahead.values()):
            self._settle(ahead)

    def close(self) -> None:
        """End the thread (once its plan in progress is made)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._jobs.put(None)
            thread.join(timeout=_CLOSE_S)

    # -- the thread --

    def _loop(self) -> None:
        """The plans, one after another, until `close` (None)."""
        while (job := self._jobs.get()) is not None:
            ahead, lookups = job
            try:
                self._make(ahead, lookups)
            finally:
                ahead.done.set()

    def _make(self, ahead: _Ahead, lookups: list[tuple[str, torch.Tensor]]) -> None:
        """Touches only these tables' caches (the step running meanwhile
        reads and updates only the rows it looked up, which the plans keep)."""
        try:
            plans = []
            for table, ids in lookups:
                cache = self.caches[table]
                plan = cache.plan(ids, ahead.step, write_back=True,
                                  max_staleness=cache.table.settings.max_staleness,
                                  keep_since=ahead.step - 1)
                if plan is not None:
                    plans.append((table, plan))
            if len(plans) < len(lookups):  # the step moves every table's rows at once
                ahead.planned = {t: (p, 0, 0) for t, p in plans}
                ahead.moved = False
                return
            pulled, pushed = self.exchange(plans, ahead.step, None)
            ahead.planned = {t: (p, pulled.get(t, 0), pushed.get(t, 0)) for t, p in plans}
        except BaseException as exc:  # noqa: BLE001 - raised in the step that waits for it
            ahead.error = exc

    # -- the step's side --

    def _settle(self, ahead: _Ahead) -> None:
        """Wait for `ahead`'s plans; raise its error."""
        if not ahead.is_settled:
            started = time.perf_counter()
            is_done = ahead.done.wait(timeout=2 * self.timeout_s)
            self.waits["prefetched"] += time.perf_counter() - started
            if not is_done:
                raise CacheError(f"[{self.owner.describe()}] planning step {ahead.step}'s rows of "
                                 f"{list(ahead.tables)} ahead took over "
                                 f"{2 * self.timeout_s:.0f} s")
            ahead.is_settled = True
        if ahead.error is not None:
            raise ahead.error

    def _move_rows(self, tables: list[str], ahead: _Ahead) -> None:
        """Write back and pull the rows of `tables`' plans made ahead that no
        step uses, if they did not move yet: their slots must hold their rows
        before the cache plans again."""
        if ahead.moved or not tables:
            return
        self.exchange([(table, ahead.planned[table][0]) for table in tables], ahead.step,
                      "pulled")
