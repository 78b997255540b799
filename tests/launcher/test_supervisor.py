"""The launcher's failure line, from real child processes that print what a
job's processes print and exit as they do: the first failure is named in its
own words, and nothing is said of processes that were not running."""

from __future__ import annotations

import io
import os
import re
import sys
import threading
import time

import pytest

from splitrun.launcher.bootstrap import ERROR_MARK
from splitrun.launcher.memory_watch import memory_cgroup_of
from splitrun.launcher.supervisor import Supervisor
from splitrun.splitter.labels import Label


def child(supervisor: Supervisor, label: Label, line: str, code: int, sleep_s: float = 0.0):
    """A process that prints `line`, sleeps, and exits with `code`."""
    program = (f"import sys, time; print({line!r}, flush=True); time.sleep({sleep_s}); "
               f"sys.exit({code})")
    return supervisor.spawn(label, [sys.executable, "-c", program], {})


def test_a_receive_timeout_is_not_blamed_over_the_stall_the_scheduler_names():
    # Worker 0's receive timed out on worker 1, which the scheduler knows stalled.
    out = io.StringIO()
    supervisor = Supervisor(out=out)
    child(supervisor, Label.worker(0), f"{ERROR_MARK}RecvTimeout: [worker 0] receive on "
          f"channel 'w1->w0#0' step 5: no message from worker 1 within 8 s", 1)
    child(supervisor, Label.worker(1), "spinning", 0, sleep_s=60)
    stall = ("w1", "worker 1 (pid 7 on vm) is stalled at step 5: alive, but its step has not "
                   "advanced for 8.1 s while worker 0 has waited on it for 8.0 s")
    outcome = supervisor.run(external_failure=lambda: stall)
    assert outcome.summary.startswith("job failed: worker 1 (pid 7 on vm) is stalled at step 5")


def test_nothing_is_said_of_processes_that_had_already_ended():
    out = io.StringIO()
    supervisor = Supervisor(out=out)
    child(supervisor, Label.worker(1), "done", 0)
    child(supervisor, Label.worker(0), f"{ERROR_MARK}ValueError: boom", 1, sleep_s=0.5)
    outcome = supervisor.run()
    assert outcome.summary.startswith("worker 0 (pid "), outcome.summary
    assert outcome.summary.endswith("exited with code 1: ValueError: boom"), outcome.summary


def test_one_other_process_stopped_is_one_process():
    out = io.StringIO()
    supervisor = Supervisor(out=out)
    child(supervisor, Label.worker(0), f"{ERROR_MARK}ValueError: boom", 1)
    child(supervisor, Label.worker(1), "training", 0, sleep_s=60)
    outcome = supervisor.run()
    assert outcome.summary.endswith("ValueError: boom; stopped the other 1 process"), \
        outcome.summary


def test_the_schedulers_report_of_a_process_with_its_own_error_uses_its_words():
    # The scheduler's report (from the process's own ReportFailure) and the
    # process's exit both name worker 1: its exit says it with pid and code.
    out = io.StringIO()
    supervisor = Supervisor(out=out)
    child(supervisor, Label.worker(1), f"{ERROR_MARK}ValueError: boom", 1, sleep_s=0.3)
    child(supervisor, Label.worker(0), "training", 0, sleep_s=60)
    report = ("w1", "worker 1 failed at step 3: ValueError: boom")
    outcome = supervisor.run(external_failure=lambda: report, step_of=lambda label: 3)
    assert outcome.summary.startswith("worker 1 (pid "), outcome.summary
    assert "at step 3: ValueError: boom; stopped the other 1 process" in outcome.summary


def test_a_process_that_ended_because_of_the_failure_is_one_it_stopped():
    # Worker 1 exits at once with the peer's failure (PeerFailed), before the
    # supervisor judges: the failure stopped it all the same.
    out = io.StringIO()
    supervisor = Supervisor(out=out)
    child(supervisor, Label.worker(0), f"{ERROR_MARK}ValueError: boom", 1)
    child(supervisor, Label.worker(1), f"{ERROR_MARK}PeerFailed: job failed: worker 0 failed",
          1, sleep_s=0.2)
    outcome = supervisor.run()
    assert outcome.summary.endswith("ValueError: boom; stopped the other 1 process"), \
        outcome.summary


@pytest.fixture
def memory_cgroup():
    """A memory cgroup of 64 MiB under this process's own, removed after the
    test (root and a writable cgroup hierarchy, v1 or v2, else skipped)."""
    own = memory_cgroup_of(os.getpid())
    if own is None or not os.access(own, os.W_OK):
        pytest.skip(f"no writable memory cgroup here ({own or 'none found'}); run as root on "
                    f"a machine whose cgroup hierarchy is writable")
    path = os.path.join(own, f"splitrun-test-{os.getpid()}")
    try:
        os.mkdir(path)
        for name in ("memory.max", "memory.limit_in_bytes"):
            if os.path.exists(os.path.join(path, name)):
                with open(os.path.join(path, name), "w") as limit:
                    limit.write(str(64 << 20))
                break
        else:
            raise OSError("no memory limit file")
    except OSError as exc:
        if os.path.isdir(path):
            os.rmdir(path)
        pytest.skip(f"cannot make a memory cgroup under {own}: {exc}")
    yield path
    os.rmdir(path)


def test_a_process_its_memory_cgroup_kills_is_named_as_out_of_memory(memory_cgroup, tmp_path):
    # The child joins the cgroup, waits until the supervisor has seen it there
    # (a dead process's cgroup cannot be read), then allocates past 64 MiB.
    go, procs = tmp_path / "go", os.path.join(memory_cgroup, "cgroup.procs")
    program = (f"import os, sys, time\n"
               f"open({procs!r}, 'w').write(str(os.getpid()))\n"
               f"deadline = time.monotonic() + 60\n"
               f"while not os.path.exists({str(go)!r}) and time.monotonic() < deadline:\n"
               f"    time.sleep(0.01)\n"
               f"blocks = []\n"
               f"while True:\n"
               f"    blocks.append(bytearray(4 << 20))\n")
    supervisor = Supervisor(out=io.StringIO())
    worker = supervisor.spawn(Label.worker(0), [sys.executable, "-c", program], {})
    child(supervisor, Label.worker(1), "training", 0, sleep_s=60)
    outcomes = []
    runner = threading.Thread(target=lambda: outcomes.append(supervisor.run()), daemon=True)
    runner.start()
    deadline = time.monotonic() + 60
    while worker.memory.cgroup != memory_cgroup and time.monotonic() < deadline:
        time.sleep(0.01)
    assert worker.memory.cgroup == memory_cgroup
    go.touch()
    runner.join(60)
    assert outcomes, "the supervisor did not return"
    summary = outcomes[0].summary
    assert re.match(rf"worker 0 \(pid {worker.pid}\) was killed by SIGKILL: out of memory: its "
                    rf"memory cgroup {re.escape(memory_cgroup)} \(limit 64\.0 MiB, peak use "
                    rf"\d+\.\d MiB\) counted an OOM kill \(oom_kill 0 -> 1\); last seen using "
                    rf"\d+\.\d MiB \(peak \d+\.\d MiB\) \d+\.\d s before; stopped the other 1 "
                    rf"process$", summary), \
        summary
