"""Start the processes of a job, prefix their output, and stop them all on the
first failure, blaming the process that failed first.

Each child leads its own process group (so its own children go with it) and
dies with the launcher from the moment it starts (the launcher starts it
through `bootstrap.py`, which sets PR_SET_PDEATHSIG before the script runs).
Only processes this supervisor started are ever signalled, by id. Given a
`Template`, it forks them from that process, which has imported torch once
(template.py says why that is safe and when a process starts with exec
instead); the launcher adopts them, so they are its children like the others.
Given a `StandingTemplate`, a template many launches share forks them: they
stay its children, it reports their exit codes and reaps each only once this
supervisor has signalled its group (standing_template.py).

Shared memory: a child whose environment names the job's shared-memory prefix
is watched by a `Janitor`, a small process that removes the prefix's files
once the children are gone, also when this launcher was SIGKILLed and the
children died with it (nobody else of the job is left to remove them then).

Blame: after the first sign of failure (a child exits with an error, is
stopped, or the scheduler reports a failure), the supervisor keeps collecting
exits for `BLAME_WINDOW_S` and blames, in this order: a child killed by a signal
or stopped, a child that exited with its own error, the scheduler's report, a
child whose receive timed out (the scheduler names the peer it waited on when
it knows that peer stalled), a child that exited because a peer failed; the
earliest seen within a kind. A peer's report can reach the scheduler before a
killed process shows as exited. The last line is the culprit's own message.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from splitrun.runtime.cluster.env import ENV
from splitrun.runtime.transport.shm.job_files import SHM_DIR
from splitrun.splitter.labels import Label

from .backend import watch
from .failures import (
    TERMINATE_GRACE_S,
    ErrorLine,
    FailureKind,
    FailureSign,
    Outcome,
    culprit_of,
    describe_exit,
    error_kind,
    failure_line,
    shell_code,
)
from .forked import ForkedProcess, Template
from .janitor import Janitor
from .memory_watch import MemoryWatch
from .process_groups import signal_with_group
from .process_logs import Console, ProcessLogs
from .standing_client import StandingProcess, StandingTemplate

__all__ = ["Child", "Supervisor", "is_stopped"]

logger = logging.getLogger(__name__)

# A child's error printed this long before the first sign of failure still
# counts as a sign (it may take that long to exit or be reported).
TRACEBACK_LOOKBACK_S = 10.0
# How often the supervisor looks at its children and the scheduler.
_POLL_S = 0.05


@dataclass
class Child:
    label: Label
    process: subprocess.Popen | ForkedProcess | StandingProcess
    reader: threading.Thread | None = None
    exit_code: int | None = None
    # The last line of the last traceback it printed ("ValueError: boom"), and when.
    error: str | None = None
    error_seen: float | None = None
    finished_at: float | None = None  # when it was seen to exit 0
    memory: MemoryWatch | None = None  # its RSS and memory cgroup, as last seen
    is_killed_here: bool = False       # this supervisor sent it SIGKILL

    @property
    def pid(self) -> int:
        return self.process.pid


def is_stopped(pid: int) -> bool:
    """True while `pid` is stopped by a signal (state T in /proc/PID/stat)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[-1].split()[0] == "T"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


class Supervisor:
    """Runs one command per label; `run()` returns when all exited cleanly or
    after the first failure has stopped the rest. The local `Backend`."""

    def __init__(self, out=None, logs: ProcessLogs | None = None, verbose: bool = True,
                 template: Template | StandingTemplate | None = None) -> None:
        self.children: list[Child] = []
        # The launcher's lines and the children's; lifecycle lines (`note`)
        # only when asked (-v); with --log-dir, a file per child too.
        self._console = Console(logs, verbose, out)
        self._interrupted = threading.Event()
        self._signal = signal.SIGINT
        self._janitor = Janitor()
        # Forks the processes (None: each starts with exec).
        self._template = template
        self._counted: set[int] = set()  # pids already counted as failure signs
        self._step_of: Callable[[Label], int | None] | None = None

    def spawn(self, label: Label, argv: Sequence[str], env: dict[str, str]) -> Child:
        process = None
        if self._template is not None:
            process = self._template.spawn(list(argv), env, cancelled=self._interrupted.is_set)
        if process is None:
            # No preexec_fn: Python then starts the child with vfork/posix_spawn,
            # which runs no fork handlers. gRPC's, with the scheduler's server
            # threads running, can abort a forked child before it execs. `argv`
            # starts with the bootstrap, which asks to die with this process.
            process = subprocess.Popen(
                list(argv), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, start_new_session=True)
        child = Child(label, process, memory=MemoryWatch(process.pid))
        shm_prefix = env.get(ENV.SHM_PREFIX)
        if shm_prefix:
            self._janitor.watch(SHM_DIR, shm_prefix, process.pid)
        self._console.open(label)
        child.reader = threading.Thread(target=self._follow, args=(child,), daemon=True,
                                        name=f"relay-{label}")
        child.reader.start()
        self.children.append(child)
        self.note(f"started {label.describe()} (pid {process.pid})")
        return child

    def say(self, text: str) -> None:
        self._console.say(text)

    def note(self, text: str) -> None:
        self._console.note(text)

    def relay(self, label: Label, lines: Sequence[str]) -> None:
        self._console.relay(label, lines)

    def _follow(self, child: Child) -> None:
        """The reader thread of `child`: relay its lines, follow its error line."""
        errors = ErrorLine()
        for raw in iter(child.process.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\r\n")
            # A carriage-return progress bar would glue lines together.
            line = line.rsplit("\r", 1)[-1]
            errors.feed(line)
            if errors.line is not None and errors.line != child.error:
                child.error, child.error_seen = errors.line, time.monotonic()
            self.relay(child.label, [line])
        child.process.stdout.close()
        self._console.close_log(child.label)

    def interrupt(self, signum: int = signal.SIGINT) -> None:
        self._signal = signal.Signals(signum)
        self._interrupted.set()

    def run(self, external_failure: Callable[[], tuple[str, str] | None] | None = None,
            step_of: Callable[[Label], int | None] | None = None,
            on_failure: Callable[[], None] | None = None) -> Outcome:
        """Wait for the children. `external_failure()` may report a failure the
        scheduler saw (a hung process, a plan mismatch) as (label, reason);
        `on_failure()` is called at the first sign of one. Every child is gone
        when it returns, and so are its shared-memory files."""
        self._step_of = step_of
        try:
            outcome = watch(self, len(self.children), external_failure,
                            lambda: self._signal if self._interrupted.is_set() else None,
                            poll_s=_POLL_S, on_failure=on_failure)
        except BaseException:
            self._janitor.close(wait=False)  # the children may still run: die with us
            raise
        self._janitor.close()
        return outcome

    def poll(self, now: float) -> tuple[list[FailureSign], int]:
        signs: list[FailureSign] = []
        running = 0
        for child in self.children:
            if child.exit_code is not None or child.pid in self._counted:
                continue
            code = _exit_code(child)
            if code is None:
                child.memory.sample(now)
                if is_stopped(child.pid):
                    self._counted.add(child.pid)
                    signs.append(FailureSign(FailureKind.KILLED, now, child.label, 1,
                                             f"{child.label.describe()} (pid {child.pid}) was "
                                             f"stopped by a signal", child))
                else:
                    running += 1
                continue
            if code == 0:
                _reap(child, code)
                child.finished_at = now
                continue
            self._counted.add(child.pid)
            signs.append(self._exit_sign(child, code, now))
        return signs, running

    @staticmethod
    def _exit_sign(child: Child, code: int, now: float) -> FailureSign:
        what = f"{child.label.describe()} (pid {child.pid}) {describe_exit(code)}"
        kind = FailureKind.KILLED if code < 0 else error_kind(child.error)
        return FailureSign(kind, now, child.label, shell_code(code), what, child,
                           _kernel_cause(child, code))

    def _oom_signs(self, signs: list[FailureSign]) -> list[FailureSign]:
        """Children the OOM killer ended only while they were being stopped
        (one thrashing in memory reclaim sends no heartbeat, and the
        scheduler's report of its silence may come first): their kill,
        which the kernel counted, is the failure."""
        counted = {s.process.pid for s in signs if s.process is not None}
        first = min(s.seen for s in signs)
        found = []
        for child in self.children:
            cause = _kernel_cause(child, child.exit_code)
            if child.pid not in counted and cause is not None:
                found.append(FailureSign(FailureKind.KILLED, first, child.label,
                                         shell_code(child.exit_code),
                                         f"{child.label.describe()} (pid {child.pid}) "
                                         f"{describe_exit(child.exit_code)}", child, cause))
        return found

    def _traceback_signs(self, signs: list[FailureSign]) -> list[FailureSign]:
        """Children that printed their error but had not exited by the time of
        blame (tearing down an interpreter with torch and gRPC can take
        seconds, and a peer's report or the heartbeat timeout may come first)."""
        counted = {s.process.pid for s in signs if s.process is not None}
        # A traceback printed long before (a handled error the script logged)
        # is not this failure's.
        since = min(s.seen for s in signs) - TRACEBACK_LOOKBACK_S
        return [FailureSign(error_kind(c.error), c.error_seen, c.label, 1,
                            f"{c.label.describe()} (pid {c.pid}) failed", c)
                for c in self.children
                if c.error_seen is not None and c.error_seen >= since
                and c.pid not in counted and c.exit_code != 0]

    def blame(self, signs: list[FailureSign]) -> Outcome:
        # The processes the failure stopped: those that had not finished on
        # their own before its first sign, whether they exited because of it
        # (a peer's failure) or are stopped now.
        first = min(s.seen for s in signs)
        stopped = [c for c in self.children if c.finished_at is None or c.finished_at > first]
        # Stopping joins the relays: every child's last lines (its error) are read.
        self.stop_all()
        culprit = culprit_of(signs + self._traceback_signs(signs) + self._oom_signs(signs))
        step_of = self._step_of
        step = step_of(culprit.label) if step_of and culprit.label is not None else None
        others = [c for c in stopped if c is not culprit.process]
        return Outcome(culprit.exit_code, failure_line(culprit, step, len(others)))

    def stop_all(self) -> None:
        """SIGTERM every unreaped child's process group (SIGKILL at once for a
        stopped one, which cannot act on SIGTERM), SIGKILL what is left after
        the grace period, then reap. A child is reaped only after its group
        was signalled, so its id cannot have been reused meanwhile."""
        pending = [c for c in self.children if c.exit_code is None]
        for child in pending:
            child.is_killed_here = is_stopped(child.pid)
            _signal_group(child, signal.SIGKILL if child.is_killed_here else signal.SIGTERM)
        deadline = time.monotonic() + TERMINATE_GRACE_S
        while time.monotonic() < deadline:
            alive = [c for c in pending if _exit_code(c) is None]
            if not alive:
                break
            for child in alive:
                if is_stopped(child.pid):
                    child.is_killed_here = True
                    _signal_group(child, signal.SIGKILL)
            time.sleep(_POLL_S)
        for child in pending:
            if _exit_code(child) is None:
                child.is_killed_here = True
            _signal_group(child, signal.SIGKILL)
            _reap(child, None)
        for child in self.children:
            if child.reader is not None:
                child.reader.join(timeout=TERMINATE_GRACE_S)


def _kernel_cause(child: Child, code: int | None) -> str | None:
    """That `child`, killed by SIGKILL, but not by this supervisor, ran out
    of memory, where the kernel counted an OOM kill; else None."""
    if code != -signal.SIGKILL or child.is_killed_here or child.memory is None:
        return None
    return child.memory.oom_verdict()


def _exit_code(child: Child) -> int | None:
    """The child's exit code if it exited, without reaping it (it stays a
    zombie, so its pid, the id of its process group, is not reused)."""
    if isinstance(child.process, StandingProcess):  # a standing template's child
        return child.process.peek()
    info = os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def _reap(child: Child, code: int | None) -> None:
    # Grandchildren left in the group (data loader workers) go with it.
    _signal_group(child, signal.SIGKILL)
    child.process.wait(timeout=TERMINATE_GRACE_S)
    child.exit_code = child.process.returncode if code is None else code


def _signal_group(child: Child, sig: int) -> None:
    signal_with_group(child.pid, sig)  # the child leads its own group once set up
