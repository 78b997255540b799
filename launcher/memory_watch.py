"""What the kernel says of a process's memory, for the launcher's failure
line: its RSS and peak (VmRSS, VmHWM in /proc/PID/status), sampled while it
runs, and, when it is killed by SIGKILL, whether the OOM killer did it: its
memory cgroup's oom_kill count (cgroup v2 `memory.events`, v1
`memory.oom_control`) rose since the process was first seen in it, or else
the machine's (`/proc/vmstat`).

A dead process's cgroup can no longer be read (the kernel detaches it), so
the cgroup is looked up while the process runs (`sample`)."""

from __future__ import annotations

import os
import time
from functools import cache

__all__ = ["MemoryWatch", "memory_cgroup_of", "SAMPLE_PERIOD_S"]

# How often a running process's memory is looked at (a few small /proc reads).
SAMPLE_PERIOD_S = 0.25
_VMSTAT = "/proc/vmstat"
# A v1 limit this large means none (the kernel's "unlimited" rounds to a page).
_NO_LIMIT = 1 << 60


class MemoryWatch:
    """One process's memory as the launcher last saw it."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.cgroup: str | None = None       # its memory cgroup's directory
        self._cgroup_kills: int | None = None  # that cgroup's oom_kill when first seen
        self._machine_kills = _oom_kills(_VMSTAT)
        self.rss_kb: int | None = None
        self.peak_kb: int | None = None
        self.sampled_at: float | None = None
        self._next_at = 0.0

    def sample(self, now: float) -> None:
        """Look at the running process, at most every SAMPLE_PERIOD_S."""
        if now < self._next_at:
            return
        self._next_at = now + SAMPLE_PERIOD_S
        status = _status(self.pid)
        if "VmRSS" in status:
            self.rss_kb, self.peak_kb, self.sampled_at = (
                status["VmRSS"], status.get("VmHWM", status["VmRSS"]), now)
        cgroup = memory_cgroup_of(self.pid)
        if cgroup is not None and cgroup != self.cgroup:
            self.cgroup, self._cgroup_kills = cgroup, _oom_kills(_events_file(cgroup))

    def oom_verdict(self) -> str | None:
        """After a SIGKILL: that it ran out of memory, where the kernel says
        so, with its last RSS; None where the kernel counted no OOM kill."""
        said = None
        if self.cgroup is not None and self._cgroup_kills is not None:
            now = _oom_kills(_events_file(self.cgroup))
            if now is not None and now > self._cgroup_kills:
                sizes = [f"{what} {_mib(size)}" for what, size in
                         (("limit", _read_bytes(self.cgroup, "memory.max",
                                                "memory.limit_in_bytes")),
                          ("peak use", _read_bytes(self.cgroup, "memory.peak",
                                                   "memory.max_usage_in_bytes")))
                         if size is not None]
                detail = f" ({', '.join(sizes)})" if sizes else ""
                said = (f"out of memory: its memory cgroup {self.cgroup}{detail} counted an OOM "
                        f"kill (oom_kill {self._cgroup_kills} -> {now})")
        if said is None and self._machine_kills is not None:
            now = _oom_kills(_VMSTAT)
            if now is not None and now > self._machine_kills:
                said = (f"out of memory, it seems: the kernel's OOM killer ran meanwhile "
                        f"({_VMSTAT} oom_kill {self._machine_kills} -> {now})")
        if said is None:
            return None
        if self.rss_kb is not None and self.sampled_at is not None:
            said += (f"; last seen using {_mib(self.rss_kb << 10)} (peak "
                     f"{_mib(self.peak_kb << 10)}) {time.monotonic() - self.sampled_at:.1f} s "
                     f"before")
        return said


def memory_cgroup_of(pid: int) -> str | None:
    """The directory of `pid`'s memory cgroup (v1's memory hierarchy, else
    v2's unified one), or None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/cgroup") as lines:
            entries = [line.rstrip("\n").split(":", 2) for line in lines]
    except OSError:
        return None
    mounts = _cgroup_mounts()
    for _, controllers, path in entries:
        if "memory" in controllers.split(",") and "v1" in mounts:
            return _under(mounts["v1"], path)
    for hierarchy, controllers, path in entries:
        if hierarchy == "0" and not controllers and "v2" in mounts:
            return _under(mounts["v2"], path)
    return None


@cache
def _cgroup_mounts() -> dict[str, tuple[str, str]]:
    """(root, mount point) of v1's memory hierarchy and of v2's, as mounted here."""
    mounts: dict[str, tuple[str, str]] = {}
    try:
        with open("/proc/self/mountinfo") as lines:
            for line in lines:
                fields = line.split()
                if "-" not in fields:
                    continue
                dash = fields.index("-")
                fstype, options = fields[dash + 1], fields[dash + 3].split(",")
                if fstype == "cgroup" and "memory" in options:
                    mounts.setdefault("v1", (fields[3], fields[4]))
                elif fstype == "cgroup2":
                    mounts.setdefault("v2", (fields[3], fields[4]))
    except OSError:
        pass
    return mounts


def _under(mount: tuple[str, str], path: str) -> str:
    root, point = mount
    if root != "/" and path.startswith(root):
        path = path[len(root):]
    return os.path.join(point, path.lstrip("/"))


def _events_file(cgroup: str) -> str:
    v2 = os.path.join(cgroup, "memory.events")
    return v2 if os.path.exists(v2) else os.path.join(cgroup, "memory.oom_control")


def _oom_kills(path: str) -> int | None:
    try:
        with open(path) as lines:
            for line in lines:
                name, _, value = line.partition(" ")
                if name == "oom_kill":
                    return int(value)
    except (OSError, ValueError):
        pass
    return None


def _read_bytes(cgroup: str, *names: str) -> int | None:
    """The first of `names` (v2's, then v1's) in `cgroup`, in bytes; None for
    none, or no limit ("max", or v1's near 2**63)."""
    for name in names:
        try:
            with open(os.path.join(cgroup, name)) as data:
                text = data.read().strip()
        except OSError:
            continue
        return int(text) if text.isdigit() and int(text) < _NO_LIMIT else None
    return None


def _status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of `pid` in KiB (nothing for a zombie or a gone process)."""
    found = {}
    try:
        with open(f"/proc/{pid}/status") as lines:
            for line in lines:
                name, _, value = line.partition(":")
                if name in ("VmRSS", "VmHWM"):
                    found[name] = int(value.split()[0])
    except (OSError, ValueError, IndexError):
        pass
    return found


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 20):.1f} MiB"
