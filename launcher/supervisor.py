"""Start the processes of a job, prefix their output, and stop them all on the
first failure.

Each child leads its own process group (so its own children go with it) and,
on Linux, asks to die with the launcher (`die_with_parent`, called by the
job at start; the heartbeat timeout covers the rest): no process outlives the
launcher. Only processes this supervisor started are ever signalled, by id.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from splitrun.splitter.labels import Label

__all__ = ["Child", "Supervisor", "Outcome"]

logger = logging.getLogger(__name__)

# After SIGTERM, a process gets this long to exit before SIGKILL.
TERMINATE_GRACE_S = 5.0
# How often the supervisor looks at its children and the scheduler.
_POLL_S = 0.05


@dataclass
class Child:
    label: Label
    process: subprocess.Popen
    reader: threading.Thread | None = None
    exit_code: int | None = None

    @property
    def pid(self) -> int:
        return self.process.pid


@dataclass
class Outcome:
    exit_code: int
    summary: str
    failed: Label | None = None
    children: list[Child] = field(default_factory=list)


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


class Supervisor:
    """Runs one command per label; `run()` returns when all exited cleanly or
    after the first failure has stopped the rest."""

    def __init__(self, out=None) -> None:
        self.children: list[Child] = []
        self._out = out or sys.stdout
        self._write_lock = threading.Lock()
        self._interrupted = threading.Event()

    def spawn(self, label: Label, argv: Sequence[str], env: dict[str, str]) -> Child:
        # No preexec_fn: Python then starts the child with vfork/posix_spawn,
        # which runs no fork handlers. gRPC's, with the scheduler's server
        # threads running, can abort a forked child before it execs.
        process = subprocess.Popen(
            list(argv), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True)
        child = Child(label, process)
        child.reader = threading.Thread(target=self._relay, args=(child,), daemon=True,
                                        name=f"relay-{label}")
        child.reader.start()
        self.children.append(child)
        self.say(f"started {label.describe()} (pid {process.pid})")
        return child

    def say(self, text: str) -> None:
        with self._write_lock:
            self._out.write(f"[splitrun] {text}\n")
            self._out.flush()

    def _relay(self, child: Child) -> None:
        prefix = f"[{child.label.describe()}] "
        for raw in iter(child.process.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\r\n")
            # A carriage-return progress bar would glue lines together.
            line = line.rsplit("\r", 1)[-1]
            with self._write_lock:
                self._out.write(prefix + line + "\n")
                self._out.flush()
        child.process.stdout.close()

    def interrupt(self) -> None:
        self._interrupted.set()

    def run(self, external_failure: Callable[[], tuple[str, str] | None] | None = None,
            step_of: Callable[[Label], int | None] | None = None) -> Outcome:
        """Wait for the children. `external_failure()` may report a failure the
        scheduler saw (a hung process, a plan mismatch) as (label, reason)."""
        started = time.monotonic()
        while True:
            if self._interrupted.is_set():
                self._stop_all()
                return Outcome(130, "interrupted; stopped every process", None, self.children)
            running = 0
            for child in self.children:
                if child.exit_code is not None:
                    continue
                code = _exit_code(child)
                if code is None:
                    running += 1
                    continue
                if code != 0:
                    return self._fail_on_exit(child, code, step_of)
                _reap(child, code)
            failure = external_failure() if external_failure else None
            if failure is not None:
                label, reason = failure
                self._stop_all()
                return Outcome(1, f"job failed: {reason}; stopped every process",
                               Label.parse(label) if label else None, self.children)
            if not running:
                elapsed = time.monotonic() - started
                return Outcome(0, f"all {len(self.children)} processes finished in "
                                  f"{elapsed:.1f} s", None, self.children)
            time.sleep(_POLL_S)

    def _fail_on_exit(self, child: Child, code: int, step_of) -> Outcome:
        step = step_of(child.label) if step_of else None
        at = f" at step {step}" if step is not None else ""
        others = [c for c in self.children if c is not child and c.exit_code is None
                  and _exit_code(c) is None]
        self._stop_all()
        summary = (f"{child.label.describe()} (pid {child.pid}) {describe_exit(code)}{at}; "
                   f"stopped the other {len(others)} processes")
        return Outcome(shell_code(code), summary, child.label, self.children)

    def _stop_all(self) -> None:
        """SIGTERM every unreaped child's process group, SIGKILL what is left
        after the grace period, then reap. A child is reaped only after its
        group was signalled, so its id cannot have been reused meanwhile."""
        pending = [c for c in self.children if c.exit_code is None]
        for child in pending:
            _signal_group(child, signal.SIGTERM)
        deadline = time.monotonic() + TERMINATE_GRACE_S
        while time.monotonic() < deadline and any(_exit_code(c) is None for c in pending):
            time.sleep(_POLL_S)
        for child in pending:
            _signal_group(child, signal.SIGKILL)
            _reap(child, None)
        for child in self.children:
            if child.reader is not None:
                child.reader.join(timeout=TERMINATE_GRACE_S)


def _exit_code(child: Child) -> int | None:
    """The child's exit code if it exited, without reaping it (it stays a
    zombie, so its pid, the id of its process group, is not reused)."""
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
    try:
        os.killpg(child.pid, sig)  # the child leads its own group: pgid == pid
    except (ProcessLookupError, PermissionError):
        pass
