"""Criteo display-advertising click logs, as users have them: a TSV file, one
sample a line, 40 tab-separated fields:

    label <TAB> I1 ... I13 <TAB> C1 ... C26

`label` is 0 or 1, `I*` are integers (counts, some negative), `C*` are
categorical values written as hexadecimal strings (32-bit hashes in the real
logs); any feature may be empty (missing). The label is never missing.

`CriteoFile` streams such a file through a `torch.utils.data.DataLoader`
(`CriteoDataset` is an `IterableDataset`): batches of
`(dense, ids_0, ..., ids_{K-1}, label)` with

- `dense` float32 [b, 13]: log(1 + max(x, 0)) of each integer feature, 0 where
  missing (DLRM's transform);
- `ids_t` int64 [b, 1]: categorical feature t hashed into table t's rows
  (`hash_categories`, stable across processes and machines); a missing value
  is row 0, present ones rows 1 .. rows-1, so `padding_idx=0` ignores them;
- `label` float32 [b].

Worker r of W reads only its own shard of each global batch: the file's lines
are read in order, and lines that belong to other workers are skipped without
being parsed. `CriteoFile.worker_shard(rank, W)` is what `Trainer.shard` uses,
so no process builds a global batch.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ..errors import SplitrunError

__all__ = ["NUM_INTEGER", "NUM_CATEGORICAL", "NUM_FIELDS", "CriteoFormatError", "CriteoSchema",
           "CriteoDataset", "CriteoFile", "hash_categories", "parse_lines"]

logger = logging.getLogger(__name__)

NUM_INTEGER = 13
NUM_CATEGORICAL = 26
NUM_FIELDS = 1 + NUM_INTEGER + NUM_CATEGORICAL
# The row missing categorical values map to (present ones never do).
MISSING_ROW = 0

# splitmix64's constants (Steele et al.): a bijective 64-bit mix, so distinct
# tokens of one feature collide only through the final modulo.
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_MISSING_TOKEN = -1


class CriteoFormatError(SplitrunError):
    """A line of a Criteo-format file that cannot be read."""


@dataclass(frozen=True)
class CriteoSchema:
    """How the categorical features become table rows.

    `table_rows`: the rows of the table of each categorical feature used,
    features C1, C2, ... in order (1 to 26 of them; features past the last are
    not read). `hash_seed` changes every feature's hash (the same seed on every
    process gives the same rows).
    """

    table_rows: tuple[int, ...]
    hash_seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= len(self.table_rows) <= NUM_CATEGORICAL:
            raise CriteoFormatError(
                f"CriteoSchema takes the rows of 1 to {NUM_CATEGORICAL} tables (one per "
                f"categorical feature used), got {len(self.table_rows)}")
        small = [(t, n) for t, n in enumerate(self.table_rows) if n < 2]
        if small:
            table, rows = small[0]
            raise CriteoFormatError(
                f"table {table} has {rows} rows; a hashed feature needs at least 2 (row "
                f"{MISSING_ROW} is for missing values)")

    @property
    def num_tables(self) -> int:
        return len(self.table_rows)


def _splitmix64(values: np.ndarray) -> np.ndarray:
    z = values.astype(np.uint64) + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def hash_categories(tokens: np.ndarray | Sequence[int], table: int, num_rows: int,
                    seed: int = 0) -> np.ndarray:
    """Rows of table `table` (of `num_rows` rows) for categorical tokens (the
    hexadecimal values as integers; -1 for missing).

    Pure integer arithmetic (splitmix64 of the token mixed with the table and
    seed), so every process, machine and Python hash seed agrees. Missing
    tokens go to row 0, present ones to rows 1 .. num_rows-1.
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    salt = _splitmix64(np.array([(seed << 8) | table], dtype=np.uint64))[0]
    with np.errstate(over="ignore"):
        mixed = _splitmix64(tokens.astype(np.uint64) ^ salt)
    rows = (mixed % np.uint64(num_rows - 1)).astype(np.int64) + 1
    return np.where(tokens == _MISSING_TOKEN, MISSING_ROW, rows)


def _field_error(where: str, column: int, value: bytes, expected: str) -> CriteoFormatError:
    name = "label" if column == 0 else (f"I{column}" if column <= NUM_INTEGER
                                        else f"C{column - NUM_INTEGER}")
    return CriteoFormatError(f"{where}: field {column + 1} ({name}) is {value[:40]!r}; "
                             f"expected {expected}")


def parse_lines(lines: Sequence[bytes], schema: CriteoSchema, *, where: str = "<lines>",
                first_line: int = 1) -> tuple[torch.Tensor, ...]:
    """Parse Criteo lines into `(dense, ids_0, ..., label)` (see the module
    docstring). `where` and `first_line` name the source in errors."""
    count = len(lines)
    num_tables = schema.num_tables
    labels = np.empty(count, dtype=np.float32)
    integers = np.zeros((count, NUM_INTEGER), dtype=np.int64)
    tokens = np.empty((count, num_tables), dtype=np.int64)
    last_column = 1 + NUM_INTEGER + num_tables
    for row, line in enumerate(lines):
        fields = line.rstrip(b"\r\n").split(b"\t")
        here = f"{where} line {first_line + row}"
        if len(fields) != NUM_FIELDS:
            raise CriteoFormatError(
                f"{here} has {len(fields)} tab-separated fields; the Criteo format has "
                f"{NUM_FIELDS} (label, {NUM_INTEGER} integer and {NUM_CATEGORICAL} "
                f"categorical features; empty fields for missing values)")
        label = fields[0]
        if label not in (b"0", b"1"):
            raise _field_error(here, 0, label, "0 or 1")
        labels[row] = label == b"1"
        for column in range(1, 1 + NUM_INTEGER):
            value = fields[column]
            if value:
                try:
                    integers[row, column - 1] = int(value)
                except ValueError:
                    raise _field_error(here, column, value,
                                       "an integer or nothing (missing)") from None
        for column in range(1 + NUM_INTEGER, last_column):
            value = fields[column]
            try:
                tokens[row, column - 1 - NUM_INTEGER] = int(value, 16) if value else \
                    _MISSING_TOKEN
            except ValueError:
                raise _field_error(here, column, value,
                                   "a hexadecimal value or nothing (missing)") from None
    dense = torch.from_numpy(np.log1p(np.maximum(integers, 0)).astype(np.float32))
    ids = [torch.from_numpy(hash_categories(tokens[:, t], t, rows, schema.hash_seed))
           .reshape(count, 1) for t, rows in enumerate(schema.table_rows)]
    return (dense, *ids, torch.from_numpy(labels))


def _shard_bounds(batch_size: int, rank: int, num_workers: int) -> tuple[int, int]:
    """Positions [start, stop) of worker `rank`'s rows within a global batch
    (the same rows `runtime.data.shard_batch` gives it)."""
    size = batch_size // num_workers
    return rank * size, (rank + 1) * size


class CriteoDataset(IterableDataset):
    """One worker's shards of the global batches of a Criteo file.

    Global batch g is lines [g*B, (g+1)*B); worker `rank` of `num_workers`
    takes positions [rank*B/W, (rank+1)*B/W) of each. With `drop_last` a final
    partial global batch is left out (the captured step has fixed shapes);
    without it, each worker takes its positions of it that exist. With several
    DataLoader processes, loader process j of J handles global batches
    g = j mod J (the DataLoader interleaves them back in order).
    """

    def __init__(self, path: str | os.PathLike, schema: CriteoSchema, batch_size: int, *,
                 rank: int = 0, num_workers: int = 1, drop_last: bool = True,
                 epochs: int = 1) -> None:
        super().__init__()
        if batch_size < 1 or batch_size % num_workers:
            raise CriteoFormatError(
                f"global batch size {batch_size} must be a positive multiple of the "
                f"{num_workers} workers that share it")
        if not 0 <= rank < num_workers:
            raise CriteoFormatError(f"worker rank {rank} is outside 0..{num_workers - 1}")
        if epochs < 1:
            raise CriteoFormatError(f"epochs must be >= 1, got {epochs}")
        self.path = os.fspath(path)
        self.schema = schema
        self.batch_size = batch_size
        self.rank = rank
        self.num_workers = num_workers
        self.drop_last = drop_last
        self.epochs = epochs

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        info = get_worker_info()
        loader, num_loaders = (0, 1) if info is None else (info.id, info.num_workers)
        for _ in range(self.epochs):
            yield from self._epoch(loader, num_loaders)

    def _epoch(self, loader: int, num_loaders: int) -> Iterator[tuple[torch.Tensor, ...]]:
        start, stop = _shard_bounds(self.batch_size, self.rank, self.num_workers)
        mine: list[bytes] = []
        first_line = 0
        batch, position = 0, 0
        with open(self.path, "rb") as source:
            for number, line in enumerate(source):
                if batch % num_loaders == loader and start <= position < stop:
                    if not mine:
                        first_line = number + 1
                    mine.append(line)
                position += 1
                if position == self.batch_size:
                    if mine:
                        yield parse_lines(mine, self.schema, where=self.path,
                                          first_line=first_line)
                    mine = []
                    batch, position = batch + 1, 0
        if mine and not self.drop_last:  # this worker's part of a partial last batch
            yield parse_lines(mine, self.schema, where=self.path, first_line=first_line)
        elif position and self.drop_last:
            logger.debug("%s: the last %d lines make no whole global batch of %d; left out",
                         self.path, position, self.batch_size)


@dataclass(frozen=True)
class CriteoFile:
    """A Criteo-format file as a source of global batches.

    Iterating it gives whole global batches (one process training alone);
    `worker_shard(rank, num_workers)` gives one worker's shards of them, read
    by that worker alone, which is what `Trainer.shard` asks for.
    `loader_workers`: DataLoader processes per worker (0: read in the
    training process).
    """

    path: str
    schema: CriteoSchema
    batch_size: int
    drop_last: bool = True
    epochs: int = 1
    loader_workers: int = 0

    def worker_shard(self, rank: int, num_workers: int) -> DataLoader:
        dataset = CriteoDataset(self.path, self.schema, self.batch_size, rank=rank,
                                num_workers=num_workers, drop_last=self.drop_last,
                                epochs=self.epochs)
        # batch_size=None: the dataset yields whole batches already.
        return DataLoader(dataset, batch_size=None, num_workers=self.loader_workers)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        return iter(self.worker_shard(0, 1))
