"""`splitrun export`: a sharded checkpoint read whole and written as one
plain checkpoint file, the tables back in id order."""

from __future__ import annotations

import os

from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from .. import plain
from .layout import ROWS, Path, ids_path
from .read import ShardedCheckpoint

__all__ = ["export_checkpoint"]


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
            _set(result, path, opened.read_in_id_order(table, path, ids))
    result.get("splitrun", {}).pop("format", None)
    # An optimizer without per-parameter state (plain SGD) wrote no entry;
    # torch's `load_state_dict` still wants its "state".
    result.setdefault("optimizer", {}).setdefault("state", {})
    plain.write_checkpoint(result, out)
    return result
