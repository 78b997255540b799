"""The files of a job's shared-memory rings: one random prefix per job
(`splitrun-<hex>-`), a ring's segment and socket files under it, other files
of the job (a process's marker), and removing all of them once the job is
over (`remove_job_segments`); and this machine's boot id, which tells whether
two processes can share memory."""

from __future__ import annotations

import logging
import os
import re
import secrets

from .ring_errors import RingError

__all__ = ["SHM_DIR", "JOB_PREFIX_PATTERN", "STEP_FILE_SUFFIX", "HEADER_PAGE",
           "DEFAULT_RING_BYTES", "new_job_prefix", "ring_paths", "job_file_path",
           "rings_bytes", "remove_job_segments", "boot_id", "unlink_quietly"]

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
# The prefixes `new_job_prefix` makes; no file is created or removed by another
# (the launcher's janitor checks it too).
JOB_PREFIX_PATTERN = re.compile(r"^splitrun-[0-9a-f]{12,64}-$")
_NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.-]{1,100}$")
# A process's steps done, kept for its launcher (cluster/step_file.py): the
# launcher reads it after the process died, so only the launcher removes it.
STEP_FILE_SUFFIX = ".step"
# A ring's file: one page of header (`ring_segment`), then its data bytes,
# `DEFAULT_RING_BYTES` unless SPLITRUN_SHM_RING_MB says.
HEADER_PAGE = 4096
DEFAULT_RING_BYTES = 64 << 20


def new_job_prefix() -> str:
    """A fresh random prefix for one job's segments."""
    return f"splitrun-{secrets.token_hex(8)}-"


def _check_prefix(prefix: str) -> None:
    if not JOB_PREFIX_PATTERN.match(prefix):
        raise RingError(
            f"segment prefix {prefix!r} is not one of new_job_prefix()'s "
            f"('splitrun-<hex>-'); refusing to create or remove files by it")


def ring_paths(prefix: str, name: str, directory: str = SHM_DIR) -> tuple[str, str]:
    """The segment file and the socket file of ring `name` of the job `prefix`."""
    _check_prefix(prefix)
    if not _NAME_PATTERN.match(name):
        raise RingError(f"ring name {name!r}: use letters, digits, '_', '.', '-' (1-100)")
    base = os.path.join(directory, prefix + name)
    return base + ".ring", base + ".sock"


def job_file_path(prefix: str, name: str, suffix: str, directory: str = SHM_DIR) -> str:
    """Another file of the job `prefix` (e.g. a process's marker): removed with
    the job's segments by `remove_job_segments`."""
    _check_prefix(prefix)
    if not _NAME_PATTERN.match(name + suffix):
        raise RingError(f"file name {name + suffix!r}: use letters, digits, '_', '.', '-'")
    return os.path.join(directory, prefix + name + suffix)


def rings_bytes(num_processes: int, ring_bytes: int = DEFAULT_RING_BYTES) -> int:
    """What the rings of `num_processes` processes sharing memory take under
    SHM_DIR: one ring each way between every two of them, allocated whole when
    they connect."""
    return num_processes * (num_processes - 1) * (HEADER_PAGE + ring_bytes)


def remove_job_segments(prefix: str, directory: str = SHM_DIR,
                        keep_step_files: bool = False) -> list[str]:
    """Remove every file of the job `prefix` under `directory` (but the step
    files with `keep_step_files`: a process cleaning up after a failure leaves
    them to the launcher, which names a killed peer by its step file);
    returns their paths."""
    _check_prefix(prefix)
    removed = []
    try:
        entries = os.listdir(directory)
    except OSError as exc:  # gone, or not ours to read: nothing of the job to remove
        if not isinstance(exc, FileNotFoundError):
            logger.warning("cannot list %s to remove job %s's files: %s", directory, prefix,
                           exc.strerror)
        return removed
    for entry in sorted(entries):
        if entry.startswith(prefix) and not (keep_step_files
                                             and entry.endswith(STEP_FILE_SUFFIX)):
            path = os.path.join(directory, entry)
            try:
                os.unlink(path)
            except OSError as exc:  # removed meanwhile, or not ours: the others still go
                if not isinstance(exc, FileNotFoundError):
                    logger.warning("cannot remove %s: %s", path, exc.strerror)
                continue
            removed.append(path)
    if removed:
        logger.info("removed %d shared-memory files of job %s", len(removed), prefix)
    return removed


def boot_id() -> str:
    """This machine's boot id: two processes share memory only if theirs match."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
