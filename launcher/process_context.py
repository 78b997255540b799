"""What a process hands the processes it forks beyond its environment: its
namespaces, cgroup, resource limits, CPU affinity, nice value and umask. A
standing template reports its own (standing_template.py), and a launcher
forks from it only where they match its own (standing_client.py)."""

from __future__ import annotations

import os
import resource

__all__ = ["process_context", "context_difference", "umask"]

_NAMESPACES = ("cgroup", "ipc", "mnt", "net", "pid", "time", "user", "uts")


def process_context() -> dict[str, object]:
    """What a process passes to the processes it forks beyond its environment
    and working directory (the umask aside: it comes with each request)."""
    context: dict[str, object] = {}
    for name in _NAMESPACES:
        try:
            context[f"{name} namespace"] = os.stat(f"/proc/self/ns/{name}").st_ino
        except OSError:
            pass  # a kernel without it
    with open("/proc/self/cgroup") as cgroup:
        context["cgroup"] = cgroup.read()
    context["resource limits"] = {name: list(resource.getrlimit(getattr(resource, name)))
                                  for name in sorted(dir(resource))
                                  if name.startswith("RLIMIT_")}
    context["CPU affinity"] = sorted(os.sched_getaffinity(0))
    context["nice value"] = os.getpriority(os.PRIO_PROCESS, 0)
    return context


def context_difference(ours: dict[str, object], theirs: dict[str, object]) -> list[str]:
    """What differs between two `process_context()`s, by name."""
    return sorted(name for name in ours.keys() | theirs.keys()
                  if ours.get(name) != theirs.get(name))


def umask() -> int:
    """This process's umask, read without setting it (os.umask would, for
    every thread)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    return 0o022
