"""The GLIBC_TUNABLES a launched process starts with so that the C library
streams large copies into and out of shared-memory rings past the caches
(`ring_segment.copy_bytes`). Only the standard library: the launcher, which
imports neither torch nor numpy, sets it where it starts a process."""

from __future__ import annotations

__all__ = ["NON_TEMPORAL_THRESHOLD_BYTES", "NON_TEMPORAL_TUNABLE", "glibc_tunables_for_copies"]

# glibc's memmove writes a copy of at least this many bytes with
# non-temporal stores (around the caches, without first reading each
# destination line in): a message's copy into or out of a ring is read by
# another process, later, not by this core. glibc's own threshold is 3/4 of
# the shared cache per thread, which a VM that reports its host's cache
# (300 MiB) puts above any message. Measured on the PS benchmark (27 MB
# messages, 2-core VM): a copy into a ring 4.3 ms -> 2.3 ms alone; in the
# job, its sends ~25-30 % less CPU.
NON_TEMPORAL_THRESHOLD_BYTES = 4 << 20
NON_TEMPORAL_TUNABLE = "glibc.cpu.x86_non_temporal_threshold"


def glibc_tunables_for_copies(current: str | None) -> str:
    """GLIBC_TUNABLES for a process started with `current` (None: unset):
    `NON_TEMPORAL_THRESHOLD_BYTES` added, unless the user set that tunable.
    Read by glibc at the process's start only; other C libraries and
    machines ignore it."""
    if current and NON_TEMPORAL_TUNABLE in current:
        return current
    ours = f"{NON_TEMPORAL_TUNABLE}={NON_TEMPORAL_THRESHOLD_BYTES:#x}"
    return f"{current}:{ours}" if current else ours
