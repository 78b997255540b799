"""A process's steps done, kept where its launcher reads them even after the
process is gone: an 8-byte counter in a shared-memory file the launcher named
(`SPLITRUN_STEP_FILE`).

The scheduler learns a process's step with its heartbeats, every half second;
a process SIGKILLed between two of them would be named at the step of the
last one (at step 0 for a fast job killed in its first second). The counter is
written every step, a store into shared memory, so the launcher names the
step the process had reached.
"""

from __future__ import annotations

import mmap
import os
import struct

__all__ = ["StepFile", "read_step"]

_FORMAT = "<q"
_SIZE = struct.calcsize(_FORMAT)
# Before the first step (setting up): no step to name.
_SETTING_UP = -1


class StepFile:
    """The writing end, in the process: `record(steps_done)` each step."""

    def __init__(self, path: str) -> None:
        self.path = path
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(descriptor, _SIZE)
            self._map = mmap.mmap(descriptor, _SIZE)
        finally:
            os.close(descriptor)
        self.record(_SETTING_UP)

    def record(self, steps_done: int) -> None:
        struct.pack_into(_FORMAT, self._map, 0, steps_done)

    def close(self) -> None:
        """The process leaves the job. The file stays, holding its last step:
        the script may still fail after it left (an error after
        `trainer.finish()`), and its launcher names that step; the launcher
        removes the file with the job's other files, as a killed process's."""
        self._map.close()


def read_step(path: str) -> int | None:
    """The steps done a process last recorded in `path`, or None (no file,
    or the process had not started its first step)."""
    try:
        with open(path, "rb") as data:
            raw = data.read(_SIZE)
    except OSError:
        return None
    if len(raw) != _SIZE:
        return None
    step = struct.unpack(_FORMAT, raw)[0]
    return None if step == _SETTING_UP else step
