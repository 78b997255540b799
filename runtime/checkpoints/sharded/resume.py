"""Resuming one process from a sharded checkpoint: it reads only what it owns
(in parallel mode its piece of each sharded tensor, on a server its
contiguous range of each table's rows), whatever cluster wrote it."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from splitrun.splitter.initial_state import copy_state
from splitrun.splitter.labels import Label, Role
from splitrun.splitter.program import Program
from splitrun.splitter.splitting.graph_splitter import SplitProgram

from ...engine.embedding.attach import cached_tables_of
from ...engine.embedding.id_sharding import IdSharding
from ...engine.embedding.sharding import RowSharding
from ...engine.embedding.store import LiveRows, LocalRows
from ...errors import CheckpointError
from .layout import Path, ids_path, live_path, row_paths, state_paths
from .read import ShardedCheckpoint, check_against, check_finite, read_step

__all__ = ["RowRange", "load_state", "load_for"]


def _read_key(opened: ShardedCheckpoint, key: str, path: Path, expected: torch.Tensor
              ) -> torch.Tensor:
    """A state tensor whole: stored plainly, or row-sharded in hash order
    (saved in embedding-cache mode, resumed in another)."""
    if opened.tensor_md(path) is None:
        for table, paths in opened.row_tables().items():
            if path in paths:
                check_against(opened, row_paths(table, path), key, expected)
                return check_finite(opened, key, opened.read_in_id_order(table, path))
    check_against(opened, path, key, expected)
    return check_finite(opened, key, opened.read_whole(path))


def _region(tensor: torch.Tensor, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    for dim, (start, length) in enumerate(zip(offsets, sizes)):
        tensor = tensor.narrow(dim, start, length)
    return tensor


@dataclass(frozen=True)
class RowRange:
    """The rows of a row-sharded table one server holds: hash-order rows
    [first, end), whose ids are `ids`; `keys`: the table and its row state."""

    table: str
    keys: tuple[str, ...]
    first: int
    end: int
    ids: torch.Tensor


def load_state(program: Program, directory: str | os.PathLike, keys: Iterable[str],
               row_ranges: Sequence[RowRange] = (),
               regions: Mapping[str, tuple[tuple[int, ...], tuple[int, ...]]] | None = None
               ) -> tuple[dict[str, torch.Tensor], int]:
    """The state one process starts from: the captured program's initial state
    with `keys` (captured-program keys this process owns) read from the
    checkpoint; of a key in `regions` (offsets, sizes) only that region, of
    each table in `row_ranges` only those rows, as `LocalRows` (what the
    server's store starts from; no process builds the whole table). Reads
    nothing else; returns (state, step)."""
    opened = ShardedCheckpoint(directory)
    step = read_step(opened)
    paths = state_paths(program)
    initial = program.initial_state
    state = copy_state(initial)  # nothing made: a process takes its own
    regions = regions or {}
    for key in sorted(set(keys)):
        if key not in paths:
            continue
        if key in regions and opened.tensor_md(paths[key]) is not None:
            check_against(opened, paths[key], key, initial.like(key))
            offsets, sizes = regions[key]
            value = check_finite(opened, key, opened.read([(paths[key], offsets, sizes)])[0])
            full = initial[key].clone()
            _region(full, offsets, sizes).copy_(value)
            state[key] = full
        else:
            state[key] = _read_key(opened, key, paths[key], initial.like(key))
    for rows in row_ranges:
        if opened.tensor_md(ids_path(rows.table)) is None:  # saved in another mode: plain
            for key in rows.keys:
                state[key] = _read_key(opened, key, paths[key], initial.like(key))
            continue
        requests = [(ids_path(rows.table), (rows.first,), (rows.end - rows.first,))]
        for key in rows.keys:
            expected = initial.like(key)
            check_against(opened, row_paths(rows.table, paths[key]), key, expected)
            requests.append((row_paths(rows.table, paths[key]),
                             (rows.first,) + (0,) * (expected.dim() - 1),
                             (rows.end - rows.first, *expected.shape[1:])))
        saved_ids, *values = opened.read(requests)
        if not torch.equal(saved_ids, rows.ids):
            raise CheckpointError(
                f"checkpoint {opened.directory}: the rows of {rows.table!r} are in another "
                f"hash order than this version of splitrun uses; `splitrun export` it to a "
                f"file and resume from that")
        for key, value in zip(rows.keys, values):
            # This server's rows only (in its local order): no whole table.
            state[key] = LocalRows(rows.first, check_finite(opened, key, value))
    return state, step


def load_for(program: Program, split: SplitProgram, label: Label,
             directory: str | os.PathLike) -> tuple[dict[str, torch.Tensor], int]:
    """`label`'s part of a sharded checkpoint: the state it owns (in parallel
    mode just its piece of each sharded tensor), and on a server of an
    embedding-cache split its rows of every table."""
    keys, regions = [], {}
    for key in split.plan.process(label).state:
        piece = split.artifacts.state_piece(key)
        if piece is None:
            keys.append(key)
            continue
        keys.append(piece.key)
        if not piece.is_replica:
            regions[piece.key] = (piece.offsets, piece.sizes)
    ranges, dynamic = [], []
    cache = cached_tables_of(split)
    if cache is not None and label.role is Role.SERVER:
        for table in cache.tables:
            if table.settings.dynamic is not None:
                dynamic.append(table.key)
                continue
            sharding = RowSharding(table.num_rows, split.plan.cluster.num_servers)
            ranges.append(RowRange(
                table.key, (table.key, *(f"{table.key}.{n}" for n in table.state_names)),
                sharding.bounds[label.rank], sharding.bounds[label.rank + 1],
                sharding.ids_of(label.rank)))
    state, step = load_state(program, directory, keys, ranges, regions)
    if dynamic:
        opened = ShardedCheckpoint(directory)
        sharding = IdSharding(split.plan.cluster.num_servers)
        for table in dynamic:
            state[table] = _live_rows(opened, table, sharding, label.rank)
    return state, step


def _live_rows(opened: ShardedCheckpoint, table: str, sharding: IdSharding, rank: int
               ) -> LiveRows:
    """Server `rank`'s part of a dynamic table's saved live sets, whatever
    number of servers wrote them: each saved server's set is read in turn
    and cut to the ids `rank` owns (the rest is dropped before the next)."""
    if opened.tensor_md(live_path(table, 0, "ids")) is None:
        raise CheckpointError(f"checkpoint {opened.directory} holds no live rows of the "
                              f"dynamic table {table!r}; was it saved from this model?")
    mine = []
    saved = 0
    while opened.tensor_md(live_path(table, saved, "ids")) is not None:
        prefix = live_path(table, saved, "")[:-1]
        snapshot = {path[-1]: check_finite(opened, table, opened.read_whole(path))
                    for path in opened.paths.values() if path[:-1] == prefix}
        keep = {"ids": sharding.server_of(snapshot["ids"].numpy()) == rank,
                "waiting_ids": sharding.server_of(snapshot["waiting_ids"].numpy()) == rank}
        cut = {}
        for name, value in snapshot.items():
            by = "waiting_ids" if name.startswith("waiting_") else "ids"
            cut[name] = value if name == "step" else value[torch.from_numpy(keep[by])]
        mine.append(cut)
        saved += 1
    return LiveRows(tuple(mine))
