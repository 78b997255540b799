"""Helpers for tests that start real processes: every wait is bounded, and
every process a test starts is ended by the test, by its id."""

from __future__ import annotations

import os
import pathlib
import queue
import re
import signal
import subprocess
import sys
import threading
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "scripts"
# Bounds a whole small job (start, a dozen steps, finish) on a loaded 2-core machine.
JOB_TIMEOUT_S = 180.0


class Proc:
    """A subprocess whose output lines are collected by a thread, so tests can
    wait for a line with a deadline instead of sleeping."""

    def __init__(self, argv, env=None, cwd=REPO):
        self.argv = [str(a) for a in argv]
        self.process = subprocess.Popen(
            self.argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True)
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for raw in iter(self.process.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            self.lines.append(line)
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match:
        """The first output line (seen so far or arriving) matching `pattern`."""
        regex = re.compile(pattern)
        for line in list(self.lines):
            match = regex.search(line)
            if match:
                return match
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no line matching {pattern!r} within {timeout_s} s; "
                                     f"output:\n{self.output()}")
            try:
                line = self._queue.get(timeout=remaining)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError(f"process exited before printing {pattern!r}; "
                                     f"output:\n{self.output()}")
            match = regex.search(line)
            if match:
                return match

    def wait(self, timeout_s: float = JOB_TIMEOUT_S) -> int:
        try:
            code = self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"{self.argv} did not finish within {timeout_s} s; "
                                 f"output:\n{self.output()}") from None
        self._reader.join(timeout=10)
        return code

    def output(self) -> str:
        return "\n".join(self.lines)

    def kill(self):
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait(timeout=10)


def splitrun(*args, env_extra=None) -> Proc:
    env = dict(os.environ)
    env.update(env_extra or {})
    return Proc([sys.executable, "-m", "splitrun.launcher", *args], env=env)


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
