"""One process of a job inside a Ray actor: the actor starts the user's script
as a child process of its own, through the same bootstrap as the local
launcher, and hands the driver its output and its exit.

The class is plain Python; `ray_backend` wraps it with `ray.remote`, so this
module imports nothing from Ray. The child leads its own process group and
dies with the actor (the bootstrap's --parent-pid), so killing the actor
(`ray.kill`, a lost node) ends the script as well.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

# Only the standard library and the bootstrap: an actor starts in a Ray worker
# process, and importing torch there (splitrun.runtime, splitrun.splitter) would
# add seconds to every actor's start for nothing. The script imports it itself.
from . import bootstrap

__all__ = ["ProcessHost", "Placement", "Polled"]

# How many output lines one poll hands back at most.
_MAX_LINES_PER_POLL = 2000
_SHM_DIR = "/dev/shm"


@dataclass(frozen=True)
class Placement:
    """Where Ray put one process: for the driver's log and for tests."""

    pid: int               # the script's process
    actor_pid: int         # the Ray worker process holding the actor
    host: str              # the node's host name
    cuda_visible_devices: str | None  # as Ray set it for the actor (its GPUs)


@dataclass(frozen=True)
class Polled:
    lines: tuple[str, ...]
    exit_code: int | None  # None while the script runs; negative: killed by that signal
    is_stopped: bool       # stopped by a signal (SIGSTOP): it cannot make progress


class ProcessHost:
    """Runs one process of the job. A threaded actor (max_concurrency >= 2):
    `poll` blocks up to its wait while `stop` may come in meanwhile."""

    def __init__(self, label: str) -> None:
        self.label = label
        self._process: subprocess.Popen | None = None
        self._lines: list[str] = []
        self._cond = threading.Condition()
        self._eof = False
        self._exit_code: int | None = None
        self._shm_prefix: str | None = None

    def start(self, script: str, script_args: list[str], env_vars: dict[str, str],
              cwd: str | None) -> Placement:
        """Start the script with this actor's environment (Ray's
        CUDA_VISIBLE_DEVICES included) plus splitrun's variables."""
        env = dict(os.environ)
        env.update(env_vars)
        self._shm_prefix = env_vars.get("SPLITRUN_SHM_PREFIX") or None
        # The driver's working directory where this node has it (one machine, a
        # shared file system), else the actor's own (Ray's working_dir).
        workdir = cwd if cwd and os.path.isdir(cwd) else None
        argv = [sys.executable, "-m", bootstrap.__name__, "--parent-pid", str(os.getpid()),
                script, *script_args]
        self._process = subprocess.Popen(
            argv, env=env, cwd=workdir, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True)
        threading.Thread(target=self._read, daemon=True, name=f"read-{self.label}").start()
        return Placement(pid=self._process.pid, actor_pid=os.getpid(),
                         host=socket.gethostname(),
                         cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"))

    def _read(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        for raw in iter(self._process.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\r\n")
            with self._cond:
                self._lines.append(line.rsplit("\r", 1)[-1])  # progress bars
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def poll(self, wait_s: float) -> Polled:
        """The output lines since the last poll and, once the script exited and
        its output is read, its exit code. Waits up to `wait_s` for either."""
        deadline = time.monotonic() + wait_s
        with self._cond:
            while not self._lines and not self._eof:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            lines = tuple(self._lines[:_MAX_LINES_PER_POLL])
            del self._lines[:_MAX_LINES_PER_POLL]
            drained = self._eof and not self._lines
        code = self._code() if drained else None
        if code is None and drained:
            # Output closed (the script exited, or closed stdout): the exit follows.
            code = self._wait_code(1.0)
        return Polled(lines, code, code is None and self._is_stopped())

    def stop(self, grace_s: float, remove_shm: bool) -> int | None:
        """SIGTERM the script's process group (SIGKILL at once when it is
        stopped), SIGKILL what is left after `grace_s`, reap it, and with
        `remove_shm` remove the job's shared-memory files on this node (the
        driver removes those on its own node). Returns the exit code."""
        process = self._process
        if process is not None:
            if self._code() is None:
                self._signal(signal.SIGKILL if self._is_stopped() else signal.SIGTERM)
                self._wait_code(grace_s)
            self._signal(signal.SIGKILL)  # the group: grandchildren (data loaders) too
            try:
                process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        if (remove_shm and self._shm_prefix is not None
                and _has_files(_SHM_DIR, self._shm_prefix)):
            # What a killed process left on this node (job_files checks the
            # prefix). Imports torch, seconds on a busy machine: only then.
            from splitrun.runtime.transport.shm.job_files import remove_job_segments
            remove_job_segments(self._shm_prefix, _SHM_DIR)
        return None if process is None else process.returncode

    def _code(self) -> int | None:
        """The exit code once the script exited, without reaping it: it stays
        a zombie, so its pid (its process group's id) is not reused before
        the group is signalled."""
        if self._exit_code is not None or self._process is None:
            return self._exit_code
        try:
            info = os.waitid(os.P_PID, self._process.pid,
                             os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # already reaped by stop()
            self._exit_code = self._process.returncode
            return self._exit_code
        if info is None:
            return None
        code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        self._exit_code = code
        return code

    def _wait_code(self, timeout_s: float) -> int | None:
        deadline = time.monotonic() + timeout_s
        while True:
            code = self._code()
            if code is not None or time.monotonic() >= deadline:
                return code
            time.sleep(0.02)

    def _is_stopped(self) -> bool:
        """Stopped by a signal (state T), as `supervisor.is_stopped` tells;
        not imported from there, which imports torch."""
        if self._process is None:
            return False
        try:
            with open(f"/proc/{self._process.pid}/stat") as stat:
                return stat.read().rsplit(")", 1)[-1].split()[0] == "T"
        except (OSError, IndexError):
            return False

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self._process.pid, sig)  # the script leads its group: pgid == pid
        except (ProcessLookupError, PermissionError):
            pass


def _has_files(directory: str, prefix: str) -> bool:
    try:
        return any(name.startswith(prefix) for name in os.listdir(directory))
    except FileNotFoundError:
        return False
