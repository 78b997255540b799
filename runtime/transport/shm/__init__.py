"""Shared memory between processes of one host: a byte ring per direction of
each same-host peer pair (`ring` and its parts), the files of a job under
/dev/shm (`job_files`), and the `ShmTransport` that moves messages through
the rings (`transport`)."""

from __future__ import annotations

from splitrun.splitter.lazy_exports import lazy_exports

# Imported when first used: the launcher needs only `job_files`, not torch
# behind the rings.
_EXPORTS = {
    "ShmSettings": ".transport",
    "ShmTransport": ".transport",
    "RingReader": ".ring",
    "RingSettings": ".ring",
    "RingWriter": ".ring",
    "SHM_DIR": ".job_files",
    "new_job_prefix": ".job_files",
    "remove_job_segments": ".job_files",
}

__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
