"""How the launcher and the standing template signal a launched process
(launcher/process_groups.py, `signal_with_group`): the process and the
process group it leads. A process forked a moment before leads no group yet
(it calls setsid first thing): signalling only its group, as both did, left
it running (seen once in a suite run: a worker forked by the standing
template outlived its SIGKILLed launcher, test_faults_e2e.py)."""

from __future__ import annotations

import contextlib
import os
import select
import signal

from cluster import wait_exited

from splitrun.launcher.process_groups import signal_with_group

# Bounds each forked stand-in: it waits this long at most for the test to release it.
LIFETIME_S = 30


@contextlib.contextmanager
def release_pipe():
    """A pipe the stand-ins wait on: closing the test's end (on the way out,
    passed or failed) releases every stand-in still running."""
    read_end, write_end = os.pipe()
    try:
        yield read_end, write_end
    finally:
        os.close(write_end)
        os.close(read_end)


def _fork(body, write_end: int) -> int:
    pid = os.fork()
    if pid == 0:  # the stand-in: only os calls, no lock the parent's threads hold
        try:
            os.close(write_end)  # so the test's close is the pipe's end
            body()
        finally:
            os._exit(0)
    return pid


def _wait_released(read_end: int) -> None:
    select.select([read_end], [], [], LIFETIME_S)


def _killed_by_sigkill(pid: int) -> bool:
    """Reaps `pid` (it has ended): True if SIGKILL ended it."""
    status = os.waitpid(pid, 0)[1]
    return os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


def test_a_process_that_leads_no_group_yet_is_killed():
    with release_pipe() as (read_end, write_end):
        pid = _fork(lambda: _wait_released(read_end), write_end)  # no setsid
        assert os.getpgid(pid) == os.getpgid(0) != pid
        signal_with_group(pid, signal.SIGKILL)
        assert not wait_exited([pid], 5.0), "the process outlived signal_with_group"
    assert _killed_by_sigkill(pid)


def test_the_group_a_process_leads_is_killed_with_it():
    """Its descendants (a data loader's workers) die too."""
    report_read, report_write = os.pipe()

    def leader():
        os.setsid()
        grandchild = os.fork()
        if grandchild == 0:
            _wait_released(read_end)
            os._exit(0)
        os.write(report_write, str(grandchild).encode())
        _wait_released(read_end)

    with release_pipe() as (read_end, write_end):
        pid = _fork(leader, write_end)
        os.close(report_write)
        try:
            ready, _, _ = select.select([report_read], [], [], 10.0)
            assert ready, "the leader did not report its child"
            grandchild = int(os.read(report_read, 32))
        finally:
            os.close(report_read)
        signal_with_group(pid, signal.SIGKILL)
        assert not wait_exited([pid, grandchild], 5.0), "a process of the group survived"
    assert _killed_by_sigkill(pid)
