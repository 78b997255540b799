"""How the launcher and the standing template signal a launched process
(launcher/process_groups.py, `signal_with_group`): the process and the
process group it leads. A process forked a moment before leads no group yet
(it calls setsid first thing): signalling only its group, as both did, left
it running (seen once in a suite run: a worker forked by the standing
template outlived its SIGKILLed launcher, test_faults_e2e.py)."""

from __future__ import annotations

import os
import select
import signal
import time

from cluster import wait_exited

from splitrun.launcher.process_groups import signal_with_group

# Bounds each forked stand-in: it exits by itself after this if nothing kills it.
LIFETIME_S = 30


def _fork(body) -> int:
    pid = os.fork()
    if pid == 0:  # the stand-in: only os calls, no lock the parent's threads hold
        try:
            body()
        finally:
            os._exit(0)
    return pid


def _killed_by_sigkill(pid: int) -> bool:
    """Reaps `pid` (it has ended): True if SIGKILL ended it."""
    status = os.waitpid(pid, 0)[1]
    return os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


def _end(pid: int) -> None:
    """Kill and reap a stand-in a failed test left running."""
    if wait_exited([pid], 0):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_a_process_that_leads_no_group_yet_is_killed():
    pid = _fork(lambda: time.sleep(LIFETIME_S))  # no setsid: in the test's group
    try:
        assert os.getpgid(pid) == os.getpgid(0) != pid
        signal_with_group(pid, signal.SIGKILL)
        assert not wait_exited([pid], 5.0), "the process outlived signal_with_group"
        assert _killed_by_sigkill(pid)
    finally:
        _end(pid)


def test_the_group_a_process_leads_is_killed_with_it():
    """Its descendants (a data loader's workers) die too."""
    read_end, write_end = os.pipe()

    def leader():
        os.setsid()
        grandchild = os.fork()
        if grandchild == 0:
            time.sleep(LIFETIME_S)
            os._exit(0)
        os.write(write_end, str(grandchild).encode())
        time.sleep(LIFETIME_S)

    pid = _fork(leader)
    os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], 10.0)
        assert ready, "the leader did not report its child"
        grandchild = int(os.read(read_end, 32))
        signal_with_group(pid, signal.SIGKILL)
        assert not wait_exited([pid, grandchild], 5.0), "a process of the group survived"
        assert _killed_by_sigkill(pid)
    finally:
        os.close(read_end)
        _end(pid)
        if pid_alive_in_group(pid):
            os.killpg(pid, signal.SIGKILL)


def pid_alive_in_group(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True
