"""Lazy rows: which slot of a shard's row buffer holds each of its rows.

A table with a row initializer (`CacheSettings.init`) starts with no rows on
its server: a row gets a slot the first time a request names it (a pull, a
write-back, a gradient), its starting value made then from the initializer.
Slots are handed out in first-use order from the start of the shard's part of
its buffer, and the buffer is reserved, not written, at start-up: the
operating system backs its pages only once they are touched, so a server's
memory grows with the rows used (page by page), not with the rows declared.

The map holds slot + 1 per local row (0: no slot yet) in an int32 array made
by `small_page_zeros` (backed 4 KiB page by page as rows are first named); a
request's rows cost one gather and one check on top of the hashing (`find`).
Used by `EmbeddingStore`; a store of unbounded ids can keep its own map and
reuse `fill_new`'s contract.
"""

from __future__ import annotations

import numpy as np

from .huge_pages import small_page_zeros

__all__ = ["RowSlots"]


class RowSlots:
    """Slots of a shard of `size` rows; `present=True`: every row has its own
    local index as slot already (a shard filled at start-up)."""

    def __init__(self, size: int, *, present: bool = False) -> None:
        self.size = size
        dtype = np.int32 if size < (1 << 31) - 1 else np.int64
        if present:
            self._slot_plus_one = np.arange(1, size + 1, dtype=dtype)
            self.used = size
        else:
            self._slot_plus_one = small_page_zeros(size, dtype)
            self.used = 0

    def find(self, local: np.ndarray, offset: int = 0) -> tuple[np.ndarray, np.ndarray | None]:
        """The slots (int64, plus `offset`: where the shard's buffer starts)
        of the shard's rows `local` (int64 local indices, checked by the
        caller to lie in the shard), and the local rows that got their slot
        now (unique, ascending; None when none did): the caller fills those
        before using them. Rows all seen before (the hot path): one gather,
        one check, one subtraction."""
        taken = self._slot_plus_one.take(local)
        if taken.size and taken.all():
            return np.subtract(taken, 1 - offset, dtype=np.int64), None
        new = np.unique(local[taken == 0])
        self._slot_plus_one[new] = np.arange(self.used + 1, self.used + 1 + new.size,
                                             dtype=self._slot_plus_one.dtype)
        self.used += new.size
        taken = self._slot_plus_one.take(local)
        return np.subtract(taken, 1 - offset, dtype=np.int64), (new if new.size else None)

    def present(self) -> tuple[np.ndarray, np.ndarray]:
        """(local rows that have a slot, their slots), by local row."""
        local = np.flatnonzero(self._slot_plus_one)
        return local, self._slot_plus_one[local].astype(np.int64) - 1

    @property
    def map_bytes(self) -> int:
        return self._slot_plus_one.nbytes
