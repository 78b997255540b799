"""A row-sharded table in a sharded checkpoint, read by id: what `finish()`
hands back for a table too large to gather whole (`gather_tables_up_to`).

The servers store a table's rows in hash order (`embedding/sharding.py`):
the row of id `i` sits at position `hash(i)`, whatever the number of
servers, so the rows of some ids are found without reading any others. Each
read also reads the stored ids at those positions and checks them: a
checkpoint of another table or hash is refused, not read as wrong rows. The
first read of a data file verifies its sha256 (`read.py`), which reads that
file once.
"""

from __future__ import annotations

import os

import torch

from ...engine.embedding.sharding import RowSharding
from ...errors import CheckpointError
from .layout import Path, dtype_name, fqn_of, ids_path, row_paths
from .read import ShardedCheckpoint

__all__ = ["ShardedTable"]


class ShardedTable:
    """The rows of `table`'s tensor at `path` (the table itself, or a row
    state) in the sharded checkpoint `directory`. `view[ids]` reads the rows
    of `ids` (an integer tensor of any shape; the rows come shaped
    `(*ids.shape, dim)`), `load()` the whole tensor in id order."""

    def __init__(self, directory: str | os.PathLike, table: str, path: Path, *,
                 checkpoint: ShardedCheckpoint | None = None) -> None:
        self.directory = os.fspath(directory)
        self.table = table
        self.path = tuple(path)
        self._opened = checkpoint or ShardedCheckpoint(directory)
        md = self._opened.tensor_md(row_paths(table, self.path))
        if md is None or len(md.size) != 2:
            raise CheckpointError(f"checkpoint {self.directory} holds no rows of table "
                                  f"{table!r} at {fqn_of(self.path)!r}; was it saved from an "
                                  f"embedding-cache job with that table?")
        self.shape = tuple(md.size)
        self.dtype = md.properties.dtype
        self._hash = RowSharding(self.shape[0], 1)

    def __repr__(self) -> str:
        return (f"ShardedTable({self.table!r}, {fqn_of(self.path)!r}, shape={list(self.shape)}, "
                f"dtype={self.dtype}, in {self.directory})")

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or \
                ids.dtype.is_complex or ids.dtype == torch.bool:
            raise CheckpointError(f"{self!r}: rows are read by an integer tensor of ids, got "
                                  f"{_kind(ids)}")
        flat = ids.reshape(-1).to("cpu", torch.int64)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.shape[0]):
            bad = flat[(flat < 0) | (flat >= self.shape[0])][0]
            raise CheckpointError(f"{self!r}: id {int(bad)} is outside the table's "
                                  f"{self.shape[0]} rows (ids 0-{self.shape[0] - 1})")
        positions, inverse = torch.unique(self._hash.hashed(flat), return_inverse=True)
        rows = self._read_positions(positions)
        return rows.index_select(0, inverse).reshape(*ids.shape, self.shape[1])

    def load(self) -> torch.Tensor:
        """The whole tensor, rows in id order (as `finish()` gathers it)."""
        return self._opened.read_in_id_order(self.table, self.path)

    def _read_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """The stored rows at sorted, distinct hash `positions`, read as runs
        of consecutive positions; their stored ids checked against the hash."""
        if positions.numel() == 0:
            return torch.empty(0, self.shape[1], dtype=self.dtype)
        breaks = (positions[1:] - positions[:-1] != 1).nonzero().reshape(-1) + 1
        starts = torch.cat([positions[:1], positions[breaks]]).tolist()
        lengths = torch.diff(torch.cat([breaks, torch.tensor([positions.numel()])]),
                             prepend=torch.tensor([0])).tolist()
        rows_at, ids_at = row_paths(self.table, self.path), ids_path(self.table)
        requests = [(rows_at, (start, 0), (length, self.shape[1]))
                    for start, length in zip(starts, lengths)]
        requests += [(ids_at, (start,), (length,)) for start, length in zip(starts, lengths)]
        parts = self._opened.read(requests)
        rows, stored_ids = torch.cat(parts[:len(starts)]), torch.cat(parts[len(starts):])
        expected = self._hash.ids_at(0, positions.numpy().copy())
        if not torch.equal(stored_ids, expected):
            raise CheckpointError(f"{self!r}: the ids stored with the rows are not in the "
                                  f"servers' hash order; was it written by this version of "
                                  f"splitrun?")
        return rows


def _kind(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {dtype_name(value.dtype)} tensor"
    return type(value).__name__
