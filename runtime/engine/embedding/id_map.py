"""int64 ids -> aligned int64 columns (a slot, sightings, a step), for ids
from anywhere in int64 (a dynamic table's hashed ids): the ids sorted in one
array, each column aligned with it, found by a binary search.

A step's lookups, inserts and removals are a few numpy calls over the step's
ids (a dense map over the id space, as the bounded tables' caches use, cannot
span 2^64 ids; a Python dict costs ~100x more a step's id).
"""

from __future__ import annotations

import numpy as np

__all__ = ["IdMap", "SparseSlots"]

_EMPTY = np.empty(0, dtype=np.int64)


class IdMap:
    def __init__(self, columns: tuple[str, ...]) -> None:
        self.ids = _EMPTY
        self.columns: dict[str, np.ndarray] = {name: _EMPTY for name in columns}

    def __len__(self) -> int:
        return self.ids.size

    @property
    def nbytes(self) -> int:
        return self.ids.nbytes + sum(c.nbytes for c in self.columns.values())

    def find(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(position of each of `ids` in the map, whether it is there); the
        position of an absent id is meaningless (in range if the map is not
        empty)."""
        if not self.ids.size:
            return np.zeros(ids.size, dtype=np.int64), np.zeros(ids.size, dtype=bool)
        positions = np.searchsorted(self.ids, ids)
        np.minimum(positions, self.ids.size - 1, out=positions)
        return positions, self.ids.take(positions) == ids

    def insert(self, ids: np.ndarray, **values: np.ndarray) -> None:
        """Add `ids` (sorted, distinct, absent) with a value in every column."""
        if not ids.size:
            return
        if set(values) != set(self.columns):
            raise ValueError(f"IdMap.insert needs values for {sorted(self.columns)}, got "
                             f"{sorted(values)}")
        where = np.searchsorted(self.ids, ids)
        self.ids = np.insert(self.ids, where, ids)
        for name, column in self.columns.items():
            self.columns[name] = np.insert(column, where, values[name].astype(np.int64))

    def keep(self, mask: np.ndarray) -> None:
        """Keep only the entries where `mask` (aligned with the map) holds."""
        self.ids = self.ids.compress(mask)
        for name, column in self.columns.items():
            self.columns[name] = column.compress(mask)

    def remove(self, ids: np.ndarray) -> None:
        """Drop `ids` (each in the map)."""
        if not ids.size:
            return
        positions, _ = self.find(ids)
        mask = np.ones(self.ids.size, dtype=bool)
        mask[positions] = False
        self.keep(mask)


class SparseSlots:
    """slot + 1 of each cached id (0: not cached) over int64 ids: a worker's
    cache of a dynamic table (`RowCache`) uses it where a bounded table's
    cache uses a dense numpy array over its rows, through the same two
    calls, `take(ids)` and `slots[ids] = values` (0 removes). Its size is the
    cached ids', whatever the ids."""

    def __init__(self) -> None:
        self._map = IdMap(("slot_plus_one",))

    def __len__(self) -> int:
        return len(self._map)

    @property
    def nbytes(self) -> int:
        return self._map.nbytes

    def take(self, ids: np.ndarray) -> np.ndarray:
        if not len(self._map):
            return np.zeros(ids.shape, dtype=np.int64)
        positions, found = self._map.find(ids.reshape(-1))
        taken = self._map.columns["slot_plus_one"].take(positions)
        return np.where(found, taken, 0).reshape(ids.shape)

    def __setitem__(self, ids: np.ndarray, values) -> None:
        """`values` (one, or one per id) for distinct `ids`; 0 drops an id."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if not ids.size:
            return
        values = np.broadcast_to(np.asarray(values, dtype=np.int64), ids.shape)
        positions, found = self._map.find(ids)
        column = self._map.columns["slot_plus_one"]
        kept = found & (values != 0)
        column[positions.compress(kept)] = values.compress(kept)
        dropped = found & (values == 0)
        if dropped.any():
            mask = np.ones(len(self._map), dtype=bool)
            mask[positions.compress(dropped)] = False
            self._map.keep(mask)
        new = ~found & (values != 0)
        if new.any():
            order = np.argsort(ids.compress(new), kind="stable")
            self._map.insert(ids.compress(new).take(order),
                             slot_plus_one=values.compress(new).take(order))
