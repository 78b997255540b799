"""Sharded checkpoints: a `torch.distributed.checkpoint` (DCP) directory in
which every process writes what it owns; nothing is gathered anywhere.

    DIR/__w0_0.distcp        worker 0's pieces (what only it holds), step, param groups
    DIR/__s1_0.distcp        server 1's parameters and optimizer state
    DIR/__s1-rows_0.distcp   server 1's rows of the cached tables
    DIR/.metadata            DCP's metadata, written once, by worker 0, last but one
    DIR/checksums.sha256     sha256 of every file above (`sha256sum -c` format), last

The logical content is today's plain checkpoint (`checkpoint.to_checkpoint`):
`model.<key>` tensors, `optimizer.state.<i>.<name>` tensors, `optimizer.param_groups`,
`step` and `splitrun` as DCP byte items, nested by DCP's `planner_data`. A
tensor several processes hold a part of (parallel mode's shards) is one DCP
tensor with one chunk per part.

Cached tables are row-sharded by a hash (`embedding/sharding.py`): server k
holds a contiguous range of the table *in hash order*. So they are stored in
hash order under `hashed_rows.<table>...`, each server one chunk, next to the
ids in that order (`hashed_rows.<table>.ids`). A resumed server with any
number of servers reads exactly its own contiguous range back (DCP's chunk
resharding); `export_checkpoint` puts the rows back in id order.

No process group is needed: each process runs a DCP `FileSystemWriter` on its
own items (files prefixed with its label) and reports what it wrote (offsets,
lengths, sha256) as JSON; worker 0 writes the one `.metadata` from every
report (`FileSystemWriter.finish`). Across machines each process writes on its
own machine; gather the files into one directory before a resume or export.

DCP does not checksum data, so reads verify the sha256 of `.metadata` and of
every file they read; `CheckpointError` names the file and what is wrong.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.filesystem import (
    FileSystemReader,
    FileSystemWriter,
    _StorageInfo,  # DCP's own record of where an item lies; .metadata holds these
)
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.storage import WriteResult

from splitrun.splitter.graph_splitter import SplitProgram
from splitrun.splitter.labels import Label, Role
from splitrun.splitter.modes import ModeArtifacts
from splitrun.splitter.parallel.layout import ParallelLayout, split_member_key
from splitrun.splitter.program import InputKind, Program

from . import checkpoint
from .embedding.attach import cached_tables_of
from .embedding.sharding import RowSharding
from .embedding.store import ShardSnapshot
from .errors import CheckpointError

__all__ = ["Piece", "CHECKSUMS", "METADATA", "is_directory_path", "state_paths",
           "fqn_of", "row_paths", "ids_path", "write_pieces", "finish_checkpoint",
           "ShardedCheckpoint", "export_checkpoint", "RowRange", "load_state",
           "driver_objects", "start_checkpoint", "owned_pieces", "row_pieces", "load_for"]

CHECKSUMS = "checksums.sha256"
METADATA = ".metadata"
ROWS = "hashed_rows"
_FORMAT = "splitrun-dcp-1"
_CHUNK = 1 << 20

Path = tuple  # a key path in the nested checkpoint: ("model", "l1.weight")


def is_directory_path(path: str | os.PathLike) -> bool:
    """Where `save(path)` writes a sharded directory: an existing directory, or
    any path not ending in .pt/.pth (those stay one plain file)."""
    text = os.fspath(path)
    return os.path.isdir(text) or not text.endswith((".pt", ".pth"))


def fqn_of(path: Path) -> str:
    return ".".join(str(part) for part in path)


def state_paths(program: Program) -> dict[str, Path]:
    """Where each state key of the captured program sits in the checkpoint,
    as `checkpoint.to_checkpoint` lays it out."""
    paths: dict[str, Path] = {}
    for spec in program.inputs:
        if spec.kind in (InputKind.PARAM, InputKind.BUFFER):
            paths[spec.key] = ("model", spec.key)
    for key in program.cached_tables:
        paths.setdefault(key, ("model", key))
    index = 0
    for group in program.param_groups:
        for name in group.params:
            for state_name in group.state_names:
                paths[f"{name}.{state_name}"] = ("optimizer", "state", index, state_name)
            index += 1
    return paths


def step_paths(program: Program) -> list[Path]:
    """The optimizer's per-parameter step counts (groups that count steps)."""
    found, index = [], 0
    for group in program.param_groups:
        for _ in group.params:
            if group.has_step_count:
                found.append(("optimizer", "state", index, "step"))
            index += 1
    return found


def row_paths(table: str, path: Path) -> Path:
    """Where a row-sharded tensor (a cached table or its row state) is kept, in hash order."""
    return (ROWS, table, *path)


def ids_path(table: str) -> Path:
    return (ROWS, table, "ids")


@dataclass(frozen=True)
class Piece:
    """A part of one checkpoint tensor a process holds: `tensor` sits at
    `offsets` in a tensor of shape `size`."""

    path: Path
    size: tuple[int, ...]
    offsets: tuple[int, ...]
    tensor: torch.Tensor

    @classmethod
    def whole(cls, path: Path, tensor: torch.Tensor) -> Piece:
        return cls(path, tuple(tensor.shape), (0,) * tensor.dim(), tensor)


# -- writing --

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
        return self._data[write_item.index]


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as data:
        for chunk in iter(lambda: data.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"a report names dtype {name!r}, which is not a torch dtype")
    return dtype


def write_pieces(directory: str | os.PathLike, name: str, pieces: Sequence[Piece],
                 objects: Mapping[Path, object] | None = None) -> bytes:
    """Write this process's pieces (and plain `objects`, as DCP byte items)
    into `directory` as DCP data files prefixed `__{name}_`. Returns the JSON
    report `finish_checkpoint` builds the metadata from."""
    directory = os.fspath(directory)
    items, data, described = [], {}, []
    for piece in pieces:
        tensor = piece.tensor.detach().cpu().contiguous()
        index = MetadataIndex(fqn_of(piece.path), piece.offsets)
        items.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(torch.Size(piece.offsets), tensor.shape),
            properties=TensorProperties(dtype=tensor.dtype), size=torch.Size(piece.size))))
        data[index] = tensor
        described.append({"path": list(piece.path), "dtype": _dtype_name(tensor.dtype),
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
    writer = FileSystemWriter(directory, single_file_per_rank=True, thread_count=1)
    # Without collectives the writer prefixes its files with `rank`: our name.
    writer.set_up_storage_writer(False, rank=name, use_collectives=False)
    plan = writer.prepare_local_plan(SavePlan(items))
    results: list[WriteResult] = writer.write_data(plan, _Resolver(data)).wait()
    where = {(r.index.fqn, tuple(r.index.offset or ())): r.storage_data for r in results}
    for entry in described:
        info = where[(fqn_of(tuple(entry["path"])), tuple(entry.get("offsets", ())))]
        entry.update(file=info.relative_path, offset=info.offset, length=info.length)
    files = sorted({entry["file"] for entry in described})
    report = {"name": name, "items": described,
              "files": {f: _sha256(os.path.join(directory, f)) for f in files}}
    return json.dumps(report).encode()


def _parse_report(raw: bytes, source: str) -> dict:
    try:
        report = json.loads(raw)
        for entry in report["items"]:
            entry["path"] = tuple(entry["path"])
        return report
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"the save report of {source} is malformed ({exc})") from None


def finish_checkpoint(directory: str | os.PathLike, reports: Mapping[str, bytes]) -> None:
    """Worker 0, once every process reported: write `.metadata` (DCP's) and
    then the checksum file, whose presence marks the checkpoint complete."""
    directory = os.fspath(directory)
    tensors: dict[str, TensorStorageMetadata] = {}
    state_md: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    planner_data: dict[str, Path] = {}
    results: list[list[WriteResult]] = []
    sums: dict[str, str] = {}
    for source, raw in reports.items():
        report = _parse_report(raw, source)
        sums.update(report["files"])
        written = []
        for entry in report["items"]:
            fqn = fqn_of(entry["path"])
            planner_data[fqn] = entry["path"]
            storage = _StorageInfo(entry["file"], entry["offset"], entry["length"])
            if "size" not in entry:
                state_md[fqn] = BytesStorageMetadata()
                written.append(WriteResult(MetadataIndex(fqn), entry["length"], storage))
                continue
            md = tensors.get(fqn)
            if md is None:
                md = tensors[fqn] = TensorStorageMetadata(
                    TensorProperties(dtype=_dtype(entry["dtype"])), torch.Size(entry["size"]), [])
                state_md[fqn] = md
            md.chunks.append(ChunkStorageMetadata(torch.Size(entry["offsets"]),
                                                  torch.Size(entry["sizes"])))
            written.append(WriteResult(MetadataIndex(fqn, entry["offsets"]), entry["length"],
                                       storage))
        results.append(written)
    for fqn, md in tensors.items():
        covered = sum(_numel(c.sizes) for c in md.chunks)
        if covered != _numel(md.size):
            raise CheckpointError(
                f"checkpoint {directory}: the pieces of {fqn!r} cover {covered} of its "
                f"{_numel(md.size)} elements; a process did not write its part")
    writer = FileSystemWriter(directory, single_file_per_rank=True)
    writer.set_up_storage_writer(True)
    writer.finish(Metadata(state_md, planner_data=planner_data), results)
    sums[METADATA] = _sha256(os.path.join(directory, METADATA))
    partial = os.path.join(directory, f"{CHECKSUMS}.partial")
    with open(partial, "w") as out:
        out.writelines(f"{digest}  {name}\n" for name, digest in sorted(sums.items()))
    os.replace(partial, os.path.join(directory, CHECKSUMS))


def start_checkpoint(directory: str | os.PathLike) -> None:
    """Worker 0, before anyone writes: a directory that held a checkpoint loses
    its checksum file first, so a save cut short is never taken for complete."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    try:
        os.remove(os.path.join(directory, CHECKSUMS))
    except FileNotFoundError:
        pass


def _numel(size: Iterable[int]) -> int:
    total = 1
    for n in size:
        total *= n
    return total


# -- reading --

class _Receiver(LoadPlanner):
    """Copies what DCP's reader reads into our own target tensors."""

    def __init__(self, targets: dict[MetadataIndex, torch.Tensor]) -> None:
        self._targets = targets
        self.objects: dict[str, object] = {}

    def set_up_planner(self, *args, **kwargs) -> None:
        pass

    def create_local_plan(self) -> LoadPlan:
        raise NotImplementedError

    def create_global_plan(self, global_plan):
        raise NotImplementedError

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        # weights_only: plain containers of numbers and strings, nothing to execute.
        self.objects[read_item.dest_index.fqn] = torch.load(value, weights_only=True)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        index = read_item.dest_index
        target = self._targets[MetadataIndex(index.fqn, index.offset)]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            target = target.narrow(dim, start, length)
        return target

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


class ShardedCheckpoint:
    """A checkpoint directory opened for reading: `.metadata` verified and
    loaded; `read` verifies each data file before its first read."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = os.fspath(directory)
        self._where = f"checkpoint {self.directory}"
        if not os.path.isdir(self.directory):
            raise CheckpointError(f"{self._where} is not a directory")
        self._sums = self._read_sums()
        self._verify(METADATA)
        reader = FileSystemReader(self.directory)
        try:
            self.metadata: Metadata = reader.read_metadata()
        except Exception as exc:  # noqa: BLE001 - any unreadable metadata is one error line
            raise CheckpointError(f"{self._where}: {METADATA} cannot be loaded "
                                  f"({type(exc).__name__}: {str(exc)[:200]})") from None
        reader.set_up_storage_reader(self.metadata, True)
        self._reader = reader
        self._verified = {METADATA}
        self.paths: dict[str, Path] = {fqn: tuple(path) for fqn, path
                                       in (self.metadata.planner_data or {}).items()}
        self.info = self.read_objects([("splitrun",)])["splitrun"]
        if not isinstance(self.info, Mapping) or self.info.get("format") != _FORMAT:
            raise CheckpointError(f"{self._where} is a DCP checkpoint but not one splitrun "
                                  f"wrote (its 'splitrun' item is not {_FORMAT})")

    def _read_sums(self) -> dict[str, str]:
        path = os.path.join(self.directory, CHECKSUMS)
        try:
            with open(path) as lines:
                pairs = [line.split() for line in lines if line.strip()]
        except OSError:
            raise CheckpointError(
                f"{self._where} has no {CHECKSUMS}: the save did not complete (worker 0 "
                f"writes it last), or this is not a splitrun checkpoint") from None
        if not pairs or any(len(p) != 2 for p in pairs):
            raise CheckpointError(f"{self._where}: {CHECKSUMS} is malformed")
        return {name: digest.lower() for digest, name in pairs}

    def _verify(self, name: str) -> None:
        path = os.path.join(self.directory, name)
        if name not in self._sums:
            raise CheckpointError(f"{self._where}: {name} is not listed in {CHECKSUMS}")
        if not os.path.exists(path):
            raise CheckpointError(
                f"{self._where}: {name} is missing (written by another process; gather "
                f"every process's files into this directory before resuming)")
        actual = _sha256(path)
        if actual != self._sums[name]:
            raise CheckpointError(
                f"{self._where}: {name} is corrupt: its sha256 is {actual[:16]}..., "
                f"{CHECKSUMS} says {self._sums[name][:16]}...; the file changed after it "
                f"was written")

    def tensor_md(self, path: Path) -> TensorStorageMetadata | None:
        md = self.metadata.state_dict_metadata.get(fqn_of(path))
        return md if isinstance(md, TensorStorageMetadata) else None

    def _run(self, items: list[ReadItem], receiver: _Receiver) -> None:
        for item in items:
            name = self.metadata.storage_data[item.storage_index].relative_path
            if name not in self._verified:
                self._verify(name)
                self._verified.add(name)
        try:
            self._reader.read_data(LoadPlan(items), receiver).wait()
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 - one error line naming the checkpoint
            raise CheckpointError(f"{self._where} cannot be read ({type(exc).__name__}: "
                                  f"{str(exc)[:200]})") from None

    def read_objects(self, paths: Sequence[Path]) -> dict[str, object]:
        items = []
        for path in paths:
            fqn = fqn_of(path)
            if not isinstance(self.metadata.state_dict_metadata.get(fqn), BytesStorageMetadata):
                raise CheckpointError(f"{self._where} lacks the item {fqn!r}")
            index = MetadataIndex(fqn)
            items.append(ReadItem(LoadItemType.BYTE_IO, index, torch.Size((0,)), index,
                                  torch.Size((0,)), torch.Size((0,))))
        receiver = _Receiver({})
        self._run(items, receiver)
        return {fqn_of(path): receiver.objects[fqn_of(path)] for path in paths}

    def read(self, requests: Sequence[tuple[Path, tuple[int, ...], tuple[int, ...]]]
             ) -> list[torch.Tensor]:
        """The region (offsets, sizes) of each requested tensor, in order; the
        checkpoint's chunks may cut it any way."""
        targets, items, out = {}, [], []
        for path, offsets, sizes in requests:
            fqn = fqn_of(path)
            md = self.tensor_md(path)
            if md is None:
                raise CheckpointError(f"{self._where} lacks {fqn!r}; was it saved from this "
                                      f"model?")
            target = torch.empty(sizes, dtype=md.properties.dtype)
            chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
            found = create_read_items_for_chunk_list(fqn, md, [chunk])
            covered = sum(_numel(item.lengths) for item in found)
            if covered != target.numel():
                raise CheckpointError(f"{self._where}: the chunks of {fqn!r} cover {covered} "
                                      f"of the {target.numel()} elements asked for")
            targets[MetadataIndex(fqn, offsets)] = target
            items += found
            out.append(target)
        self._run(items, _Receiver(targets))
        return out

    def read_whole(self, path: Path) -> torch.Tensor:
        md = self.tensor_md(path)
        if md is None:
            raise CheckpointError(f"{self._where} lacks {fqn_of(path)!r}; was it saved from "
                                  f"this model?")
        return self.read([(path, (0,) * len(md.size), tuple(md.size))])[0]

    def verify_all(self) -> None:
        for name in self._sums:
            if name not in self._verified:
                self._verify(name)
                self._verified.add(name)

    def row_tables(self) -> dict[str, list[Path]]:
        """Per row-sharded table, the paths (in the plain checkpoint) of the
        tensors kept in hash order under it."""
        tables: dict[str, list[Path]] = {}
        for path in self.paths.values():
            if path[0] == ROWS and len(path) > 2 and path[2:] != ("ids",):
                tables.setdefault(path[1], []).append(path[2:])
        return tables


def _set(root: dict, path: Path, value) -> None:
    node = root
    for part in path[:-1]:
        node = node.setdefault(part, {})
    node[path[-1]] = value


def export_checkpoint(directory: str | os.PathLike, out: str | os.PathLike) -> dict:
    """Read a sharded checkpoint whole (every file verified) and write it as
    one plain checkpoint file (`torch.load` + `load_state_dict`; with its
    sha256 sidecar, so `resume=` takes it too). Returns what was written."""
    opened = ShardedCheckpoint(directory)
    opened.verify_all()
    result: dict = {}
    objects = [path for fqn, path in opened.paths.items()
               if isinstance(opened.metadata.state_dict_metadata.get(fqn), BytesStorageMetadata)]
    for fqn, value in opened.read_objects(objects).items():
        _set(result, opened.paths[fqn], value)
    for path in opened.paths.values():
        if path[0] != ROWS and opened.tensor_md(path) is not None:
            _set(result, path, opened.read_whole(path))
    for table, paths in opened.row_tables().items():
        ids = opened.read_whole(ids_path(table))
        for path in paths:
            hashed = opened.read_whole(row_paths(table, path))
            plain = torch.empty_like(hashed)
            plain[ids] = hashed
            _set(result, path, plain)
    result.get("splitrun", {}).pop("format", None)
    checkpoint.write_checkpoint(result, out)
    return result


def check_against(opened: ShardedCheckpoint, path: Path, key: str,
                  expected: torch.Tensor) -> None:
    """The checkpoint's tensor at `path` has the model's dtype and shape."""
    md = opened.tensor_md(path)
    if md is None:
        raise CheckpointError(f"checkpoint {opened.directory} lacks {key!r} (at "
                              f"{fqn_of(path)!r}); was it saved from this model?")
    if md.properties.dtype != expected.dtype or tuple(md.size) != tuple(expected.shape):
        saved = f"{_dtype_name(md.properties.dtype)}{list(md.size)}"
        model = f"{_dtype_name(expected.dtype)}{list(expected.shape)}"
        raise CheckpointError(f"checkpoint {opened.directory}: {key!r} is {saved}, the model "
                              f"has {model}; was it saved from this model (and dtype)?")


def check_finite(opened: ShardedCheckpoint, key: str, value: torch.Tensor) -> torch.Tensor:
    return checkpoint.refuse_non_finite(value, key, f"checkpoint {opened.directory}")


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
               ("splitrun",): {**info, "format": _FORMAT}}
    counts = [Piece.whole(path, torch.tensor(float(step))) for path in step_paths(program)]
    return objects, counts



# -- resuming one process --

def _read_key(opened: ShardedCheckpoint, key: str, path: Path, expected: torch.Tensor
              ) -> torch.Tensor:
    """A state tensor whole: stored plainly, or row-sharded in hash order
    (saved in embedding-cache mode, resumed in another)."""
    if opened.tensor_md(path) is None:
        for table, paths in opened.row_tables().items():
            if path in paths:
                check_against(opened, row_paths(table, path), key, expected)
                hashed = opened.read_whole(row_paths(table, path))
                plain = torch.empty_like(hashed)
                plain[opened.read_whole(ids_path(table))] = hashed
                return check_finite(opened, key, plain)
    check_against(opened, path, key, expected)
    return check_finite(opened, key, opened.read_whole(path))


def read_step(opened: ShardedCheckpoint) -> int:
    step = opened.read_objects([("step",)])["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"checkpoint {opened.directory}: step is {step!r}, expected a "
                              f"whole number >= 0")
    return step


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
    each table in `row_ranges` only those rows. Reads nothing else; returns
    (state, step)."""
    opened = ShardedCheckpoint(directory)
    step = read_step(opened)
    paths = state_paths(program)
    initial = program.initial_state
    state = dict(initial)
    regions = regions or {}
    for key in sorted(set(keys)):
        if key not in paths:
            continue
        if key in regions and opened.tensor_md(paths[key]) is not None:
            check_against(opened, paths[key], key, initial[key])
            offsets, sizes = regions[key]
            value = check_finite(opened, key, opened.read([(paths[key], offsets, sizes)])[0])
            full = initial[key].clone()
            _region(full, offsets, sizes).copy_(value)
            state[key] = full
        else:
            state[key] = _read_key(opened, key, paths[key], initial[key])
    for rows in row_ranges:
        if opened.tensor_md(ids_path(rows.table)) is None:  # saved in another mode: plain
            for key in rows.keys:
                state[key] = _read_key(opened, key, paths[key], initial[key])
            continue
        requests = [(ids_path(rows.table), (rows.first,), (rows.end - rows.first,))]
        for key in rows.keys:
            expected = initial[key]
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
            full = initial[key].clone()
            full[rows.ids] = check_finite(opened, key, value)
            state[key] = full
    return state, step


# -- what each process writes and reads --

def _member_region(layout: ParallelLayout, base: str, member: Label
                   ) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Where `member`'s piece of the sharded tensor `base` lies (offsets,
    sizes); None for a replica."""
    placement, holders = layout.state[base], layout.members_of(base)
    size = tuple(layout.state_shapes[base])
    if not placement.is_shard:
        return None
    index = holders.index(member)
    cut = torch.empty(size, device="meta").chunk(len(holders), placement.dim)
    offsets = [0] * len(size)
    offsets[placement.dim] = sum(c.shape[placement.dim] for c in cut[:index])
    return tuple(offsets), tuple(cut[index].shape)


def owned_pieces(program: Program, artifacts: ModeArtifacts | None,
                 state: Mapping[str, torch.Tensor]) -> list[Piece]:
    """The pieces of the state a process owns (`state`, keyed like its split
    program): whole tensors, or in parallel mode its piece of each sharded
    tensor (a replica is written by its group's first member only)."""
    paths = state_paths(program)
    pieces = []
    for key, value in state.items():
        member = split_member_key(key) if isinstance(artifacts, ParallelLayout) else None
        if member is None:
            if key in paths:
                pieces.append(Piece.whole(paths[key], value))
            continue
        base, label = member
        region = _member_region(artifacts, base, label)
        if region is not None:
            size = tuple(artifacts.state_shapes[base])
            pieces.append(Piece(paths[base], size, region[0], value))
        elif artifacts.members_of(base).index(label) == 0:
            pieces.append(Piece.whole(paths[base], value))
    return pieces


def row_pieces(program: Program, shards: Sequence[ShardSnapshot]) -> list[Piece]:
    """A server's rows of the cached tables, in hash order, with their ids."""
    paths = state_paths(program)
    pieces = []
    for shard in shards:
        pieces.append(Piece(ids_path(shard.table), (shard.num_rows,), (shard.first_row,),
                            shard.ids))
        for key, rows in shard.tensors.items():
            pieces.append(Piece(row_paths(shard.table, paths[key]),
                                (shard.num_rows, *rows.shape[1:]),
                                (shard.first_row,) + (0,) * (rows.dim() - 1), rows))
    return pieces


def load_for(program: Program, split: SplitProgram, label: Label,
             directory: str | os.PathLike) -> tuple[dict[str, torch.Tensor], int]:
    """`label`'s part of a sharded checkpoint: the state it owns (in parallel
    mode just its piece of each sharded tensor), and on a server of an
    embedding-cache split its rows of every table."""
    keys, regions = [], {}
    layout = split.artifacts if isinstance(split.artifacts, ParallelLayout) else None
    for key in split.plan.process(label).state:
        member = split_member_key(key) if layout is not None else None
        if member is None:
            keys.append(key)
            continue
        keys.append(member[0])
        region = _member_region(layout, *member)
        if region is not None:
            regions[member[0]] = region
    ranges = []
    cache = cached_tables_of(split)
    if cache is not None and label.role is Role.SERVER:
        for table in cache.tables:
            sharding = RowSharding(table.num_rows, split.plan.cluster.num_servers)
            ranges.append(RowRange(
                table.key, (table.key, *(f"{table.key}.{n}" for n in table.state_names)),
                sharding.bounds[label.rank], sharding.bounds[label.rank + 1],
                sharding.ids_of(label.rank)))
    return load_state(program, directory, keys, ranges, regions)
