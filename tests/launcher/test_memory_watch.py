"""The OOM verdict after a SIGKILL (launcher/memory_watch.py), on counters
written here: the kernel counts an OOM kill on the machine, then in the
victim's cgroup, both after the SIGKILL is sent, so a verdict made between
the two must wait for the cgroup's count rather than fall back to the
machine's (it did, once, in CI)."""

import threading

from splitrun.launcher import memory_watch
from splitrun.launcher.memory_watch import MemoryWatch


def _counters(tmp_path, monkeypatch, machine_kills: int):
    vmstat = tmp_path / "vmstat"
    vmstat.write_text(f"pgfault 7\noom_kill {machine_kills}\n")
    monkeypatch.setattr(memory_watch, "VMSTAT", str(vmstat))
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    (cgroup / "memory.events").write_text("oom 0\noom_kill 0\n")
    (cgroup / "memory.max").write_text(f"{64 << 20}\n")
    # The process, as `sample` sees it while it runs: in that cgroup.
    monkeypatch.setattr(memory_watch, "memory_cgroup_of", lambda pid: str(cgroup))
    monkeypatch.setattr(memory_watch, "process_memory_kb", lambda pid: {})
    watch = MemoryWatch(pid=1)
    watch.sample(0.0)
    assert watch.cgroup == str(cgroup)
    return watch, vmstat, cgroup


def test_a_cgroup_count_a_moment_behind_the_machines_still_names_the_cgroup(tmp_path,
                                                                           monkeypatch):
    watch, vmstat, cgroup = _counters(tmp_path, monkeypatch, machine_kills=10)
    vmstat.write_text("pgfault 7\noom_kill 11\n")  # the machine's count first
    later = threading.Timer(0.03, (cgroup / "memory.events").write_text,
                            ("oom 1\noom_kill 1\n",))
    later.start()
    try:
        said = watch.oom_verdict()
    finally:
        later.join()
    assert said.startswith(f"out of memory: its memory cgroup {cgroup} (limit 64.0 MiB) "
                           f"counted an OOM kill (oom_kill 0 -> 1)"), said


def test_a_kill_the_cgroup_never_counts_falls_back_to_the_machines_word(tmp_path,
                                                                        monkeypatch):
    watch, vmstat, _ = _counters(tmp_path, monkeypatch, machine_kills=10)
    vmstat.write_text("pgfault 7\noom_kill 11\n")
    assert watch.oom_verdict().startswith(
        "out of memory, it seems: the kernel's OOM killer ran meanwhile")


def test_no_oom_kill_counted_anywhere_is_no_verdict(tmp_path, monkeypatch):
    watch, _, _ = _counters(tmp_path, monkeypatch, machine_kills=10)
    assert watch.oom_verdict() is None
