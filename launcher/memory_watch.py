"""What the kernel says of a process's memory, for the launcher's failure
line: its RSS and peak (VmRSS, VmHWM in /proc/PID/status), sampled while it
runs, and, when it is killed by SIGKILL, whether the OOM killer did it: its
memory cgroup's oom_kill count (cgroup v2 `memory.events`, v1
`memory.oom_control`) rose since the process was first seen in it, or else
the machine's (`/proc/vmstat`).

A dead process's cgroup can no longer be read (the kernel detaches it), so
the cgroup is looked up while the process runs (`sample`)."""

from __future__ import annotations

import time

from splitrun.runtime.cluster.process_memory import (
    VMSTAT,
    cgroup_bytes,
    events_file,
    memory_cgroup_of,
    mib,
    oom_kills,
    process_memory_kb,
)

__all__ = ["MemoryWatch", "memory_cgroup_of", "SAMPLE_PERIOD_S"]

# How often a running process's memory is looked at (a few small /proc reads).
SAMPLE_PERIOD_S = 0.25
# The kernel counts an OOM kill on the machine, then in the victim's cgroup,
# both after the SIGKILL is sent: a verdict made between the two counts waits
# up to this long for the cgroup's.
CGROUP_COUNT_WAIT_S = 0.2
CGROUP_COUNT_POLL_S = 0.005


class MemoryWatch:
    """One process's memory as the launcher last saw it."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.cgroup: str | None = None       # its memory cgroup's directory
        self._cgroup_kills: int | None = None  # that cgroup's oom_kill when first seen
        self._machine_kills = oom_kills(VMSTAT)
        self.rss_kb: int | None = None
        self.peak_kb: int | None = None
        self.sampled_at: float | None = None
        self._next_at = 0.0

    def sample(self, now: float) -> None:
        """Look at the running process, at most every SAMPLE_PERIOD_S."""
        if now < self._next_at:
            return
        self._next_at = now + SAMPLE_PERIOD_S
        status = process_memory_kb(self.pid)
        if "VmRSS" in status:
            self.rss_kb, self.peak_kb, self.sampled_at = (
                status["VmRSS"], status.get("VmHWM", status["VmRSS"]), now)
        cgroup = memory_cgroup_of(self.pid)
        if cgroup is not None and cgroup != self.cgroup:
            self.cgroup, self._cgroup_kills = cgroup, oom_kills(events_file(cgroup))

    def oom_verdict(self) -> str | None:
        """After a SIGKILL: that it ran out of memory, where the kernel says
        so, with its last RSS; None where the kernel counted no OOM kill."""
        said = None
        machine_now = oom_kills(VMSTAT)
        machine_counted = (machine_now is not None and self._machine_kills is not None
                           and machine_now > self._machine_kills)
        if self.cgroup is not None and self._cgroup_kills is not None:
            now = oom_kills(events_file(self.cgroup))
            deadline = time.monotonic() + CGROUP_COUNT_WAIT_S
            while (machine_counted and now is not None and now <= self._cgroup_kills
                   and time.monotonic() < deadline):
                time.sleep(CGROUP_COUNT_POLL_S)
                now = oom_kills(events_file(self.cgroup))
            if now is not None and now > self._cgroup_kills:
                sizes = [f"{what} {mib(size)}" for what, size in
                         (("limit", cgroup_bytes(self.cgroup, "memory.max",
                                                "memory.limit_in_bytes")),
                          ("peak use", cgroup_bytes(self.cgroup, "memory.peak",
                                                   "memory.max_usage_in_bytes")))
                         if size is not None]
                detail = f" ({', '.join(sizes)})" if sizes else ""
                said = (f"out of memory: its memory cgroup {self.cgroup}{detail} counted an OOM "
                        f"kill (oom_kill {self._cgroup_kills} -> {now})")
        if said is None and machine_counted:
            said = (f"out of memory, it seems: the kernel's OOM killer ran meanwhile "
                    f"({VMSTAT} oom_kill {self._machine_kills} -> {machine_now})")
        if said is None:
            return None
        if self.rss_kb is not None and self.sampled_at is not None:
            said += (f"; last seen using {mib(self.rss_kb << 10)} (peak "
                     f"{mib(self.peak_kb << 10)}) {time.monotonic() - self.sampled_at:.1f} s "
                     f"before")
        return said
