"""Completing a sharded checkpoint: worker 0 clears the directory's checksum
file before anyone writes, and once every process reported what it wrote,
writes DCP's `.metadata` and then `checksums.sha256`, whose presence marks
the checkpoint complete."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import torch
from torch.distributed.checkpoint.filesystem import (
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
from torch.distributed.checkpoint.storage import WriteResult

from ...errors import CheckpointError
from ..plain import file_sha256, writing
from .layout import CHECKSUMS, METADATA, Path, dcp_path, fqn_of, numel

__all__ = ["start_checkpoint", "finish_checkpoint"]


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"a report names dtype {name!r}, which is not a torch dtype")
    return dtype


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
            planner_data[fqn] = dcp_path(entry["path"])
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
        covered = sum(numel(c.sizes) for c in md.chunks)
        if covered != numel(md.size):
            raise CheckpointError(
                f"checkpoint {directory}: the pieces of {fqn!r} cover {covered} of its "
                f"{numel(md.size)} elements; a process did not write its part")
    with writing(f"checkpoint {directory}"):
        writer = FileSystemWriter(directory, single_file_per_rank=True)
        writer.set_up_storage_writer(True)
        writer.finish(Metadata(state_md, planner_data=planner_data), results)
        sums[METADATA] = file_sha256(os.path.join(directory, METADATA))
        partial = os.path.join(directory, f"{CHECKSUMS}.partial")
        with open(partial, "w") as out:
            out.writelines(f"{digest}  {name}\n" for name, digest in sorted(sums.items()))
        os.replace(partial, os.path.join(directory, CHECKSUMS))


def start_checkpoint(directory: str | os.PathLike) -> None:
    """Worker 0, before anyone writes: a directory that held a checkpoint loses
    its checksum file first, so a save cut short is never taken for complete."""
    directory = os.fspath(directory)
    with writing(f"checkpoint {directory}"):
        os.makedirs(directory, exist_ok=True)
        try:
            os.remove(os.path.join(directory, CHECKSUMS))
        except FileNotFoundError:
            pass
