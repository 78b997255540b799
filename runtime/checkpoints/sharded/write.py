"""Writing one process's part of a sharded checkpoint: the pieces of the state
it owns (or a server's rows of the cached tables) as DCP data files of its
own, and the JSON report of what it wrote (`commit.finish_checkpoint` builds
the metadata from every process's report)."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Mapping, Sequence

import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult

from splitrun.splitter.program import Program
from splitrun.splitter.splitting.mode import ModeArtifacts

from ...engine.embedding.store import LiveSnapshot, RowsToWrite, ShardSnapshot
from ..plain import file_sha256, writing
from .layout import (
    FORMAT,
    Path,
    Piece,
    dtype_name,
    fqn_of,
    ids_path,
    live_path,
    row_paths,
    state_paths,
    step_paths,
)

__all__ = ["write_pieces", "driver_objects", "owned_pieces", "row_pieces"]


class _Resolver(SavePlanner):
    """Hands DCP's writer the data of our own write items (no planning: the
    items are made here, the metadata by `finish_checkpoint`)."""

    def __init__(self, data: dict[MetadataIndex, torch.Tensor | io.BytesIO]) -> None:
        self._data = data

    def set_up_planner(self, *args, **kwargs) -> None:
        pass

    def create_local_plan(self) -> SavePlan:
        raise NotImplementedError

    def create_global_plan(self, all_plans):
        raise NotImplementedError

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def resolve_data(self, write_item: WriteItem):
        value = self._data[write_item.index]
        if isinstance(value, RowsToWrite):
            return value.make().contiguous()
        return value


def write_pieces(directory: str | os.PathLike, name: str, pieces: Sequence[Piece],
                 objects: Mapping[Path, object] | None = None) -> bytes:
    """Write this process's pieces (and plain `objects`, as DCP byte items)
    into `directory` as DCP data files prefixed `__{name}_`; a piece of rows
    made when written (`RowsToWrite`, a server's shard of a cached table) goes
    into a file of its own, `__{name}.N_`, made just before and freed once
    written (DCP's writer keeps every tensor of a file until the file is
    done). Returns the JSON report `finish_checkpoint` builds the metadata from."""
    directory = os.fspath(directory)
    deferred = [piece for piece in pieces if isinstance(piece.tensor, RowsToWrite)]
    plain = [piece for piece in pieces if not isinstance(piece.tensor, RowsToWrite)]
    described, files = ([], {}) if deferred and not (plain or objects) else \
        _write_file(directory, name, plain, objects)
    for number, piece in enumerate(deferred, start=1):
        more, more_files = _write_file(directory, f"{name}.{number}", [piece])
        described += more
        files.update(more_files)
    return json.dumps({"name": name, "items": described, "files": files}).encode()


def _write_file(directory: str, name: str, pieces: Sequence[Piece],
                objects: Mapping[Path, object] | None = None
                ) -> tuple[list[dict], dict[str, str]]:
    """One DCP data file of `pieces` and `objects`: what each item is and
    where it went, and the file's sha256 (by file name)."""
    items, data, described = [], {}, []
    for piece in pieces:
        tensor = piece.tensor
        if not isinstance(tensor, RowsToWrite):
            tensor = tensor.detach().cpu().contiguous()
        index = MetadataIndex(fqn_of(piece.path), piece.offsets)
        items.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(torch.Size(piece.offsets), torch.Size(tensor.shape)),
            properties=TensorProperties(dtype=tensor.dtype), size=torch.Size(piece.size))))
        data[index] = tensor
        described.append({"path": list(piece.path), "dtype": dtype_name(tensor.dtype),
                          "size": list(piece.size), "offsets": list(piece.offsets),
                          "sizes": list(tensor.shape)})
    for path, value in (objects or {}).items():
        index = MetadataIndex(fqn_of(path))
        buffer = io.BytesIO()
        torch.save(value, buffer)
        buffer.seek(0)
        items.append(WriteItem(index=index, type=WriteItemType.BYTE_IO))
        data[index] = buffer
        described.append({"path": list(path)})
    with writing(f"checkpoint {directory} ({name}'s part)"):
        writer = FileSystemWriter(directory, single_file_per_rank=True, thread_count=1)
        # Without collectives the writer prefixes its files with `rank`: our name.
        writer.set_up_storage_writer(False, rank=name, use_collectives=False)
        plan = writer.prepare_local_plan(SavePlan(items))
        results: list[WriteResult] = writer.write_data(plan, _Resolver(data)).wait()
        where = {(r.index.fqn, tuple(r.index.offset or ())): r.storage_data for r in results}
        for entry in described:
            info = where[(fqn_of(tuple(entry["path"])), tuple(entry.get("offsets", ())))]
            entry.update(file=info.relative_path, offset=info.offset, length=info.length)
        files = {f: file_sha256(os.path.join(directory, f))
                 for f in sorted({entry["file"] for entry in described})}
    return described, files


def driver_objects(program: Program, step: int, info: Mapping[str, object]
                   ) -> tuple[dict[Path, object], list[Piece]]:
    """What worker 0 writes beside its state: the step, the optimizer's
    param groups, the splitrun info, and the per-parameter step counts."""
    groups, index = [], 0
    for group in program.param_groups:
        indices = list(range(index, index + len(group.params)))
        index += len(group.params)
        groups.append({**group.settings, "params": indices})
    objects = {("step",): step, ("optimizer", "param_groups"): groups,
               ("splitrun",): {**info, "format": FORMAT}}
    counts = [Piece.whole(path, torch.tensor(float(step))) for path in step_paths(program)]
    return objects, counts


def owned_pieces(program: Program, artifacts: ModeArtifacts,
                 state: Mapping[str, torch.Tensor]) -> list[Piece]:
    """The pieces of the state a process owns (`state`, keyed like its split
    program): whole tensors, or in parallel mode its piece of each sharded
    tensor (a replica is written by its group's first member only)."""
    paths = state_paths(program)
    pieces = []
    for key, value in state.items():
        piece = artifacts.state_piece(key)
        if piece is None:
            if key in paths:
                pieces.append(Piece.whole(paths[key], value))
        elif not piece.is_replica:
            pieces.append(Piece(paths[piece.key], piece.size, piece.offsets, value))
        elif piece.is_first_holder:
            pieces.append(Piece.whole(paths[piece.key], value))
    return pieces


def row_pieces(program: Program, shards: Sequence[ShardSnapshot | LiveSnapshot]
               ) -> list[Piece]:
    """A server's rows of the cached tables, in hash order, with their ids;
    of a dynamic table, its live set whole, under its own paths."""
    paths = state_paths(program)
    pieces = []
    for shard in shards:
        if isinstance(shard, LiveSnapshot):
            pieces += [Piece.whole(live_path(shard.table, shard.server, name), tensor)
                       for name, tensor in shard.tensors.items()]
            continue
        pieces.append(Piece(ids_path(shard.table), (shard.num_rows,), (shard.first_row,),
                            shard.ids))
        for key, rows in shard.tensors.items():
            pieces.append(Piece(row_paths(shard.table, paths[key]),
                                (shard.num_rows, *rows.shape[1:]),
                                (shard.first_row,) + (0,) * (len(rows.shape) - 1), rows))
    return pieces
