"""What the kernel says of a process's memory: its RSS and peak (VmRSS, VmHWM in
/proc/PID/status), its memory cgroup (v1's memory hierarchy, else v2's unified
one), that cgroup's limit, peak and OOM-kill count. Read by the launcher's
failure line (`launcher/memory_watch.py`) and by every process's heartbeat
(the scheduler names a process that went silent near its memory cap)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from functools import cache

from ..errors import MemoryCapError

__all__ = ["cgroup_bytes", "events_file", "mib", "memory_cgroup_of", "oom_kills",
           "own_memory", "own_memory_limit", "process_memory_kb", "refuse_beyond_memory_cap",
           "VMSTAT"]

VMSTAT = "/proc/vmstat"
# A v1 limit this large means none (the kernel's "unlimited" rounds to a page).
_NO_LIMIT = 1 << 60


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


def events_file(cgroup: str) -> str:
    v2 = os.path.join(cgroup, "memory.events")
    return v2 if os.path.exists(v2) else os.path.join(cgroup, "memory.oom_control")


def oom_kills(path: str) -> int | None:
    try:
        with open(path) as lines:
            for line in lines:
                name, _, value = line.partition(" ")
                if name == "oom_kill":
                    return int(value)
    except (OSError, ValueError):
        pass
    return None


def cgroup_bytes(cgroup: str, *names: str) -> int | None:
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


def process_memory_kb(pid: int) -> dict[str, int]:
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


def mib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 20):.1f} MiB"


def own_memory() -> tuple[int, int, int]:
    """This process's (RSS, peak RSS, its memory cgroup's limit), in bytes; 0
    for what cannot be read, and a limit of 0 for none."""
    status = process_memory_kb(os.getpid())
    return (status.get("VmRSS", 0) << 10, status.get("VmHWM", 0) << 10,
            own_memory_limit() or 0)


def own_memory_limit() -> int | None:
    """This process's memory cgroup's limit in bytes; None for none."""
    cgroup = memory_cgroup_of(os.getpid())
    return None if cgroup is None else cgroup_bytes(cgroup, "memory.max",
                                                    "memory.limit_in_bytes")


def refuse_beyond_memory_cap(needed: Mapping[str, int], who: str, what: str, fix: str,
                             limit: int | None = None) -> None:
    """Raise `MemoryCapError` when the bytes of `needed` (name -> bytes this
    process is about to hold) alone pass its memory cap (`limit`, else its
    memory cgroup's): it could only be OOM-killed on the way, without words."""
    limit = own_memory_limit() if limit is None else limit
    total = sum(needed.values())
    if not limit or total <= limit:
        return
    largest = sorted(needed.items(), key=lambda item: -item[1])[:3]
    names = ", ".join(f"{name!r} {mib(size)}" for name, size in largest)
    raise MemoryCapError(
        f"{who} {what} need {mib(total)} ({len(needed)} tensors; the largest {names}) but its "
        f"memory cgroup's limit is {mib(limit)}: it cannot hold them; {fix}")
