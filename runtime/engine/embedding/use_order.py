"""A cache's slots in LRU eviction order, kept step by step.

LRU evicts the slots used longest ago, equal last uses in slot order: the
order of `argsort(last_used, stable=True)`. Sorting (or even scanning) every
slot each step costs the whole cache's size; this order costs only what
changes. Each step appends the slots it used, sorted, tagged with the step.
An entry is current while its slot's last use is still that step: a later
use appends a newer entry, and the old one, stale, is skipped when reached.
So the current entries, front to back, are every used slot in eviction
order, and a plan's victims are the first current entries it does not pin.
A plan reads the entries from the front up to its last victim (those
skipped included) and drops them once it is made. Numpy arrays, views of
the cache's maps (as `RowCache.plan` uses them).
"""

from __future__ import annotations

from collections import deque

import numpy as np

__all__ = ["UseOrder"]

# `oldest` reads an entry in chunks of this many slots per slot still
# wanted (on the bench's 20 % caches about a third of an entry's slots are
# current), and at least this many.
_CHUNK_PER_WANTED = 4
_MIN_CHUNK = 256


class UseOrder:
    def __init__(self, last_used: np.ndarray, filled: int) -> None:
        """The order of the first `filled` slots by `last_used`."""
        order = np.argsort(last_used[:filled], kind="stable")
        # (slots, the step each was used at), front first.
        self._entries: deque[tuple[np.ndarray, np.ndarray]] = deque(
            [(order, last_used.take(order))] if filled else [])
        self.num_entries = filled  # current and stale

    def oldest(self, count: int, last_used: np.ndarray, pinned: np.ndarray
               ) -> tuple[np.ndarray, tuple[int, int]] | None:
        """The `count` slots LRU evicts first, skipping those marked in
        `pinned` (a bool per slot), in eviction order; and where they end
        (for `drop`). None if fewer than `count` are there to take."""
        found, taken = [np.empty(0, dtype=np.int64)], 0
        if count == 0:
            return found[0], (0, 0)
        for index, (slots, steps) in enumerate(self._entries):
            # An entry (a step's used slots) is read a chunk at a time, each
            # a few times what is still wanted: its end often goes unread.
            start = 0
            while start < slots.size:
                wanted = count - taken
                end = min(slots.size, start + max(_MIN_CHUNK, _CHUNK_PER_WANTED * wanted))
                chunk = slots[start:end]
                current = last_used.take(chunk) == steps[start:end]
                current &= ~pinned.take(chunk)
                positions = np.flatnonzero(current)[:wanted]
                found.append(chunk.take(positions))
                taken += positions.size
                if taken == count:
                    return np.concatenate(found), (index, start + int(positions[-1]) + 1)
                start = end
        return None

    def drop(self, end: tuple[int, int]) -> None:
        """Forget the entries before `end` (an `oldest` of the plan just made:
        its victims and the pinned slots skipped are all used at the plan's
        step now, so none of those entries is current any more)."""
        index, position = end
        for _ in range(index):
            self.num_entries -= self._entries.popleft()[0].size
        if self._entries and position:
            slots, steps = self._entries.popleft()
            self.num_entries -= min(position, slots.size)
            if position < slots.size:
                self._entries.appendleft((slots[position:], steps[position:]))

    def append(self, step: int, used: np.ndarray) -> None:
        """The slots `used` at `step` (distinct, sorted), after every earlier use."""
        if used.size:
            self._entries.append((used, np.full(used.size, step, dtype=np.int64)))
            self.num_entries += used.size
