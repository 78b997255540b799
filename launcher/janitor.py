"""Remove a job's shared-memory files when its launcher dies without doing so.

The launcher's children die with it (PR_SET_PDEATHSIG, SIGKILL): after a
SIGKILLed launcher, nobody of the job is left to remove what it put under
/dev/shm. So the supervisor starts one small process beside the children:

    python -m splitrun.launcher.janitor

which reads lines from its stdin, a pipe only the launcher holds:

    prefix /dev/shm splitrun-0123456789abcdef-
    pid 4242
    done

At end of file (the launcher closed the pipe, or died, any way) it waits until
every pid it was given is gone (bounded by `WAIT_FOR_PIDS_S`), so that no
process of the job creates a file after it looked, then removes every file
under each directory whose name starts with a prefix it was given, and exits.
It says so on stderr only when the launcher did not write `done` first (a
launcher that saw its job end removes the job's files itself: the step
files it kept until then are no leak to report).
Only the standard library and the job files' module (which needs no torch)
are imported: it starts in milliseconds and costs no torch import beside the
job's processes. It ignores SIGINT and SIGHUP (a Ctrl-C
at the terminal reaches the whole process group; the launcher handles it and
closes the pipe).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import subprocess
import sys
import time

from splitrun.runtime.transport.shm.job_files import JOB_PREFIX_PATTERN, remove_job_segments

__all__ = ["Janitor", "main"]

logger = logging.getLogger(__name__)

# Bounds the wait for the job's processes to be gone after the launcher is
# (they die with it, within milliseconds; the bound covers a loaded machine).
WAIT_FOR_PIDS_S = 30.0
# How often the janitor looks whether those processes are gone.
_POLL_S = 0.02
# Bounds the launcher's wait for the janitor to finish after closing its pipe.
CLOSE_TIMEOUT_S = WAIT_FOR_PIDS_S + 5.0


class Janitor:
    """The launcher's handle on the janitor process: `watch()` each child's
    prefix and pid as it starts, `close()` once the children are gone."""

    def __init__(self) -> None:
        self._process: subprocess.Popen | None = None
        self._prefixes: set[tuple[str, str]] = set()

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def watch(self, directory: str, prefix: str, pid: int) -> None:
        """Remove `directory`/`prefix`* once the launcher is gone and so is `pid`."""
        if not JOB_PREFIX_PATTERN.match(prefix):
            raise ValueError(f"shared-memory prefix {prefix!r} is not a job prefix "
                             f"('splitrun-<hex>-'); the janitor removes files by no other")
        if self._process is not None and self._process.stdin.closed:
            raise ValueError("the janitor was closed; a new job needs a new one")
        if self._process is None:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "splitrun.launcher.janitor"], stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL, close_fds=True)
            logger.info("janitor (pid %d) removes the job's shared-memory files if this "
                        "launcher dies", self._process.pid)
        lines = []
        if (directory, prefix) not in self._prefixes:
            self._prefixes.add((directory, prefix))
            lines.append(f"prefix {directory} {prefix}\n")
        lines.append(f"pid {pid}\n")
        try:
            self._process.stdin.write("".join(lines).encode())
            self._process.stdin.flush()
        except OSError as exc:  # it died: the launcher's own removal still runs
            logger.warning("the shared-memory janitor is gone (%s); files of a killed "
                           "launcher may stay under %s", exc, directory)

    def close(self, wait: bool = True) -> None:
        """Close the pipe: the janitor removes the files once the children are
        gone, and exits; with `wait` (the job ended and this launcher lives on
        to remove its files too), quietly, and this waits for that (bounded)."""
        process = self._process
        if process is None or process.stdin.closed:
            return
        with contextlib.suppress(OSError):  # it died: nothing to tell it
            if wait:
                process.stdin.write(b"done\n")
        with contextlib.suppress(OSError):
            process.stdin.close()
        if wait:
            self.wait(CLOSE_TIMEOUT_S)

    def wait(self, timeout_s: float) -> None:
        """Wait until the janitor exited (after `close`); kill it past `timeout_s`."""
        process = self._process
        if process is None:
            return
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("the shared-memory janitor (pid %d) did not exit within %g s; "
                           "killing it", process.pid, timeout_s)
            process.kill()
            process.wait(timeout=5.0)


def _alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def main() -> int:
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    prefixes: list[tuple[str, str]] = []
    pids: list[int] = []
    launcher_done = False
    for line in sys.stdin.buffer:  # until end of file: the launcher is done or gone
        words = line.decode(errors="replace").split()
        if len(words) == 3 and words[0] == "prefix":
            prefixes.append((words[1], words[2]))
        elif len(words) == 2 and words[0] == "pid" and words[1].isdigit():
            pids.append(int(words[1]))
        elif words == ["done"]:
            launcher_done = True
    deadline = time.monotonic() + WAIT_FOR_PIDS_S
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    for directory, prefix in prefixes:
        if not JOB_PREFIX_PATTERN.match(prefix):
            continue  # Janitor.watch sends none such; no file is removed by another
        removed = remove_job_segments(prefix, directory)
        if removed and not launcher_done:
            sys.stderr.write(f"[splitrun] janitor removed {len(removed)} shared-memory files "
                             f"of job {prefix} left under {directory}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
