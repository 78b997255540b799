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

import dataclasses
import enum
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from splitrun.runtime.cluster.env import ENV
from splitrun.runtime.transport.shm.job_files import SHM_DIR
from splitrun.splitter.labels import Label

from .bootstrap import ERROR_MARK
from .forked import ForkedProcess, Template
from .janitor import Janitor
from .process_groups import signal_with_group
from .process_logs import ProcessLogs
from .standing_client import StandingProcess, StandingTemplate

__all__ = ["Child", "Supervisor", "Outcome", "FailureKind", "FailureSign", "error_kind",
           "parse_label", "stopped_clause", "ERROR_KINDS"]

logger = logging.getLogger(__name__)

# After SIGTERM, a live process gets this long to exit before SIGKILL. A
# stopped process cannot act on SIGTERM and gets SIGKILL at once.
TERMINATE_GRACE_S = 5.0
# How long exits are collected after the first sign of failure before blaming.
BLAME_WINDOW_S = 1.0
# A child's error printed this long before the first sign of failure still
# counts as a sign (it may take that long to exit or be reported).
TRACEBACK_LOOKBACK_S = 10.0
# How often the supervisor looks at its children and the scheduler.
_POLL_S = 0.05
_TRACEBACK_HEADER = "Traceback (most recent call last):"
_CHAIN_LINES = ("During handling of the above exception",
                "The above exception was the direct cause")
# Exceptions a process raises because another one failed.
_CONSEQUENCES = ("PeerFailed", "JobFinished")
# A receive that waited past its deadline: the peer waited on may be the cause.
_TIMEOUTS = ("RecvTimeout",)


@dataclass
class Child:
    label: Label
    process: subprocess.Popen | ForkedProcess | StandingProcess
    reader: threading.Thread | None = None
    exit_code: int | None = None
    # The last line of the last traceback it printed ("ValueError: boom"), and when.
    error: str | None = None
    error_seen: float | None = None

    @property
    def pid(self) -> int:
        return self.process.pid


@dataclass
class Outcome:
    exit_code: int
    summary: str
    children: list[Child] = field(default_factory=list)


class FailureKind(enum.IntEnum):
    """What a failure sign is, in the order of blame (the local and Ray launchers')."""

    KILLED = 0       # killed by a signal, or stopped
    OWN_ERROR = 1    # exited non-zero with its own error
    REPORTED = 2     # the scheduler's report (a silent or stalled process, a mismatch)
    TIMED_OUT = 3    # a receive of its step timed out (on a peer that may have stalled)
    CONSEQUENCE = 4  # exited because a peer failed


@dataclass(frozen=True)
class FailureSign:
    """One sign that the job failed; the culprit is the first by (kind, seen)."""
    kind: FailureKind
    seen: float
    label: Label | None
    exit_code: int
    what: str           # "worker 1 (pid 7) exited with code 1" or the scheduler's reason
    child: Child | None = None


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def shell_code(code: int) -> int:
    """The exit code a shell would report for a child's return code."""
    return 128 - code if code < 0 else code


def is_stopped(pid: int) -> bool:
    """True while `pid` is stopped by a signal (state T in /proc/PID/stat)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[-1].split()[0] == "T"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


class _ErrorLine:
    """Follows a child's output and keeps the last line of its last traceback,
    or the one line the bootstrap writes for a splitrun error."""

    def __init__(self) -> None:
        self.in_traceback = False
        self.line: str | None = None

    def feed(self, line: str) -> None:
        if line.startswith(ERROR_MARK):
            self.line = line[len(ERROR_MARK):].strip()
            self.in_traceback = False
            return
        if line.startswith(_TRACEBACK_HEADER):
            self.in_traceback = True
            return
        if not self.in_traceback or not line.strip():
            return
        if line.startswith((" ", "\t")) or line.startswith(_CHAIN_LINES):
            return
        self.line = line.strip()
        self.in_traceback = False


class Supervisor:
    """Runs one command per label; `run()` returns when all exited cleanly or
    after the first failure has stopped the rest."""

    def __init__(self, out=None, logs: ProcessLogs | None = None, verbose: bool = True,
                 template: Template | StandingTemplate | None = None) -> None:
        self.children: list[Child] = []
        self._out = out or sys.stdout
        # Lifecycle lines (`note`) are shown only when asked (-v).
        self._verbose = verbose
        # --log-dir: each child's lines also go to a file of its own.
        self._logs = logs
        self._write_lock = threading.Lock()
        self._interrupted = threading.Event()
        self._signal = signal.SIGINT
        self._janitor = Janitor()
        # Forks the processes (None: each starts with exec).
        self._template = template

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
        child = Child(label, process)
        shm_prefix = env.get(ENV.SHM_PREFIX)
        if shm_prefix:
            self._janitor.watch(SHM_DIR, shm_prefix, process.pid)
        log = self._logs.open(label) if self._logs is not None else None
        child.reader = threading.Thread(target=self._relay, args=(child, log), daemon=True,
                                        name=f"relay-{label}")
        child.reader.start()
        self.children.append(child)
        self.note(f"started {label.describe()} (pid {process.pid})")
        return child

    def say(self, text: str) -> None:
        with self._write_lock:
            self._out.write(f"[splitrun] {text}\n")
            self._out.flush()

    def note(self, text: str) -> None:
        """A lifecycle line (a process started, where the scheduler listens):
        said with -v only."""
        if self._verbose:
            self.say(text)

    def _relay(self, child: Child, log=None) -> None:
        prefix = f"[{child.label.describe()}] "
        errors = _ErrorLine()
        for raw in iter(child.process.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\r\n")
            # A carriage-return progress bar would glue lines together.
            line = line.rsplit("\r", 1)[-1]
            if log is not None:
                log.write(line + "\n")
            errors.feed(line)
            if errors.line is not None and errors.line != child.error:
                child.error, child.error_seen = errors.line, time.monotonic()
            if line.startswith(ERROR_MARK):
                continue  # the failure line shows it, once
            with self._write_lock:
                self._out.write(prefix + line + "\n")
                self._out.flush()
        child.process.stdout.close()
        if log is not None:
            log.close()

    def interrupt(self, signum: int = signal.SIGINT) -> None:
        self._signal = signal.Signals(signum)
        self._interrupted.set()

    def run(self, external_failure: Callable[[], tuple[str, str] | None] | None = None,
            step_of: Callable[[Label], int | None] | None = None) -> Outcome:
        """Wait for the children. `external_failure()` may report a failure the
        scheduler saw (a hung process, a plan mismatch) as (label, reason).
        Every child is gone when it returns, and so are its shared-memory files."""
        try:
            outcome = self._watch(external_failure, step_of)
        except BaseException:
            self._janitor.close(wait=False)  # the children may still run: die with us
            raise
        self._janitor.close()
        return outcome

    def _watch(self, external_failure, step_of) -> Outcome:
        started = time.monotonic()
        signs: list[FailureSign] = []
        seen: set[int] = set()  # pids already counted as failure signs
        reported = False
        blame_at: float | None = None
        while True:
            if self._interrupted.is_set():
                self._stop_all()
                return Outcome(128 + int(self._signal),
                               f"interrupted by {self._signal.name}; stopped every process",
                               self.children)
            now = time.monotonic()
            running = 0
            for child in self.children:
                if child.exit_code is not None or child.pid in seen:
                    continue
                code = _exit_code(child)
                if code is None:
                    if is_stopped(child.pid):
                        seen.add(child.pid)
                        signs.append(FailureSign(FailureKind.KILLED, now, child.label, 1,
                                           f"{child.label.describe()} (pid {child.pid}) was "
                                           f"stopped by a signal", child))
                    else:
                        running += 1
                    continue
                if code == 0:
                    _reap(child, code)
                    continue
                seen.add(child.pid)
                signs.append(self._exit_sign(child, code, now))
            if not reported and external_failure is not None:
                failure = external_failure()
                if failure is not None:
                    reported = True
                    label, reason = failure
                    signs.append(FailureSign(FailureKind.REPORTED, now, parse_label(label), 1,
                                             reason))
            if signs and blame_at is None:
                blame_at = now + BLAME_WINDOW_S
            if blame_at is not None and (now >= blame_at or not running):
                return self._blame(signs, step_of)
            if not running and blame_at is None:
                elapsed = now - started
                return Outcome(0, f"all {len(self.children)} processes finished in "
                                  f"{elapsed:.1f} s", self.children)
            time.sleep(_POLL_S)

    @staticmethod
    def _exit_sign(child: Child, code: int, now: float) -> FailureSign:
        what = f"{child.label.describe()} (pid {child.pid}) {describe_exit(code)}"
        kind = FailureKind.KILLED if code < 0 else error_kind(child.error)
        return FailureSign(kind, now, child.label, shell_code(code), what, child)

    def _traceback_signs(self, signs: list[FailureSign]) -> list[FailureSign]:
        """Children that printed their error but had not exited by the time of
        blame (tearing down an interpreter with torch and gRPC can take
        seconds, and a peer's report or the heartbeat timeout may come first)."""
        counted = {s.child.pid for s in signs if s.child is not None}
        # A traceback printed long before (a handled error the script logged)
        # is not this failure's.
        since = min(s.seen for s in signs) - TRACEBACK_LOOKBACK_S
        return [FailureSign(error_kind(c.error), c.error_seen, c.label, 1,
                      f"{c.label.describe()} (pid {c.pid}) failed", c)
                for c in self.children
                if c.error_seen is not None and c.error_seen >= since
                and c.pid not in counted and c.exit_code != 0]

    def _blame(self, signs: list[FailureSign], step_of) -> Outcome:
        running = [c for c in self.children if c.exit_code is None and _exit_code(c) is None]
        # Stopping joins the relays: every child's last lines (its error) are read.
        self._stop_all()
        signs = [_reclassified(s) for s in signs] + self._traceback_signs(signs)
        culprit = _own_sign(min(signs, key=lambda s: (s.kind, s.seen)), signs)
        step = step_of(culprit.label) if step_of and culprit.label is not None else None
        others = [c for c in running if c is not culprit.child]
        ending = stopped_clause(len(others), culprit.child is not None)
        if culprit.kind is FailureKind.REPORTED:
            summary = f"job failed: {culprit.what}{ending}"
        else:
            at = f" at step {step}" if step is not None else ""
            # Read after stopping: the relay has then seen the child's last line.
            error = culprit.child.error if culprit.child is not None else None
            because = f": {error}" if error else ""
            summary = f"{culprit.what}{at}{because}{ending}"
        return Outcome(culprit.exit_code, summary, self.children)

    def _stop_all(self) -> None:
        """SIGTERM every unreaped child's process group (SIGKILL at once for a
        stopped one, which cannot act on SIGTERM), SIGKILL what is left after
        the grace period, then reap. A child is reaped only after its group
        was signalled, so its id cannot have been reused meanwhile."""
        pending = [c for c in self.children if c.exit_code is None]
        for child in pending:
            _signal_group(child, signal.SIGKILL if is_stopped(child.pid) else signal.SIGTERM)
        deadline = time.monotonic() + TERMINATE_GRACE_S
        while time.monotonic() < deadline:
            alive = [c for c in pending if _exit_code(c) is None]
            if not alive:
                break
            for child in alive:
                if is_stopped(child.pid):
                    _signal_group(child, signal.SIGKILL)
            time.sleep(_POLL_S)
        for child in pending:
            _signal_group(child, signal.SIGKILL)
            _reap(child, None)
        for child in self.children:
            if child.reader is not None:
                child.reader.join(timeout=TERMINATE_GRACE_S)


def stopped_clause(num_others: int, is_one_process: bool = True) -> str:
    """The end of a failure line: the processes stopped because of it, the
    others than the culprit (`is_one_process`) or every one; nothing said when
    none was left running."""
    if num_others == 0:
        return ""
    if not is_one_process:
        return "; stopped every process"
    return f"; stopped the other {num_others} process{'es' if num_others > 1 else ''}"


def _own_sign(culprit: FailureSign, signs: list[FailureSign]) -> FailureSign:
    """The scheduler's report names a process that also left a sign of its
    own (its exit, its error): that sign, which says it in its own words."""
    if culprit.kind is not FailureKind.REPORTED or culprit.label is None:
        return culprit
    own = [s for s in signs if s.child is not None and s.label == culprit.label]
    return min(own, key=lambda s: s.seen) if own else culprit


def _reclassified(sign: FailureSign) -> FailureSign:
    """An exit with an error, judged by the error line the relay has read by now."""
    if sign.kind in ERROR_KINDS and sign.child is not None:
        return dataclasses.replace(sign, kind=error_kind(sign.child.error))
    return sign


ERROR_KINDS = (FailureKind.OWN_ERROR, FailureKind.TIMED_OUT, FailureKind.CONSEQUENCE)


def error_kind(error: str | None) -> FailureKind:
    """A process's own error, a receive of its that timed out, or an error it
    raised because another process failed."""
    kind = error.split(":", 1)[0] if error else ""
    if kind.endswith(_CONSEQUENCES):
        return FailureKind.CONSEQUENCE
    if kind.endswith(_TIMEOUTS):
        return FailureKind.TIMED_OUT
    return FailureKind.OWN_ERROR


def parse_label(text: str) -> Label | None:
    """The label the scheduler named in a report, or None if it named none."""
    try:
        return Label.parse(text) if text else None
    except Exception:  # noqa: BLE001 - a label the scheduler could not name
        return None


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
