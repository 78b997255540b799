"""A worker's cache of one table's hot rows: the rows (and their per-row
optimizer state) in slots on the worker's device, an id -> slot map, and the
eviction policy. It only decides and stores; `client.py` talks to
the servers.

All bookkeeping is vectorized over a batch's lookups, which it never sorts:
a dense map over the table gives each lookup its slot (slot + 1 per id, 0 for
none, int32: 4 bytes a row, `small_page_zeros`, so backed 4 KiB page by page
as ids are first seen, not at start: a worker's map of a table of any size costs the
pages its ids touch), only the misses are made distinct, and eviction picks
the candidate slots with the smallest policy keys (LRU: last use, read off
an order kept step by step, `use_order.py`; LFU: lookups, then last use).
The maps live in CPU tensors (the client and the tests read them) and a plan
works on numpy views of them: on the plan's arrays (16 k lookups, 50 k
slots) numpy's gathers, masks, `flatnonzero` and sort cost 2-12x less than
torch's ops (sort: 70 us against 850 us for 14 k ids; each op also skips
torch's dispatch), which made the plan 3x cheaper (2.0 -> 0.65 ms a table
of the bench, one thread).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from splitrun.splitter.ops.cache import CachedTable, EvictionPolicy

from ...errors import CacheError
from .dynamic_rows import check_dynamic_ids
from .huge_pages import small_page_zeros, zeros_rows
from .id_map import SparseSlots
from .row_copy import RowArray, copy_rows_
from .step_ids import StepIds
from .use_order import UseOrder

__all__ = ["RowCache", "BatchPlan", "TableCounters"]

# Eviction picks at most 1/this of the slots: a partial selection (the
# count-th smallest key, then the few keys below it sorted) beats sorting
# every key (~4x at 200k cached rows). Picking more, a full sort is as fast.
_PARTIAL_SELECT_RATIO = 16
# Keys spanning at most this many values per key (LRU's: step numbers) find
# the count-th smallest by counting them (a bincount), ~8x faster than topk.
_COUNTING_SPAN_PER_KEY = 4
# LRU's kept order is built again from the slots' last uses once it holds
# this many entries a slot (the bench's 20 % caches settle at about 2).
_ORDER_ENTRIES_PER_SLOT = 4
# The eviction key of a free slot: before every row's (all policies' keys
# are >= -1), so free slots are taken first.
_FREE_FIRST = -2


def _smallest(key: torch.Tensor, count: int) -> torch.Tensor:
    """Positions of the `count` smallest keys in the order of
    `torch.argsort(key, stable=True)[:count]` (equal keys: lower position
    first), without sorting every key. Requires 1 <= count <= key.numel()."""
    if count * _PARTIAL_SELECT_RATIO > key.numel():
        return torch.argsort(key, stable=True)[:count]
    # The count-th smallest key: fewer than `count` keys are below it, and
    # the first of its ties (by position) make up the rest.
    low, high = int(key.min()), int(key.max())
    if high - low < _COUNTING_SPAN_PER_KEY * key.numel():
        at_most = torch.bincount(key - low).cumsum_(0)  # keys <= low + i
        threshold = low + int(torch.searchsorted(at_most, count))
    else:
        threshold = int(torch.topk(key, count, largest=False, sorted=False).values.max())
    below = (key < threshold).nonzero().reshape(-1)
    tied = (key == threshold).nonzero().reshape(-1)[:count - below.numel()]
    chosen = torch.cat([below, tied])  # each part in position order
    return chosen.index_select(0, torch.argsort(key.index_select(0, chosen), stable=True))


def _row_array(rows: torch.Tensor) -> RowArray | None:
    try:
        return RowArray(rows)
    except ValueError:  # not CPU rows
        return None


def _distinct(ids: np.ndarray) -> np.ndarray:
    """`ids` made distinct and sorted: a batch's misses, a fraction of its
    lookups (a bitmap over the whole table costs more to scan)."""
    if ids.size < 2:
        return ids
    ids = np.sort(ids)
    first = np.empty(ids.size, dtype=bool)
    first[0] = True
    np.not_equal(ids[1:], ids[:-1], out=first[1:])
    return ids.compress(first)


@dataclass
class TableCounters:
    """Per table: totals since the start, and the last step's values."""

    lookups: int = 0
    unique_ids: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_pulled: int = 0
    bytes_pushed: int = 0
    planned_ahead: int = 0  # steps whose plan was made while the step before computed
    # A dynamic table's gradients of ids without a row on their server (not admitted).
    dropped_gradients: int = 0
    last_step: dict = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.unique_ids if self.unique_ids else 0.0

    def record(self, **values: int) -> None:
        for name, value in values.items():
            setattr(self, name, getattr(self, name) + value)
        self.last_step = dict(values)

    def as_dict(self) -> dict:
        return {"lookups": self.lookups, "unique_ids": self.unique_ids, "hits": self.hits,
                "misses": self.misses, "evictions": self.evictions,
                "bytes_pulled": self.bytes_pulled, "bytes_pushed": self.bytes_pushed,
                "planned_ahead": self.planned_ahead,
                "dropped_gradients": self.dropped_gradients, "hit_rate": round(self.hit_rate, 6),
                "last_step": dict(self.last_step)}


@dataclass
class BatchPlan:
    """What a batch needs from the cache: every lookup's slot (valid once the
    rows to pull are installed), the ids to pull into which slots, and the
    evicted dirty rows to write back. Planning sorts nothing: the batch's ids
    made unique (`ids`, one stable sort) are computed only if a caller asks
    (a gradient summed per unique id)."""

    flat_ids: torch.Tensor       # the batch's ids, flat, int64, batch order
    lookup_slots: torch.Tensor   # slot of each lookup
    num_unique: int              # distinct ids of the batch
    pull_ids: torch.Tensor       # sorted
    pull_slots: torch.Tensor
    evicted_ids: torch.Tensor    # dirty rows leaving the cache (write-back only)
    # Their slots: the rows stay there until the pulled rows are installed, so
    # the write-back gathers each server's share from the cache in one copy.
    evicted_slots: torch.Tensor
    evictions: int
    # The slots the batch uses, each once, ascending (what its update dirties).
    used_slots: torch.Tensor | None = None
    _step_ids: StepIds | None = None

    @property
    def ids(self) -> StepIds:
        """The batch's ids made unique (computed once, when first asked)."""
        if self._step_ids is None:
            self._step_ids = StepIds.of(self.flat_ids)
        return self._step_ids

    @property
    def unique_ids(self) -> torch.Tensor:
        return self.ids.unique

    @property
    def slots(self) -> torch.Tensor:
        """Slot of each unique id (in `unique_ids`' order)."""
        first = self.ids.order.index_select(0, self.ids.starts)  # a lookup of each
        return self.lookup_slots.index_select(0, first)


class RowCache:
    """A dynamic table's cache (`DynamicTable`: ids any int64, one worker)
    maps ids sparsely (`SparseSlots`) and is told after each pull which of
    the step's ids have rows on their servers (`live`: only those are
    updated) and which rows expired (`reset`: they start over)."""

    def __init__(self, table: CachedTable, device: torch.device | str = "cpu") -> None:
        self.table = table
        self.dynamic = table.settings.dynamic is not None
        if self.dynamic and table.settings.policy is EvictionPolicy.LFU:
            raise CacheError(f"dynamic table {table.key!r}: its worker cache evicts by LRU")
        self.capacity = (table.settings.cache_rows if self.dynamic
                         else min(table.settings.cache_rows, table.num_rows))
        self.policy = table.settings.policy
        self.device = torch.device(device)
        shape = (self.capacity, table.dim)
        self.rows = zeros_rows(shape, table.dtype, self.device)
        self.state = {name: zeros_rows(shape, table.dtype, self.device)
                      for name in table.state_names}
        self._keep_row_arrays()
        self._slot_plus_one = SparseSlots() if self.dynamic else small_page_zeros(
            table.num_rows, np.int32 if self.capacity < (1 << 31) - 1 else np.int64)
        # A dynamic table's rows with a row on their server (of the step's ids:
        # their latest pull says so).
        self.live = torch.zeros(self.capacity, dtype=torch.bool) if self.dynamic else None
        self.id_of_slot = torch.full((self.capacity,), -1, dtype=torch.int64)
        self.last_used = torch.full((self.capacity,), -1, dtype=torch.int64)
        # Slots fill in order and are never freed (a victim's slot is reused
        # at once): slots [0, filled) hold rows, the rest are free.
        self.filled = 0
        # The step for which a cached row is fresh (several workers: stale rows
        # are pulled again).
        self.fresh_for = torch.zeros(self.capacity, dtype=torch.int64)
        self.dirty = torch.zeros(self.capacity, dtype=torch.bool)
        # LFU counts every id's lookups over the whole run, cached or not, so a
        # row's history survives its eviction.
        # Backed page by page, as the slot map is.
        self.frequency = (torch.from_numpy(small_page_zeros(table.num_rows, np.int64))
                          if self.policy is EvictionPolicy.LFU else None)
        self.counters = TableCounters()
        # A scratch bitmap over the slots (all False between plans).
        self._slot_marks = torch.zeros(self.capacity, dtype=torch.bool)
        # LRU: the slots in eviction order, kept by each plan (built when
        # first needed); the latest step a plan was made for.
        self._use_order: UseOrder | None = None
        self._clock = -1

    def adopt_rows(self, rows: torch.Tensor) -> None:
        """Keep the cached rows in `rows` (a [capacity, dim] view of a buffer
        several tables share: the fused bags' kernel reads them there)."""
        if rows.shape != self.rows.shape or rows.dtype != self.rows.dtype:
            raise CacheError(f"table {self.table.key!r}: rows of {list(self.rows.shape)} "
                             f"{self.rows.dtype} cannot move into {list(rows.shape)} {rows.dtype}")
        rows.copy_(self.rows)
        self.rows = rows
        self._keep_row_arrays()

    def _keep_row_arrays(self) -> None:
        """The slots' (and their state's) whole-row views, made once:
        installs and write-backs copy rows in and out every step (None where
        rows cannot be viewed so: another device)."""
        self.row_array = _row_array(self.rows)
        self.state_arrays = {name: _row_array(value) for name, value in self.state.items()}

    def make_resident(self) -> None:
        """Every row of the table is installed at slot = id (the client pulled
        them): the map is the identity, no row is ever evicted."""
        if self.capacity != self.table.num_rows:
            raise CacheError(f"table {self.table.key!r}: a cache of {self.capacity} rows "
                             f"cannot hold all {self.table.num_rows}")
        self._slot_plus_one = np.arange(1, self.capacity + 1, dtype=self._slot_plus_one.dtype)
        self.id_of_slot = torch.arange(self.capacity)
        self.filled = self.capacity

    # -- planning a batch --

    def check_ids(self, ids: torch.Tensor) -> None:
        if self.dynamic:
            check_dynamic_ids(ids, self.table.key)
            return
        if ids.numel() == 0:
            return
        values = ids.numpy()
        # One pass: a negative id, seen as unsigned, is past every table's end.
        if bool((values.view(np.uint64) >= self.table.num_rows).any()):
            low, high = int(values.min()), int(values.max())
            bad = low if low < 0 else high
            raise CacheError(
                f"table {self.table.key!r} has {self.table.num_rows} rows (ids 0-"
                f"{self.table.num_rows - 1}) but the batch looks up id {bad}")

    def plan(self, ids: torch.Tensor | StepIds, step: int, *, write_back: bool,
             max_staleness: int, keep_since: int | None = None) -> BatchPlan | None:
        """Make room for the batch's ids and say which rows to pull.

        `ids`: the batch's ids (any shape), or their `StepIds` when the caller
        has made them unique already. The lookups are not sorted: each
        lookup's slot comes from the id -> slot map, and only the misses are
        made distinct (a fraction of the lookups). Rows of this batch are pinned: never
        chosen for eviction. Misses go to free slots first, then to the
        policy's victims; with several workers, cached rows older than
        `max_staleness` steps are pulled again.

        `keep_since`: rows looked up at this step or later are kept: a step
        still running reads and updates them (the client plans the next batch
        while the current one computes; the running step's plan was the last
        one). The plan is the one made without it; if it would evict one of
        them, none is made (the cache is left as it was) and None is returned.
        """
        step_ids = ids if isinstance(ids, StepIds) else None
        if self.dynamic:
            if step_ids is None:
                self.check_ids(ids)  # its dtype, before the ids are made int64
            if step <= self._clock:
                raise CacheError(
                    f"dynamic table {self.table.key!r} is looked up twice in step {step}; its "
                    f"servers make a step's rows from the step's ids once: look it up once "
                    f"(concatenate the ids)")
        flat = ids.ids if step_ids is not None else ids.reshape(-1).to("cpu", torch.int64)
        self.check_ids(flat)
        # Numpy views of the maps: the same memory (see the module's doc).
        slot_plus_one, id_of_slot = self._slot_plus_one, self.id_of_slot.numpy()
        last_used, marks = self.last_used.numpy(), self._slot_marks.numpy()
        lookups = flat.numpy()
        unique_slots = None
        if self.dynamic:
            # The id map of a dynamic table is a sorted array searched per id:
            # searched with the step's distinct ids, sorted, it is several
            # times faster than with every lookup in batch order, and the
            # plan needs them anyway (the servers are told which ids a step saw).
            step_ids = step_ids if step_ids is not None else StepIds.of(flat)
            unique, inverse = step_ids.unique.numpy(), step_ids.inverse.numpy()
            unique_slots = np.subtract(slot_plus_one.take(unique), 1, dtype=np.int64)
            slots = unique_slots.take(inverse)
        else:
            slots = np.subtract(slot_plus_one.take(lookups), 1, dtype=np.int64)
        cached = slots >= 0
        hit_slots = slots.compress(cached)
        marks[hit_slots] = True  # the hits' slots: counted, and pinned below
        if self.policy is EvictionPolicy.NONE:
            # Every row is pulled: the ids are made unique once, and the
            # gradient sums per unique id with the same unique.
            step_ids = step_ids if step_ids is not None else StepIds.of(flat)
            unique = step_ids.unique.numpy()
            miss_ids = unique.compress(slot_plus_one.take(unique) == 0)
            num_unique = unique.size
        else:
            miss_ids = (unique.compress(unique_slots < 0) if unique_slots is not None
                        else _distinct(lookups.compress(~cached)))
            num_unique = miss_ids.size + int(np.count_nonzero(marks))
        if num_unique > self.capacity:
            marks[:] = False
            raise CacheError(
                f"table {self.table.key!r}: this batch looks up {num_unique} distinct "
                f"ids but the cache holds {self.capacity} rows; cache_rows must be at least "
                f"{num_unique} (place_embedding_cache(..., cache_rows=...))")
        stale_ids = miss_ids[:0]
        if not write_back and self.policy is not EvictionPolicy.NONE:
            old = (step - self.fresh_for.numpy().take(hit_slots)) > max_staleness
            stale_ids = id_of_slot.take(hit_slots.compress(old))
        new_slots, evicted, filled, order_end = self._room(miss_ids.size, hit_slots, step)
        if keep_since is not None and evicted.size and bool(
                (last_used.take(evicted) >= keep_since).any()):
            marks[:] = False
            return None
        self.filled = filled
        evicted_ids = id_of_slot.take(evicted)
        dirty = self.dirty.numpy()
        evicted_dirty = dirty.take(evicted)
        dirty_slots = evicted.compress(evicted_dirty)
        dirty_ids = evicted_ids.compress(evicted_dirty)
        slot_plus_one[evicted_ids] = 0
        id_of_slot[new_slots] = miss_ids
        slot_plus_one[miss_ids] = new_slots + 1
        dirty[new_slots] = False
        if miss_ids.size and unique_slots is not None:  # (miss_ids: the missing, in order)
            unique_slots[unique_slots < 0] = new_slots
            slots = unique_slots.take(inverse)
        elif miss_ids.size:  # the missed lookups' new slots (the hits' did not move)
            missed = np.flatnonzero(~cached)
            slots[missed] = slot_plus_one.take(lookups.take(missed)) - 1
        # Every slot the batch uses, once each, in slot order: its hits' and
        # its new ones (a few thousand writes instead of one per lookup).
        marks[new_slots] = True
        used = np.flatnonzero(marks)
        marks[:] = False
        last_used[used] = step
        self._order_used(step, order_end, used)
        self._clock = max(self._clock, step)
        if self.frequency is not None:
            self.frequency.index_add_(0, flat, torch.ones_like(flat))
        pull_ids = miss_ids
        if self.policy is EvictionPolicy.NONE:
            pull_ids = unique  # no reuse
        elif stale_ids.size:
            pull_ids = _distinct(np.concatenate([miss_ids, stale_ids]))
        pull_slots = new_slots if (pull_ids is miss_ids and unique_slots is not None) else (
            np.subtract(slot_plus_one.take(pull_ids), 1, dtype=np.int64))
        tensor = torch.from_numpy
        return BatchPlan(flat, tensor(slots), num_unique, tensor(pull_ids), tensor(pull_slots),
                         tensor(dirty_ids), tensor(dirty_slots), evicted.size, tensor(used),
                         step_ids)

    def uncached_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """The distinct ids of `ids` (flat, int64) not cached now, sorted."""
        self.check_ids(ids)
        lookups = ids.numpy()
        missing = self._slot_plus_one.take(lookups) == 0
        return torch.from_numpy(_distinct(lookups.compress(missing)))

    def _room(self, needed: int, pinned: np.ndarray, step: int
              ) -> tuple[np.ndarray, np.ndarray, int, tuple[int, int] | None]:
        """`needed` slots: free ones first (in slot order), then the policy's
        victims among the cached rows not `pinned` (returned too; the slots
        marked in `_slot_marks`), the filled count once they are taken (the
        caller commits it), and where the victims end in the LRU order (for
        `_order_used`)."""
        free = self.capacity - self.filled
        if needed <= free:
            slots = np.arange(self.filled, self.filled + needed, dtype=np.int64)
            return slots, slots[:0], self.filled + needed, None
        order = self._lru_order(step)
        if order is not None:
            oldest = order.oldest(needed - free, self.last_used.numpy(),
                                  self._slot_marks.numpy())
            if oldest is not None:
                victims, end = oldest
                chosen = np.concatenate([np.arange(self.filled, self.capacity, dtype=np.int64),
                                         victims])
                return chosen, victims, self.capacity, end
            self._use_order = None  # cannot happen while the order is kept; sort instead
        key = self._eviction_key()
        key[self.filled:] = _FREE_FIRST
        key.index_fill_(0, torch.from_numpy(pinned), int(key.max()) + 1)  # after every other slot
        chosen = _smallest(key, needed).numpy()
        return chosen, chosen[free:], self.capacity, None

    def _lru_order(self, step: int) -> UseOrder | None:
        """LRU's order of the slots, if a plan for `step` may use it: every
        earlier plan was for an earlier step (a second plan in one step, a
        table looked up twice, sorts the keys, and the order is built again
        from `last_used` at the next step)."""
        if self.policy is not EvictionPolicy.LRU or step <= self._clock:
            self._use_order = None
            return None
        if self._use_order is None:
            self._use_order = UseOrder(self.last_used.numpy(), self.filled)
        return self._use_order

    def _order_used(self, step: int, end: tuple[int, int] | None, used: np.ndarray) -> None:
        """Keep the LRU order after a plan for `step`: its victims' entries
        and the skipped ones are dropped, and the slots it uses (`used`:
        distinct, sorted) go to the back."""
        order = self._use_order
        if order is None or step <= self._clock:
            self._use_order = None
            return
        if end is not None:
            order.drop(end)
        order.append(step, used)
        if order.num_entries > _ORDER_ENTRIES_PER_SLOT * self.capacity:
            # Few evictions leave stale entries piling up: built again when next needed.
            self._use_order = None

    def _eviction_key(self) -> torch.Tensor:
        """Every slot's key, a new tensor: the smallest are evicted first."""
        if self.policy is EvictionPolicy.NONE:
            return torch.zeros_like(self.last_used)
        if self.policy is EvictionPolicy.LFU:
            # Least frequent first; among equals the least recently used.
            frequency = self.frequency.index_select(0, self.id_of_slot.clamp(min=0))
            return frequency * (1 << 31) + (self.last_used + 1)
        return self.last_used.clone()

    # -- rows --

    def install(self, slots: torch.Tensor, rows: torch.Tensor,
                state: dict[str, torch.Tensor], fresh_for: int | None) -> None:
        """Rows (and their state) into `slots`, fresh for step `fresh_for`
        (None: a write-back cache, which never asks how fresh a row is)."""
        if self.row_array is not None and slots.device.type == "cpu":
            index = slots.numpy()  # a plan's slots: in range
            self.row_array.put(index, rows)
            for name, value in state.items():
                self.state_arrays[name].put(index, value)
        else:
            on_device = slots.to(self.device)
            copy_rows_(self.rows, on_device, rows.to(self.device, self.rows.dtype))
            for name, value in state.items():
                copy_rows_(self.state[name], on_device, value.to(self.device, self.rows.dtype))
        if fresh_for is not None:
            self.fresh_for.index_fill_(0, slots.cpu(), fresh_for)

    def gather(self, plan: BatchPlan, shape: torch.Size) -> torch.Tensor:
        """The rows of the batch, shaped like the ids plus the row dimension."""
        slots = plan.lookup_slots.to(self.device)
        return self.rows.index_select(0, slots).reshape(*shape, self.table.dim)

    def slots_of(self, ids: torch.Tensor) -> torch.Tensor:
        slots = self.slots_or_missing(ids)
        if bool((slots < 0).any()):
            raise CacheError(f"table {self.table.key!r}: a gradient for rows that are not "
                                f"cached (the lookup and the update disagree)")
        return slots

    @property
    def slot_of_id(self) -> torch.Tensor:
        """Every id's slot, -1 for none: a whole int64 copy of the map, for
        tests and debugging (it touches every page of it)."""
        if self.dynamic:
            raise CacheError(f"dynamic table {self.table.key!r}: its ids have no range to map "
                             f"whole; ask slots_or_missing(ids)")
        return torch.from_numpy(np.subtract(self._slot_plus_one, 1, dtype=np.int64))

    def slots_or_missing(self, ids: torch.Tensor) -> torch.Tensor:
        """The slot of each of `ids` (int64, CPU, flat), -1 where not cached."""
        taken = self._slot_plus_one.take(ids.reshape(-1).to("cpu", torch.int64).numpy())
        return torch.from_numpy(np.subtract(taken, 1, dtype=np.int64))

    def mark_dirty(self, slots: torch.Tensor) -> None:
        """The rows in `slots` (CPU) were updated here: written back when they leave."""
        self.dirty.numpy()[slots.numpy()] = True

    # -- a dynamic table: what its servers say after a pull --

    def mark_live(self, ids: torch.Tensor, live: torch.Tensor) -> None:
        """Which of `ids` (cached: the step's) have rows on their server now."""
        self.live[self.slots_of(ids)] = live

    def reset(self, ids: torch.Tensor, state_start: dict[str, float]) -> None:
        """Rows of `ids` their servers dropped (expired) start over where
        cached: the initializer's row, the state's starting value, clean and
        not live (the server's view of an id without a row; a row made again
        starts from it too)."""
        slots = self.slots_or_missing(ids)
        slots = slots[slots >= 0]
        if not slots.numel():
            return
        init, dim = self.table.settings.init, self.table.dim
        expired = self.id_of_slot.index_select(0, slots)
        rows = (init.rows(expired, dim, self.table.key, dtype=self.table.dtype) if init
                is not None else torch.zeros(slots.numel(), dim, dtype=self.table.dtype))
        on_device = slots.to(self.device)
        copy_rows_(self.rows, on_device, rows.to(self.device))
        for name, value in self.state.items():
            value.index_fill_(0, on_device, state_start[name])
        self.dirty[slots] = False
        self.live[slots] = False

    def dirty_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, slots) of every dirty row, marked clean."""
        slots = self.dirty.nonzero().reshape(-1)
        self.dirty[slots] = False
        return self.id_of_slot[slots], slots

    def read(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mask of cached ids, their rows) for ids that may or may not be cached."""
        slots = self.slots_or_missing(ids).reshape(ids.shape)
        mask = slots >= 0
        return mask, self.rows[slots[mask].to(self.device)]
