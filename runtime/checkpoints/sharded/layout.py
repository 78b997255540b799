"""Where everything sits in a sharded checkpoint: the file names, each state
key's path in the nested checkpoint (and its DCP name), the row-sharded
tables' paths, and `Piece`, the part of one tensor a process holds."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from splitrun.splitter.program import Program

from ..checksums import CHECKSUMS

__all__ = ["CHECKSUMS", "METADATA", "ROWS", "FORMAT", "Path", "Piece", "is_directory_path",
           "fqn_of", "dcp_path", "plain_path", "state_paths", "step_paths", "row_paths",
           "ids_path", "live_path", "LIVE", "dtype_name", "numel"]

METADATA = ".metadata"
ROWS = "hashed_rows"
LIVE = "live_rows"  # the dynamic tables' live sets, one per server that wrote it
FORMAT = "splitrun-dcp-1"


Path = tuple  # a key path in the nested checkpoint: ("model", "l1.weight")


def is_directory_path(path: str | os.PathLike) -> bool:
    """Where `save(path)` writes a sharded directory: an existing directory, or
    any path not ending in .pt/.pth (those stay one plain file)."""
    text = os.fspath(path)
    return os.path.isdir(text) or not text.endswith((".pt", ".pth"))


def fqn_of(path: Path) -> str:
    return ".".join(str(part) for part in path)


def dcp_path(path: Path) -> Path:
    """`path` as DCP's `planner_data` keeps it: every part a string. DCP nests
    an integer part as a list index, and a list cannot have a gap: the state of
    parameter 1 without that of parameter 0 (kept with a cached table's rows,
    or never made by SGD) would stop `dcp_to_torch_save` ("Missing key ...
    optimizer.state.0"). As strings they nest as dictionary keys."""
    return tuple(str(part) for part in path)


def plain_path(path: Path) -> Path:
    """Back from `dcp_path`: the optimizer state's parameter index an integer
    again (where `torch.optim` keeps it). Paths written before `dcp_path` had
    integers already."""
    parts = list(path)
    for i in range(len(parts) - 2):
        index = parts[i + 2]
        if parts[i] == "optimizer" and parts[i + 1] == "state" and isinstance(index, str) \
                and index.isdigit():
            parts[i + 2] = int(index)
    return tuple(parts)


def state_paths(program: Program) -> dict[str, Path]:
    """Where each state key of the captured program sits in the checkpoint,
    as `checkpoint.to_checkpoint` lays it out."""
    paths: dict[str, Path] = {key: ("model", key) for key in program.checkpoint_keys()}
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


def live_path(table: str, server: int, name: str) -> Path:
    """Where server `server`'s live set of a dynamic table keeps `name` (its
    ids, rows, row state and policy columns: `DynamicRows.snapshot()`)."""
    return (LIVE, table, f"server{server}", name)


@dataclass(frozen=True)
class Piece:
    """A part of one checkpoint tensor a process holds: `tensor` sits at
    `offsets` in a tensor of shape `size` (or a server's `RowsToWrite`,
    made when written)."""

    path: Path
    size: tuple[int, ...]
    offsets: tuple[int, ...]
    tensor: torch.Tensor  # or RowsToWrite (write.py)

    @classmethod
    def whole(cls, path: Path, tensor: torch.Tensor) -> Piece:
        return cls(path, tuple(tensor.shape), (0,) * tensor.dim(), tensor)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def numel(size: Iterable[int]) -> int:
    total = 1
    for n in size:
        total *= n
    return total

