"""Whether a start of a job has room for its shared-memory rings. Every two
processes on this host share one ring each way, allocated whole when they
connect (64 MiB each unless SPLITRUN_SHM_RING_MB says), so a /dev/shm that
another program filled fails every start at once: a restart into it would
spend itself. The launcher asks before each start (`shortfall`); with the
default transport the start then uses gRPC between its processes, saying so
and what to free; under SPLITRUN_TRANSPORT=shm it does not start."""

from __future__ import annotations

import os
from collections.abc import Mapping

from splitrun.runtime.cluster.env import ENV
from splitrun.runtime.transport.shm.job_files import DEFAULT_RING_BYTES, SHM_DIR, rings_bytes

__all__ = ["shortfall", "uses_rings"]

# The transports that use no rings (SPLITRUN_TRANSPORT; the processes check the value).
_WITHOUT_RINGS = ("grpc", "tcp")
# How many of the directory's largest files the line names.
_LARGEST = 3


def uses_rings(environ: Mapping[str, str]) -> bool:
    return (environ.get(ENV.TRANSPORT) or "auto").strip().lower() not in _WITHOUT_RINGS


def shortfall(num_processes: int, environ: Mapping[str, str] = os.environ,
              directory: str = SHM_DIR) -> str | None:
    """Why `directory` has no room for the rings of `num_processes` processes
    sharing memory (what they need, what is free, the largest files there),
    or None when they fit or use none."""
    if num_processes < 2 or not uses_rings(environ):
        return None
    ring_mb = environ.get(ENV.SHM_RING_MB, "").strip()
    ring_bytes = int(ring_mb) << 20 if ring_mb.isdigit() and int(ring_mb) >= 1 \
        else DEFAULT_RING_BYTES
    needed = rings_bytes(num_processes, ring_bytes)
    try:
        stats = os.statvfs(directory)
    except OSError:
        return None  # no such directory: the processes say what they find
    free = stats.f_bavail * stats.f_frsize
    if free >= needed:
        return None
    rings = num_processes * (num_processes - 1)
    return (f"{directory} has {_mib(free)} free but the job's {rings} shared-memory rings "
            f"need {_mib(needed)} ({rings} of {_mib(ring_bytes)}); free {_mib(needed - free)} "
            f"there{_largest(directory)}, or make the rings smaller ({ENV.SHM_RING_MB}=N)")


def _largest(directory: str) -> str:
    sizes = []
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                try:
                    if entry.is_file(follow_symlinks=False):
                        sizes.append((entry.stat(follow_symlinks=False).st_blocks * 512,
                                      entry.path))
                except OSError:
                    continue
    except OSError:
        return ""
    largest = sorted(sizes, reverse=True)[:_LARGEST]
    if not largest:
        return ""
    return " (its largest files: " + ", ".join(f"{path} {_mib(size)}"
                                               for size, path in largest) + ")"


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 20):.1f} MiB"
