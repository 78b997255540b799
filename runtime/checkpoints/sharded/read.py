"""Reading a sharded checkpoint: `.metadata` and every data file verified
against `checksums.sha256` before use, any region of a tensor read whatever
chunks it was written in, and the checks of a tensor against the model."""

from __future__ import annotations

import io
import os
from collections.abc import Mapping, Sequence

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ...errors import CheckpointError
from ..checksums import read_sums, verify_file
from ..plain import refuse_non_finite
from .layout import (
    FORMAT,
    METADATA,
    ROWS,
    Path,
    dtype_name,
    fqn_of,
    ids_path,
    numel,
    plain_path,
    row_paths,
)

__all__ = ["ShardedCheckpoint", "check_against", "check_finite", "read_step"]


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
        self._sums = read_sums(self.directory)
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
        self.paths: dict[str, Path] = {fqn: plain_path(tuple(path)) for fqn, path
                                       in (self.metadata.planner_data or {}).items()}
        self.info = self.read_objects([("splitrun",)])["splitrun"]
        if not isinstance(self.info, Mapping) or self.info.get("format") != FORMAT:
            raise CheckpointError(f"{self._where} is a DCP checkpoint but not one splitrun "
                                  f"wrote (its 'splitrun' item is not {FORMAT})")

    def _verify(self, name: str) -> None:
        verify_file(self.directory, name, self._sums)

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
            covered = sum(numel(item.lengths) for item in found)
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

    def read_in_id_order(self, table: str, path: Path, ids: torch.Tensor | None = None
                         ) -> torch.Tensor:
        """The row-sharded tensor at `path` of `table`, whole, its rows back in
        id order; `ids`: the table's ids in hash order (read here if not given)."""
        hashed = self.read_whole(row_paths(table, path))
        plain = torch.empty_like(hashed)
        plain[self.read_whole(ids_path(table)) if ids is None else ids] = hashed
        return plain


def check_against(opened: ShardedCheckpoint, path: Path, key: str,
                  expected: torch.Tensor) -> None:
    """The checkpoint's tensor at `path` has the model's dtype and shape."""
    md = opened.tensor_md(path)
    if md is None:
        raise CheckpointError(f"checkpoint {opened.directory} lacks {key!r} (at "
                              f"{fqn_of(path)!r}); was it saved from this model?")
    if md.properties.dtype != expected.dtype or tuple(md.size) != tuple(expected.shape):
        saved = f"{dtype_name(md.properties.dtype)}{list(md.size)}"
        model = f"{dtype_name(expected.dtype)}{list(expected.shape)}"
        raise CheckpointError(f"checkpoint {opened.directory}: {key!r} is {saved}, the model "
                              f"has {model}; was it saved from this model (and dtype)?")


def check_finite(opened: ShardedCheckpoint, key: str, value: torch.Tensor) -> torch.Tensor:
    return refuse_non_finite(value, key, f"checkpoint {opened.directory}")


def read_step(opened: ShardedCheckpoint) -> int:
    step = opened.read_objects([("step",)])["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"checkpoint {opened.directory}: step is {step!r}, expected a "
                              f"whole number >= 0")
    return step
