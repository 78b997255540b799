"""The launcher's side of the template process (template.py): start it beside
a local job, ask it for the job's processes, stop it with the job.

`Template.spawn()` returns a `ForkedProcess`, or None where the process must
start with exec instead: the template could not import what it preloads or
is not safe to fork from (it said why), it did not answer in time, or the
process's command or environment is not one a forked process can stand in for
(not the bootstrap's, or an environment that differs from the template's
beyond splitrun's own variables). Each reason is logged, once.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

from .template import BOOTSTRAP_MODULE, MAX_MESSAGE_BYTES

__all__ = ["ForkedProcess", "Template", "exec_reason"]

logger = logging.getLogger(__name__)

_PR_SET_CHILD_SUBREAPER = 36
# Bounds the template's imports (torch, capture, the job runtime): 3 s on an
# idle 2-core machine, 20 s on a loaded one. Past it, processes start with exec.
READY_TIMEOUT_S = 120.0
# Bounds one fork's answer (milliseconds).
REPLY_TIMEOUT_S = 30.0
# Bounds the template's exit after the launcher closed its socket.
CLOSE_TIMEOUT_S = 10.0
# How often a wait on the template looks whether the launcher was interrupted.
_POLL_S = 0.1
# The variables the processes of one job may differ in from the template:
# splitrun's own, which `Job.from_env()` reads once the script runs.
_PER_PROCESS_PREFIX = "SPLITRUN_"
# What a shell sets for each command it starts (a standing template and the
# launches it serves start from different shells): nothing imports them.
_SHELL_BOOKKEEPING = ("_", "SHLVL", "PWD", "OLDPWD")


def exec_reason(argv: Sequence[str], env: dict[str, str],
                template_env: dict[str, str]) -> str | None:
    """Why the process `argv` with `env` must start with exec rather than be
    forked from a template started with `template_env`; None: it may be forked."""
    if list(argv[:3]) != [sys.executable, "-m", BOOTSTRAP_MODULE]:
        return f"its command is not the bootstrap's ({' '.join(argv[:3])})"

    def general(variables: dict[str, str]) -> dict[str, str]:
        return {k: v for k, v in variables.items()
                if not k.startswith(_PER_PROCESS_PREFIX) and k not in _SHELL_BOOKKEEPING}
    differ = sorted(set(general(env).items()) ^ set(general(template_env).items()))
    if differ:
        names = sorted({name for name, _ in differ})
        return f"its environment differs from the template's in {', '.join(names)}"
    return None


class ForkedProcess:
    """What the supervisor uses of `subprocess.Popen`, for a process the
    template forked and this launcher adopted (it is this launcher's child)."""

    def __init__(self, pid: int, args: list[str], stdout) -> None:
        self.pid = pid
        self.args = args
        self.stdout = stdout
        self.returncode: int | None = None

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is not None:
            return self.returncode
        pidfd = os.pidfd_open(self.pid)  # readable once it exited
        try:
            ready, _, _ = select.select([pidfd], [], [], timeout)
        finally:
            os.close(pidfd)
        if not ready:
            raise subprocess.TimeoutExpired(self.args, timeout)
        _, status = os.waitpid(self.pid, 0)
        self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


class Template:
    """One template process per local launch, across its restarts."""

    def __init__(self, process: subprocess.Popen, control: socket.socket,
                 env: dict[str, str]) -> None:
        self._process = process
        self._control = control
        self._env = env
        self._ready = False
        self._unusable: str | None = None
        self._relay = threading.Thread(target=self._relay_output, daemon=True,
                                       name="relay-template")
        self._relay.start()

    @property
    def pid(self) -> int:
        return self._process.pid

    @classmethod
    def start(cls, env: dict[str, str], script: str,
              preload: Sequence[str] = ()) -> Template | None:
        """Start the template for processes running `script`, with `env` (their
        environment but their own variables), importing `preload` too; None
        where processes cannot be adopted (not Linux)."""
        if not _become_subreaper():
            logger.info("processes start with exec: this system cannot adopt forked "
                        "processes (no PR_SET_CHILD_SUBREAPER)")
            return None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {**env, "PYTHONUNBUFFERED": "1"}
        try:
            # Its stdout is a pipe, as a process's is (the forked ones inherit
            # the kind of stream Python set up at its start).
            process = subprocess.Popen(
                [sys.executable, "-m", "splitrun.launcher.template", "--parent-pid",
                 str(os.getpid()), "--socket", str(theirs.fileno()), "--script",
                 os.path.abspath(script),
                 *(f"--preload={module}" for module in preload)],
                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, pass_fds=(theirs.fileno(),), start_new_session=True)
        except OSError as exc:
            ours.close()
            logger.warning("processes start with exec: the template did not start: %s", exc)
            return None
        finally:
            theirs.close()
        logger.info("template (pid %d) started: the processes will be forked from it once it "
                    "has imported torch", process.pid)
        return cls(process, ours, env)

    def spawn(self, argv: list[str], env: dict[str, str],
              cancelled: Callable[[], bool] = lambda: False) -> ForkedProcess | None:
        """The process `argv` with `env`, forked from the template; None: start
        it with exec (why is logged). `cancelled()` ends a wait on the template."""
        reason = exec_reason(argv, env, self._env)
        if reason is not None:
            logger.info("a process starts with exec: %s", reason)
            return None
        if not self._wait_ready(cancelled):
            return None
        read_end, write_end = os.pipe()
        request = {"argv": argv, "env": env, "cwd": os.getcwd()}
        try:
            socket.send_fds(self._control, [json.dumps(request).encode()], [write_end])
            # Not cancelled: a fork asked for is answered (in milliseconds).
            answer = self._receive(REPLY_TIMEOUT_S)
        except OSError as exc:
            answer = {"exec": f"the template is gone ({exc})"}
        finally:
            os.close(write_end)
        pid = answer.get("pid") if answer is not None else None
        if not isinstance(pid, int):
            os.close(read_end)
            if answer is None:
                # Hung or stopped: it and a fork it may still make go.
                self._kill()
            self._give_up(answer.get("exec") if answer else
                          f"it did not fork within {REPLY_TIMEOUT_S:g} s")
            return None
        return ForkedProcess(pid, argv, os.fdopen(read_end, "rb"))

    def close(self) -> None:
        """Close its socket (it exits) and wait for it, bounded; kill it past that."""
        self._control.close()
        try:
            self._process.wait(timeout=CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.warning("the template (pid %d) did not exit within %g s; killing it",
                           self._process.pid, CLOSE_TIMEOUT_S)
            self._kill()
        self._relay.join(timeout=CLOSE_TIMEOUT_S)

    def _kill(self) -> None:
        """SIGKILL the template's process group: it, and a first child of a
        fork under way (a forked process leaves the group once adopted)."""
        if self._process.poll() is None:  # not reaped: its pid is still its own
            try:
                os.killpg(self._process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._process.wait(timeout=CLOSE_TIMEOUT_S)

    def _wait_ready(self, cancelled: Callable[[], bool]) -> bool:
        if self._ready or self._unusable is not None:
            return self._ready
        answer = self._receive(READY_TIMEOUT_S, cancelled)
        if answer is not None and "ready" in answer:
            self._ready = True
            logger.info("template (pid %d) imported %s in %.1f s; the processes are forked "
                        "from it", self._process.pid, ", ".join(answer["ready"]["preloaded"]),
                        answer["ready"]["took_s"])
            return True
        if answer is not None:
            self._give_up(answer.get("unusable", f"it answered {answer}"))
        elif not cancelled():
            self._kill()
            self._give_up(f"it was not ready within {READY_TIMEOUT_S:g} s")
        return False

    def _receive(self, timeout_s: float,
                 cancelled: Callable[[], bool] = lambda: False) -> dict | None:
        """The template's next answer; None past `timeout_s` or once cancelled."""
        deadline = time.monotonic() + timeout_s
        while not cancelled():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            ready, _, _ = select.select([self._control], [], [], min(remaining, _POLL_S))
            if ready:
                message = self._control.recv(MAX_MESSAGE_BYTES)
                if not message:
                    return {"exec": "the template exited"}
                return json.loads(message)
        return None

    def _give_up(self, reason: str) -> None:
        """From now on every process starts with exec; said once."""
        if self._unusable is None:
            logger.warning("processes start with exec (slower): %s", reason)
        self._unusable = reason
        self._ready = False

    def _relay_output(self) -> None:
        """The template's own lines (a failed import's traceback) as warnings."""
        for raw in iter(self._process.stdout.readline, b""):
            logger.warning("template (pid %d): %s", self._process.pid,
                           raw.decode(errors="replace").rstrip())
        self._process.stdout.close()


def _become_subreaper() -> bool:
    """Make this process adopt its descendants whose parent exits (Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return False
    return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
