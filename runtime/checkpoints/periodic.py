"""The periodic checkpoints of `splitrun launch --checkpoint-every K`, which a
restart (`--max-restarts N`) resumes from: every K steps the job saves into
DIR/step-<N>/, a sharded directory (`sharded/`) in which every
process writes what it owns, so nothing is gathered on worker 0 and each
process of the restarted job reads back only its own part.

A directory is complete once worker 0 wrote its `checksums.sha256` (last),
and good if every file it lists still has its sha256; a restart resumes from
the newest complete, good one, skipping any newer one a failure cut short.
Worker 0 keeps the newest few."""

from __future__ import annotations

import logging
import os
import shutil

from ..errors import CheckpointError
from .checksums import CHECKSUMS, verify_all

__all__ = ["periodic_path", "latest_checkpoint", "prune_periodic"]

logger = logging.getLogger(__name__)

_PREFIX = "step-"
_KEEP = 2


def periodic_path(directory: str | os.PathLike, step: int) -> str:
    """The directory the periodic checkpoint of `step` is saved into."""
    return os.path.join(os.fspath(directory), f"{_PREFIX}{step:09d}")


def _periodic(directory: str) -> list[tuple[int, str]]:
    """(step, path) of the periodic checkpoints in `directory`, newest first."""
    found = []
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    for name in names:
        number = name.removeprefix(_PREFIX)
        path = os.path.join(directory, name)
        if name.startswith(_PREFIX) and number.isdigit() and os.path.isdir(path):
            found.append((int(number), path))
    return sorted(found, reverse=True)


def latest_checkpoint(directory: str | os.PathLike) -> tuple[str, int] | None:
    """The newest periodic checkpoint in `directory` that is complete and
    whose every file matches its checksum, and its step; None when there is
    none. Checksums only (no torch): the launcher asks before a restart."""
    for step, path in _periodic(os.fspath(directory)):
        try:
            verify_all(path)
        except CheckpointError as exc:
            logger.warning("not resuming from %s: %s", path, exc)
            continue
        return path, step
    return None


def prune_periodic(directory: str | os.PathLike) -> None:
    """Worker 0, after a save: keep the newest periodic checkpoints that
    completed (and any newer one a failure cut short), remove the older ones."""
    found = _periodic(os.fspath(directory))
    complete = [index for index, (_, path) in enumerate(found)
                if os.path.exists(os.path.join(path, CHECKSUMS))]
    if len(complete) < _KEEP:
        return
    for _, path in found[complete[_KEEP - 1] + 1:]:
        shutil.rmtree(path, ignore_errors=True)
