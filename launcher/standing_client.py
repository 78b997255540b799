"""The launcher's side of a standing template (standing_template.py): connect,
ask it for the job's processes, follow them to their exit codes.

`StandingTemplate.spawn()` answers like `forked.Template.spawn()`: a process
(`StandingProcess`), or None where that process must start with exec (its
command or environment is not one a forked process stands in for, or the
template said why not). Where the standing template cannot serve this launch
at all (it is gone, unusable, not ready in time, its environment differs from
this launch's beyond splitrun's own variables, or what else a process inherits
does: process_context.py) the launch starts its own
template (`fallback`), said once; a standing template lost in the middle of a
job leaves the rest of its processes to exec, said once. Every wait has a
deadline.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable

from .forked import REPLY_TIMEOUT_S, ForkedProcess, Template, exec_reason
from .process_context import context_difference, process_context, umask
from .template import BOOTSTRAP_MODULE, MAX_MESSAGE_BYTES

__all__ = ["SOCKET_VARIABLE", "StandingProcess", "StandingTemplate"]

logger = logging.getLogger(__name__)

# The variable a launcher finds a standing template's socket in.
SOCKET_VARIABLE = "SPLITRUN_TEMPLATE"

# Bounds the connection and the hello's send (a template with a full backlog).
CONNECT_TIMEOUT_S = 10.0
# Bounds the template's answer to the hello: it imports the script's leading
# installed modules first (seconds on a loaded machine; longer when another
# launcher's hello came first).
READY_TIMEOUT_S = 120.0
# Bounds the exit code's arrival once the process is gone (milliseconds).
STATUS_TIMEOUT_S = 10.0
# How often a wait on the template looks whether the launcher was interrupted.
_POLL_S = 0.1


class StandingProcess:
    """What the supervisor uses of `subprocess.Popen`, for a process a
    standing template forked: not this launcher's child, so its exit code
    comes from the template, which reaps it once `wait()` returned."""

    def __init__(self, pid: int, pidfd: int, args: list[str], stdout,
                 link: StandingTemplate) -> None:
        self.pid = pid
        self.args = args
        self.stdout = stdout
        self.returncode: int | None = None
        self._pidfd = pidfd
        self._link = link

    def peek(self) -> int | None:
        """Its exit code if it exited, without letting the template reap it
        (its pid, the id of its process group, is not reused meanwhile)."""
        if self.returncode is None:
            return self._link.exit_code(self.pid, self._pidfd, 0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is not None:
            return self.returncode
        code = self._link.exit_code(self.pid, self._pidfd, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        self.returncode = code
        self._link.reap(self.pid)
        os.close(self._pidfd)
        return code


class StandingTemplate:
    """This launcher's one connection to a standing template, across its
    restarts of the job; `fallback()` starts the launch's own template."""

    def __init__(self, path: str, control: socket.socket, env: dict[str, str],
                 fallback: Callable[[], Template | None]) -> None:
        self._path = path
        self._control = control
        self._env = env
        self._fallback = fallback
        self._answers: queue.Queue[dict | None] = queue.Queue()
        self._codes: dict[int, int] = {}
        self._changed = threading.Condition()
        self._gone = False
        self._template_env: dict[str, str] | None = None  # once ready
        self._own: Template | None = None  # the fallback, once started
        self._given_up: str | None = None
        self._reader = threading.Thread(target=self._read, daemon=True,
                                        name="standing-template")
        self._reader.start()

    @classmethod
    def connect(cls, path: str, env: dict[str, str], script: str,
                fallback: Callable[[], Template | None]) -> StandingTemplate | Template | None:
        """Connect to the standing template at `path` for processes running
        `script` with `env` (their environment but their own variables) and
        say hello; where that fails, `fallback()` (said why)."""
        control = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        control.settimeout(CONNECT_TIMEOUT_S)
        myself = None
        try:
            control.connect(path)
            myself = os.pidfd_open(os.getpid())
            hello = {"hello": {"script": os.path.abspath(script)}}
            socket.send_fds(control, [json.dumps(hello).encode()], [myself])
        except OSError as exc:
            control.close()
            logger.warning("the standing template at %s is gone (%s); this launch starts "
                           "its own template", path, exc)
            return fallback()
        finally:
            if myself is not None:
                os.close(myself)
        logger.info("connected to the standing template at %s", path)
        return cls(path, control, env, fallback)

    def spawn(self, argv: list[str], env: dict[str, str],
              cancelled: Callable[[], bool] = lambda: False
              ) -> StandingProcess | ForkedProcess | None:
        """The process `argv` with `env`, forked from the standing template (or
        from this launch's own); None: start it with exec (why is logged)."""
        if self._own is not None or not self._wait_ready(cancelled):
            return self._own.spawn(argv, env, cancelled) if self._own is not None else None
        reason = exec_reason(argv, env, self._template_env)
        if reason is not None:
            logger.info("a process starts with exec: %s", reason)
            return None
        read_end, write_end = os.pipe()
        request = {"fork": {"argv": argv, "env": env, "cwd": os.getcwd(), "umask": umask()}}
        lost = None
        try:
            socket.send_fds(self._control, [json.dumps(request).encode()], [write_end])
            answer = self._answer(REPLY_TIMEOUT_S)  # a fork is answered in milliseconds
        except OSError as exc:
            answer, lost = None, f"the standing template at {self._path} is gone ({exc})"
        finally:
            os.close(write_end)
        if answer is None or "pid" not in answer:
            os.close(read_end)
            for fd in (answer or {}).get("fds", []):
                os.close(fd)
            if answer is not None:
                logger.info("a process starts with exec: %s", answer.get("exec", answer))
            elif self._gone or lost:
                self._give_up(lost or f"the standing template at {self._path} is gone")
            else:
                self._give_up(f"the standing template at {self._path} did not fork within "
                              f"{REPLY_TIMEOUT_S:g} s")
            return None
        return StandingProcess(answer["pid"], answer["fds"][0], argv,
                               os.fdopen(read_end, "rb"), self)

    def exit_code(self, pid: int, pidfd: int, timeout: float | None) -> int | None:
        """`pid`'s exit code, waiting up to `timeout` s for it; None past that."""
        with self._changed:
            answered = self._changed.wait_for(lambda: pid in self._codes or self._gone,
                                              timeout)
            if pid in self._codes:
                return self._codes[pid]
            if not answered:
                return None
        # The template is gone: its processes died with it (SIGKILL), and
        # nobody is left to say how; the pidfd says when.
        ready, _, _ = select.select([pidfd], [], [],
                                    STATUS_TIMEOUT_S if timeout is None else timeout)
        if not ready:
            return None
        logger.warning("process %d ended with the standing template (its exit code is "
                       "lost; said as SIGKILL, which the template's end sends it)", pid)
        with self._changed:
            self._codes[pid] = -signal.SIGKILL
        return -signal.SIGKILL

    def reap(self, pid: int) -> None:
        """Let the template reap `pid` (its group has been signalled)."""
        if self._gone:
            return
        try:
            self._control.send(json.dumps({"reap": pid}).encode())
        except OSError:
            pass  # gone: it reaps its processes itself then

    def close(self) -> None:
        """Close the connection (the template reaps what is left of ours), and
        this launch's own template if it started one."""
        self._gone = True
        try:
            self._control.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._reader.join(timeout=CONNECT_TIMEOUT_S)
        self._control.close()
        if self._own is not None:
            self._own.close()

    def _wait_ready(self, cancelled: Callable[[], bool]) -> bool:
        if self._template_env is not None or self._given_up is not None:
            return self._template_env is not None
        answer = self._answer(READY_TIMEOUT_S, cancelled)
        if answer is None and cancelled():
            return False
        reason = None
        if answer is None:
            reason = "it is gone" if self._gone else \
                f"it was not ready within {READY_TIMEOUT_S:g} s"
        elif "ready" not in answer:
            reason = answer.get("unusable") or answer.get("exec") or f"it answered {answer}"
        else:
            reason = exec_reason([sys.executable, "-m", BOOTSTRAP_MODULE], self._env,
                                 answer["ready"]["env"])
            differ = context_difference(process_context(), answer["ready"]["context"])
            if reason is None and differ:
                reason = f"it runs with another {', '.join(differ)}"
        if reason is not None:
            self._start_own(f"the standing template at {self._path} cannot serve this "
                            f"launch: {reason}")
            return False
        self._template_env = answer["ready"]["env"]
        logger.info("standing template (pid %d) imported %s; the processes are forked from "
                    "it (%s)", answer["ready"]["pid"], ", ".join(answer["ready"]["preloaded"]),
                    self._path)
        return True

    def _start_own(self, why: str) -> None:
        logger.warning("%s; this launch starts its own template", why)
        self._given_up = why
        self._own = self._fallback()

    def _give_up(self, reason: str) -> None:
        """From now on this launch's processes start with exec; said once."""
        if self._given_up is None:
            logger.warning("processes start with exec (slower): %s", reason)
        self._given_up = reason
        self._template_env = None

    def _answer(self, timeout_s: float,
                cancelled: Callable[[], bool] = lambda: False) -> dict | None:
        """The template's next answer (its fds under "fds"); None past
        `timeout_s`, once cancelled, or once the template is gone."""
        waited = 0.0
        while not cancelled() and waited < timeout_s:
            try:
                return self._answers.get(timeout=min(_POLL_S, timeout_s - waited))
            except queue.Empty:
                waited += _POLL_S
        return None

    def _read(self) -> None:
        """Sort the template's messages: exit codes for the processes' waits,
        the rest for the request that waits on an answer."""
        while True:
            try:
                message, fds, _, _ = socket.recv_fds(self._control, MAX_MESSAGE_BYTES, 1)
            except TimeoutError:
                if self._gone:
                    break
                continue
            except OSError:
                break
            if not message:
                break
            answer = json.loads(message)
            if "exited" in answer:
                with self._changed:
                    self._codes[answer["exited"]] = answer["code"]
                    self._changed.notify_all()
                continue
            self._answers.put({**answer, "fds": fds})
        with self._changed:
            self._gone = True
            self._changed.notify_all()
        self._answers.put(None)
