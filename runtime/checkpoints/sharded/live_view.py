"""A dynamic table's live rows in a sharded checkpoint, read by id: what
`finish()` hands back for a dynamic table whose live rows are larger than
`gather_tables_up_to`.

Each server wrote its live set whole (`live_rows/<table>/server<k>`: its
ids ascending, their rows and row state), so the rows of some ids are found
by a binary search in each set's ids (8 bytes a row, read once) and read as
runs of consecutive positions, without reading any other row.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from ...errors import CheckpointError
from .layout import live_path
from .read import ShardedCheckpoint

__all__ = ["LiveTable", "live_row_count"]


def live_row_count(opened: ShardedCheckpoint, table: str) -> int:
    """The live rows of `table` over every server that wrote it."""
    count, server = 0, 0
    while (md := opened.tensor_md(live_path(table, server, "ids"))) is not None:
        count += md.size[0]
        server += 1
    return count


class LiveTable:
    """The live rows of dynamic table `table` (`name`: "rows", or "state.<n>"
    for a row state) in the sharded checkpoint `directory`. `view.ids`: the
    live ids, ascending; `view[ids]` the rows of `ids` (any shape; each must
    be live), shaped `(*ids.shape, dim)`; `load()` every live row in id order
    (`finish()`'s gathered `<key>`, beside `view.ids`)."""

    def __init__(self, directory: str | os.PathLike, table: str, name: str = "rows", *,
                 checkpoint: ShardedCheckpoint | None = None) -> None:
        self.directory = os.fspath(directory)
        self.table, self.name = table, name
        self._opened = checkpoint or ShardedCheckpoint(directory)
        self._servers = []
        while self._opened.tensor_md(live_path(table, len(self._servers), "ids")) is not None:
            self._servers.append(len(self._servers))
        md = self._opened.tensor_md(live_path(table, 0, name)) if self._servers else None
        if md is None or len(md.size) != 2:
            raise CheckpointError(f"checkpoint {self.directory} holds no live rows of the "
                                  f"dynamic table {table!r} ({name}); was it saved from a job "
                                  f"with that table?")
        self.dim, self.dtype = md.size[1], md.properties.dtype
        self._ids = [self._opened.read_whole(live_path(table, s, "ids")).numpy()
                     for s in self._servers]
        self.shape = (sum(ids.size for ids in self._ids), self.dim)

    def __repr__(self) -> str:
        return (f"LiveTable({self.table!r}, {self.name!r}, shape={list(self.shape)}, "
                f"dtype={self.dtype}, in {self.directory})")

    @property
    def ids(self) -> torch.Tensor:
        return torch.from_numpy(np.sort(np.concatenate(self._ids)))

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or \
                ids.dtype.is_complex or ids.dtype == torch.bool:
            raise CheckpointError(f"{self!r}: rows are read by an integer tensor of ids")
        wanted, inverse = np.unique(ids.reshape(-1).to("cpu", torch.int64).numpy(),
                                    return_inverse=True)
        rows = torch.empty(wanted.size, self.dim, dtype=self.dtype)
        found = np.zeros(wanted.size, dtype=bool)
        for server, stored in zip(self._servers, self._ids):
            if not stored.size:
                continue
            position = np.minimum(np.searchsorted(stored, wanted), stored.size - 1)
            here = stored.take(position) == wanted
            if here.any():
                rows[torch.from_numpy(np.flatnonzero(here))] = self._read_runs(
                    server, position.compress(here))
                found |= here
        if not found.all():
            raise CheckpointError(f"{self!r}: id {int(wanted[~found][0])} has no live row "
                                  f"(never admitted, or expired)")
        return rows.index_select(0, torch.from_numpy(inverse.reshape(-1))).reshape(
            *ids.shape, self.dim)

    def load(self) -> torch.Tensor:
        """Every live row, in id order."""
        parts = [self._opened.read_whole(live_path(self.table, s, self.name))
                 for s in self._servers]
        order = torch.from_numpy(np.argsort(np.concatenate(self._ids), kind="stable"))
        return torch.cat(parts).index_select(0, order)

    def _read_runs(self, server: int, positions: np.ndarray) -> torch.Tensor:
        """Server `server`'s stored rows at sorted, distinct `positions`, read
        as runs of consecutive positions."""
        breaks = np.flatnonzero(np.diff(positions) != 1) + 1
        starts = np.concatenate([positions[:1], positions[breaks]])
        lengths = np.diff(np.concatenate([[0], breaks, [positions.size]]))
        path = live_path(self.table, server, self.name)
        return torch.cat(self._opened.read([(path, (int(start), 0), (int(length), self.dim))
                                            for start, length in zip(starts, lengths)]))
