"""Helpers for tests that start real processes: every wait is bounded, and
every process a test starts is ended by the test, by its id. Tests use them through
the `local_cluster` fixture (conftest.py)."""

from __future__ import annotations

import os
import pathlib
import queue
import re
import select
import signal
import subprocess
import sys
import threading
import time

SUPPORT = pathlib.Path(__file__).resolve().parent
REPO = SUPPORT.parents[1]
SCRIPTS = SUPPORT / "scripts"
# The tests' helper modules (tests/support/), the scripts they launch and the
# examples' shared models: importable in pytest through `pythonpath` in setup.cfg's
# [tool:pytest], and in the processes the tests start through PYTHONPATH (set by
# `child_env`).
IMPORT_PATH = (SUPPORT, SCRIPTS, REPO / "examples")
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


def child_env(env_extra=None) -> dict[str, str]:
    """This process's environment, with IMPORT_PATH in front of PYTHONPATH,
    without pytest's name of the running test (it would differ between the
    standing template, conftest.py's, and every launch it serves)."""
    env = dict(os.environ)
    env.pop("PYTEST_CURRENT_TEST", None)
    paths = [str(path) for path in IMPORT_PATH]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(env_extra or {})
    return env


def splitrun(*args, env_extra=None, cwd=REPO, verbose: bool = True) -> Proc:
    """`splitrun ARGS...` as a subprocess. In tests, start it through LocalCluster,
    which ends it when the test does. `verbose`: with -v, so the lifecycle lines
    tests wait on (`started worker 1 (pid N)`, a process's transport) are shown."""
    options = ["-v"] if verbose else []
    return Proc([sys.executable, "-m", "splitrun.launcher", *options, *args],
                env=child_env(env_extra), cwd=cwd)


class StandingTemplateProc:
    """A standing template (launcher/standing_template.py) serving the launches
    of this test process: started with the environment they have (`child_env`),
    listening on `socket` once its constructor returns; it dies with this
    process, and `close()` ends it (and what it still runs) by its process group."""

    VARIABLE = "SPLITRUN_TEMPLATE"  # standing_client.SOCKET_VARIABLE

    def __init__(self, folder: pathlib.Path) -> None:
        self.socket = str(folder / "template.sock")
        self.proc = Proc([sys.executable, "-m", "splitrun.launcher.standing_template",
                          "--serve", self.socket, "--parent-pid", os.getpid()],
                         env=child_env(), cwd=folder)
        self.pid = int(self.proc.wait_for(r"standing template serving .* \(pid (\d+)\)$",
                                          60).group(1))

    def close(self) -> None:
        self.proc.kill()


class LocalCluster:
    """The `splitrun` processes one test starts (launch, scheduler, join, plan). Each
    wait has a deadline; `close()` kills every process still running, by its process
    group id (each Proc starts a session of its own)."""

    def __init__(self, cwd: pathlib.Path = REPO) -> None:
        self.cwd = cwd
        self.procs: list[Proc] = []

    def start(self, *args, env_extra=None, verbose: bool = True) -> Proc:
        proc = splitrun(*args, env_extra=env_extra, cwd=self.cwd, verbose=verbose)
        self.procs.append(proc)
        return proc

    def launch(self, script, *args, workers: int, servers: int = 0) -> Proc:
        """`splitrun launch` of `script` on this machine; returns at once."""
        return self.start("launch", "--workers", workers, "--servers", servers, script, *args)

    def run(self, script, *args, workers: int, servers: int = 0,
            timeout_s: float = JOB_TIMEOUT_S) -> Proc:
        """Launch `script` and wait for it to succeed (exit code 0)."""
        proc = self.launch(script, *args, workers=workers, servers=servers)
        code = proc.wait(timeout_s)
        assert code == 0, f"{' '.join(proc.argv)} exited with {code}; output:\n{proc.output()}"
        return proc

    def scheduler(self, workers: int, servers: int = 0) -> tuple[Proc, str, str]:
        """A standalone scheduler: the process, its address and the file (mode
        0600) it wrote the job's token to."""
        token_file = str(pathlib.Path(self.cwd) / f"job{len(self.procs)}.token")
        proc = self.start("scheduler", "--workers", workers, "--servers", servers,
                          "--token-file", token_file)
        address = proc.wait_for(r"scheduler at (\S+);", 60).group(1)
        return proc, address, token_file

    def join(self, address: str, token_file: str, script, *args, role: str = "worker",
             rank: int | None = None) -> Proc:
        """One process joining the scheduler at `address` with the token in `token_file`."""
        options = ["--scheduler", address, "--token-file", token_file, "--role", role]
        if rank is not None:
            options += ["--rank", rank]
        return self.start("join", *options, script, *args)

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()


# Lines a successful job never prints: a traceback (ours, or a thread's, which
# Python prints as "Exception in thread"), and gRPC's complaint about a channel
# closed under its connectivity poller.
UNCLEAN_OUTPUT = ("Traceback", "Exception in thread", "Channel closed")


def assert_clean_output(proc: Proc) -> None:
    """`proc` (a job that succeeded) printed no traceback and no gRPC thread error."""
    found = [marker for marker in UNCLEAN_OUTPUT if marker in proc.output()]
    assert not found, f"{found} in the output of a successful job:\n{proc.output()}"


def wait_exited(pids, timeout_s: float) -> list[int]:
    """The pids still running `timeout_s` from now. Waits on each process's pidfd,
    which becomes readable when the process exits (also one we did not start),
    so nothing is polled."""
    deadline = time.monotonic() + timeout_s
    running = []
    for pid in pids:
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            ready, _, _ = select.select([pidfd], [], [], max(deadline - time.monotonic(), 0))
            if not ready:
                running.append(pid)
        finally:
            os.close(pidfd)
    return running


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
