"""int64 ids -> aligned int64 columns (a slot, sightings, a step), for ids
from anywhere in int64 (a dynamic table's hashed ids): the ids sorted in one
array, each column aligned with it, found by a binary search.

A step's lookups, inserts and removals are a few numpy calls over the step's
ids (a dense map over the id space, as the bounded tables' caches use, cannot
span 2^64 ids; a Python dict costs ~100x more a step's id).
"""

from __future__ import annotations

import numpy as np

__all__ = ["IdMap"]

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
