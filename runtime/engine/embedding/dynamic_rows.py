"""One server's rows of a dynamic table (`DynamicTable`: ids any int64): rows
made on first sight (after admission) from the table's row initializer,
their row-wise optimizer state, and the admission and expiry policy,
vectorized over a step's ids. `dynamic_reference.py` states the policy one id
at a time; the tests hold the two equal.

A step is `begin_step(step, ids)` (the step's ids this server owns: age
expiry, sightings, admission, the row budget), `read(ids)` (rows for the
step's ids: a row's own, or the initializer's row for an id not admitted),
then `apply(ids, grads, lr, step)` (the row-wise update of the admitted ids;
the others' gradients are dropped). `expired_ids` of a step are what a
worker's cache must start over (`RowCache.reset`); a worker caching the rows
writes them back with `write`. `snapshot()` / `restore()` carry the live set (and
the ids waiting for admission) through a sharded checkpoint, onto any number
of servers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from splitrun.splitter.ops.dynamic_table import DynamicTable
from splitrun.splitter.ops.row_init import RowInit
from splitrun.splitter.ops.sparse_updates import IN_PLACE

from ...errors import CacheError
from .dynamic_reference import RowBudgetError, budget_message
from .id_map import IdMap
from .id_sharding import IdSharding

__all__ = ["DynamicRows", "DynamicCounters", "check_dynamic_ids"]

# A table without a budget grows its row buffer by this factor when full.
_GROWTH = 2
_FIRST_CAPACITY = 1024


def check_dynamic_ids(ids: torch.Tensor, table: str) -> None:
    """A dynamic table's ids are integers (int64; int32 is widened)."""
    if ids.dtype not in (torch.int64, torch.int32):
        raise CacheError(f"dynamic table {table!r}: ids must be int64 (hashed ids are any "
                         f"int64), got {str(ids.dtype).removeprefix('torch.')}; pass "
                         f"ids.to(torch.int64)")


@dataclass
class DynamicCounters:
    live_rows: int = 0
    peak_live_rows: int = 0     # the most live rows after any step
    admitted: int = 0
    expired: int = 0            # by age and by budget
    expired_by_budget: int = 0
    waiting: int = 0            # ids seen, not admitted yet
    dropped_gradients: int = 0  # gradients of ids not admitted
    bytes: int = 0              # the live rows and their optimizer state
    index_bytes: int = 0        # the id maps and the per-row policy columns

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class DynamicRows:
    def __init__(self, table: str, dim: int, policy: DynamicTable, *,
                 init: RowInit | None = None, dtype: torch.dtype = torch.float32,
                 optimizer: str = "sgd", optimizer_settings: dict | None = None,
                 state_names: tuple[str, ...] = (), server: int = 0,
                 state_start: dict[str, float] | None = None) -> None:
        self.table, self.dim, self.policy, self.init = table, dim, policy, init
        self.dtype, self.optimizer = dtype, optimizer
        self.optimizer_settings = dict(optimizer_settings or {})
        self.state_names, self.server = state_names, server
        # Each row state's starting value (Adagrad's initial accumulator).
        self.state_start = {name: 0.0 for name in state_names} | dict(state_start or {})
        capacity = policy.row_budget if policy.row_budget is not None else _FIRST_CAPACITY
        self.rows = torch.zeros(capacity, dim, dtype=dtype)
        self.state = {n: torch.zeros(capacity, dim, dtype=dtype) for n in state_names}
        # Per slot: its id, frequency and last touched step (-1: free).
        self.slot_id = np.full(capacity, -1, dtype=np.int64)
        self.frequency = np.zeros(capacity, dtype=np.int64)
        self.last = np.full(capacity, -1, dtype=np.int64)
        self._free = np.arange(capacity - 1, -1, -1, dtype=np.int64)  # a stack: pop from the end
        self._num_free = capacity
        self.live = IdMap(("slot",))
        self.waiting = IdMap(("seen", "last"))
        self.counters = DynamicCounters()
        self.expired_ids = np.empty(0, dtype=np.int64)
        self._step = None

    # -- a step --

    def begin_step(self, step: int, ids: torch.Tensor | np.ndarray) -> np.ndarray:
        """Apply the policy for `step` with its ids on this server; returns
        the ids admitted at it. Call once per step, before `read`."""
        ids = self._distinct(ids)
        if self._step is not None and step <= self._step:
            raise CacheError(f"dynamic table {self.table!r} on server {self.server}: step "
                             f"{step} after step {self._step}; steps must increase")
        self._step = step
        expired = [self._expire_by_age(step)]
        positions, found = self.live.find(ids)
        slots = self.live.columns["slot"].take(positions.compress(found))
        self.frequency[slots] += 1
        self.last[slots] = step
        admitted, seen = self._sight(ids.compress(~found), step)
        budget = self.policy.row_budget
        if budget is not None and len(self.live) + admitted.size > budget:
            if slots.size + admitted.size > budget:
                raise RowBudgetError(budget_message(self.table, self.server, budget,
                                                    slots.size, admitted.size))
            expired.append(self._expire_least_used(len(self.live) + admitted.size - budget,
                                                   step))
        self._admit(admitted, seen, step)
        self.expired_ids = np.sort(np.concatenate(expired))
        self.counters.expired += self.expired_ids.size
        self.counters.admitted += admitted.size
        self._count()
        return admitted

    def read(self, ids: torch.Tensor | np.ndarray) -> torch.Tensor:
        """[len(ids), dim]: each id's row, or its initializer's row (zeros
        without an initializer) for an id not admitted."""
        flat = self._ids(ids)
        slots = self.slots_of(flat)
        out = torch.empty(flat.size, self.dim, dtype=self.dtype)
        found = slots >= 0
        if found.all():
            return torch.index_select(self.rows, 0, torch.from_numpy(slots), out=out)
        out.index_copy_(0, torch.from_numpy(np.flatnonzero(found)),
                        self.rows.index_select(0, torch.from_numpy(slots.compress(found))))
        out.index_copy_(0, torch.from_numpy(np.flatnonzero(~found)),
                        self._initial(flat.compress(~found)))
        return out

    def read_state(self, ids: torch.Tensor | np.ndarray) -> dict[str, torch.Tensor]:
        """Each row state of `ids`: a row's own, the starting value for an id
        without a row (what a worker caching the rows gets with them)."""
        slots = self.slots_of(self._ids(ids))
        found = torch.from_numpy(slots >= 0)
        where = torch.from_numpy(np.maximum(slots, 0))
        return {name: torch.where(found[:, None], value.index_select(0, where),
                                  self.state_start[name]).to(self.dtype)
                for name, value in self.state.items()}

    def has_rows(self, ids: torch.Tensor | np.ndarray) -> torch.Tensor:
        """Whether each of `ids` has a row (admitted, not expired)."""
        return torch.from_numpy(self.slots_of(self._ids(ids)) >= 0)

    def write(self, ids: torch.Tensor | np.ndarray, rows: torch.Tensor,
              state: dict[str, torch.Tensor]) -> None:
        """Rows (and their state) a worker caching them wrote back: only rows
        it updated, so each id has a row (it was told of every expiry)."""
        flat = self._ids(ids)
        slots = self.slots_of(flat)
        if bool((slots < 0).any()):
            raise CacheError(f"dynamic table {self.table!r} on server {self.server}: a write-back "
                             f"of id {int(flat[slots < 0][0])}, which has no row here (expired, "
                             f"or never admitted); the worker's cache and this server disagree")
        where = torch.from_numpy(slots)
        self.rows.index_copy_(0, where, rows.to(self.dtype))
        for name, value in state.items():
            self.state[name].index_copy_(0, where, value.to(self.dtype))

    def apply(self, ids: torch.Tensor | np.ndarray, grads: torch.Tensor, lr, step_count) -> None:
        """The row-wise update of the rows of `ids` (distinct, each gradient
        summed per id); the gradients of ids not admitted are dropped."""
        flat = self._ids(ids)
        slots = self.slots_of(flat)
        found = slots >= 0
        self.counters.dropped_gradients += int(flat.size - np.count_nonzero(found))
        if not found.any():
            return
        where = torch.from_numpy(np.flatnonzero(found)) if not found.all() else None
        values = grads if where is None else grads.index_select(0, where)
        IN_PLACE[self.optimizer](self.rows, torch.from_numpy(slots.compress(found)), values,
                                 lr, step_count, *(self.state[n] for n in self.state_names),
                                 is_coalesced=True, **self.optimizer_settings)

    def slots_of(self, ids: np.ndarray) -> np.ndarray:
        """Each id's slot, -1 for an id without a row."""
        positions, found = self.live.find(ids)
        return np.where(found, self.live.columns["slot"].take(positions) if len(self.live)
                        else -1, -1)

    # -- the policy --

    def _expire_by_age(self, step: int) -> np.ndarray:
        age = self.policy.expire_after_steps
        if age is None:
            return np.empty(0, dtype=np.int64)
        slots = self.live.columns["slot"]  # (the ids waiting are forgotten in `_sight`)
        old = step - self.last.take(slots) > age
        if not old.any():
            return np.empty(0, dtype=np.int64)
        gone = self.live.ids.compress(old)
        self._free_slots(slots.compress(old))
        self.live.keep(~old)
        return gone

    def _sight(self, ids: np.ndarray, step: int) -> tuple[np.ndarray, np.ndarray]:
        """Forget the ids waiting unseen for more than T steps, then count a
        sighting of each of `ids` (no rows); (the ids admitted now, their
        sightings). The waiting map is rewritten once a step, for both the
        forgotten and the admitted ids (its size is many steps' new ids)."""
        waiting, age = self.waiting, self.policy.expire_after_steps
        positions, found = waiting.find(ids)
        drop = None  # the waiting entries that leave: forgotten, or admitted now
        if age is not None and len(waiting):
            drop = step - waiting.columns["last"] > age
            found &= ~drop.take(positions)  # a forgotten id seen again starts over
        seen = np.ones(ids.size, dtype=np.int64)
        if len(waiting):
            seen += np.where(found, waiting.columns["seen"].take(positions), 0)
        admit = seen >= self.policy.admit_after
        stay = found & ~admit
        waiting.columns["seen"][positions.compress(stay)] = seen.compress(stay)
        waiting.columns["last"][positions.compress(stay)] = step
        leaving = positions.compress(found & admit)
        if leaving.size:
            drop = np.zeros(len(waiting), dtype=bool) if drop is None else drop
            drop[leaving] = True
        if drop is not None and drop.any():
            waiting.keep(~drop)
        new = ~found & ~admit
        waiting.insert(ids.compress(new), seen=seen.compress(new),
                       last=np.full(int(np.count_nonzero(new)), step, dtype=np.int64))
        return ids.compress(admit), seen.compress(admit)

    def _expire_least_used(self, count: int, step: int) -> np.ndarray:
        """Drop the `count` rows not touched at `step` with the smallest
        (frequency, last touched, id)."""
        slots = self.live.columns["slot"]
        ids = self.live.ids
        untouched = self.last.take(slots) < step
        candidates = np.flatnonzero(untouched)
        # (frequency, last) packed: both below 2^31 steps.
        key = self.frequency.take(slots.take(candidates)) << 32 | self.last.take(
            slots.take(candidates))
        if count < candidates.size:
            threshold = np.partition(key, count - 1)[count - 1]
            below = candidates.compress(key < threshold)
            tied = candidates.compress(key == threshold)  # ascending id: the map's order
            chosen = np.concatenate([below, tied[:count - below.size]])
        else:
            chosen = candidates
        self.counters.expired_by_budget += chosen.size
        gone = ids.take(chosen)
        self._free_slots(slots.take(chosen))
        mask = np.ones(ids.size, dtype=bool)
        mask[chosen] = False
        self.live.keep(mask)
        return np.sort(gone)

    def _admit(self, ids: np.ndarray, seen: np.ndarray, step: int) -> None:
        if not ids.size:
            return
        slots = self._take_slots(ids.size)
        self.slot_id[slots] = ids
        self.frequency[slots] = seen
        self.last[slots] = step
        where = torch.from_numpy(slots)
        self.rows[where] = self._initial(ids)
        for name, value in self.state.items():
            value[where] = self.state_start[name]
        self.live.insert(ids, slot=slots)

    # -- slots --

    def _take_slots(self, count: int) -> np.ndarray:
        if count > self._num_free:
            self._grow(len(self.live) + count)
        slots = self._free[self._num_free - count:self._num_free][::-1].copy()
        self._num_free -= count
        return slots

    def _free_slots(self, slots: np.ndarray) -> None:
        self.slot_id[slots] = -1
        self.last[slots] = -1
        self.frequency[slots] = 0
        self._free[self._num_free:self._num_free + slots.size] = slots
        self._num_free += slots.size

    def _grow(self, needed: int) -> None:
        old = self.rows.shape[0]
        capacity = max(needed, old * _GROWTH)
        self.rows = torch.cat([self.rows, torch.zeros(capacity - old, self.dim, dtype=self.dtype)])
        self.state = {n: torch.cat([v, torch.zeros(capacity - old, self.dim, dtype=self.dtype)])
                      for n, v in self.state.items()}
        self.slot_id = np.concatenate([self.slot_id, np.full(capacity - old, -1, np.int64)])
        self.frequency = np.concatenate([self.frequency, np.zeros(capacity - old, np.int64)])
        self.last = np.concatenate([self.last, np.full(capacity - old, -1, np.int64)])
        free = np.empty(capacity, dtype=np.int64)
        free[:self._num_free] = self._free[:self._num_free]
        free[self._num_free:self._num_free + capacity - old] = np.arange(capacity - 1, old - 1, -1)
        self._free = free
        self._num_free += capacity - old

    # -- helpers --

    def _initial(self, ids: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(ids)
        if self.init is None:
            return torch.zeros(ids.size, self.dim, dtype=self.dtype)
        return self.init.rows(tensor, self.dim, self.table, dtype=self.dtype)

    def _ids(self, ids: torch.Tensor | np.ndarray) -> np.ndarray:
        if isinstance(ids, torch.Tensor):
            check_dynamic_ids(ids, self.table)
            return ids.reshape(-1).to("cpu", torch.int64).numpy()
        if ids.dtype.kind not in "iu":
            raise CacheError(f"dynamic table {self.table!r}: ids must be int64, got {ids.dtype}")
        return ids.reshape(-1).astype(np.int64, copy=False)

    def _distinct(self, ids: torch.Tensor | np.ndarray) -> np.ndarray:
        """`ids` sorted and distinct: as they are where they already are (one
        worker's ids of a step, made distinct by it), else `np.unique`'s."""
        flat = self._ids(ids)
        if flat.size < 2 or bool((flat[1:] > flat[:-1]).all()):
            return flat
        return np.unique(flat)

    def _count(self) -> None:
        c, per_row = self.counters, self.dim * self.rows.element_size() * (1 + len(self.state))
        c.live_rows, c.waiting = len(self.live), len(self.waiting)
        c.peak_live_rows = max(c.peak_live_rows, c.live_rows)
        c.bytes = c.live_rows * per_row
        c.index_bytes = (self.live.nbytes + self.waiting.nbytes + self.slot_id.nbytes
                         + self.frequency.nbytes + self.last.nbytes)

    # -- checkpoints --

    def snapshot(self) -> dict[str, torch.Tensor]:
        """The live set (ids ascending), their rows, state and policy columns,
        and the ids waiting for admission: what a sharded checkpoint holds."""
        slots = torch.from_numpy(self.live.columns["slot"].copy())
        out = {"ids": torch.from_numpy(self.live.ids.copy()),
               "rows": self.rows.index_select(0, slots),
               "frequency": torch.from_numpy(self.frequency.take(slots.numpy())),
               "last": torch.from_numpy(self.last.take(slots.numpy())),
               "waiting_ids": torch.from_numpy(self.waiting.ids.copy()),
               "waiting_seen": torch.from_numpy(self.waiting.columns["seen"].copy()),
               "waiting_last": torch.from_numpy(self.waiting.columns["last"].copy()),
               "step": torch.tensor([-1 if self._step is None else self._step])}
        out.update({f"state.{n}": v.index_select(0, slots) for n, v in self.state.items()})
        return out

    def restore(self, snapshots: list[dict[str, torch.Tensor]], sharding: IdSharding) -> None:
        """Take this server's ids (by `sharding`) out of the snapshots of any
        number of servers (resharding: each snapshot's ids are distinct from
        the others'). Requires: an empty store."""
        if len(self.live) or len(self.waiting):
            raise CacheError(f"dynamic table {self.table!r}: restore into a store that holds "
                             f"rows already")
        def mine(name: str, key: str = "ids") -> np.ndarray:
            parts = [s[name].numpy() for s in snapshots]
            owners = [sharding.server_of(s[key].numpy()) == self.server for s in snapshots]
            return np.concatenate([p[o] for p, o in zip(parts, owners)] or [np.empty(0)])
        ids = mine("ids").astype(np.int64)
        order = np.argsort(ids, kind="stable")
        ids = ids.take(order)
        budget = self.policy.row_budget
        if budget is not None and ids.size > budget:
            raise RowBudgetError(f"dynamic table {self.table!r} on server {self.server}: the "
                                 f"checkpoint gives it {ids.size} rows but its row budget is "
                                 f"{budget}; raise DynamicTable(row_budget=...) or restore "
                                 f"onto more servers")
        slots = self._take_slots(ids.size)
        self.slot_id[slots] = ids
        self.frequency[slots] = mine("frequency").astype(np.int64).take(order)
        self.last[slots] = mine("last").astype(np.int64).take(order)
        where = torch.from_numpy(slots)
        rows = torch.cat([s["rows"][torch.from_numpy(sharding.server_of(s["ids"].numpy())
                                                      == self.server)] for s in snapshots])
        self.rows[where] = rows[torch.from_numpy(order)]
        for n in self.state_names:
            state = torch.cat([s[f"state.{n}"][torch.from_numpy(
                sharding.server_of(s["ids"].numpy()) == self.server)] for s in snapshots])
            self.state[n][where] = state[torch.from_numpy(order)]
        self.live.insert(ids, slot=slots)
        waiting = mine("waiting_ids", "waiting_ids").astype(np.int64)
        wait_order = np.argsort(waiting, kind="stable")
        self.waiting.insert(waiting.take(wait_order),
                            seen=mine("waiting_seen", "waiting_ids").astype(np.int64).take(
                                wait_order),
                            last=mine("waiting_last", "waiting_ids").astype(np.int64).take(
                                wait_order))
        steps = [int(s["step"][0]) for s in snapshots]
        self._step = max(steps) if steps and max(steps) >= 0 else None
        self._count()
