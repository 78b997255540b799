"""What a job's failure looks like to its launcher, whichever backend runs
the processes (the local supervisor, the Ray job): the signs of a failure,
their kinds in the order of blame, the error line each process printed last,
the culprit among the signs, and the one line that names it.

Blame: after the first sign of failure (a process exits with an error, is
stopped or killed, or the scheduler reports a failure), a backend keeps
collecting signs for `BLAME_WINDOW_S` and blames, in this order: a process
killed by a signal or stopped, a process that exited with its own error, the
scheduler's report, a process whose receive timed out (the scheduler names
the peer it waited on when it knows that peer stalled), a process that exited
because a peer failed; the earliest seen within a kind. A peer's report can
reach the scheduler before a killed process shows as exited. The last line
is the culprit's own message.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import signal
from dataclasses import dataclass
from typing import Protocol

from splitrun.splitter.labels import Label

from .bootstrap import ERROR_MARK

__all__ = ["BLAME_WINDOW_S", "TERMINATE_GRACE_S", "ERROR_KINDS", "ErrorLine", "FailureKind",
           "FailureSign", "Outcome", "Process", "count_of", "culprit_of", "describe_exit",
           "error_kind",
           "failure_line", "parse_label", "shell_code", "stopped_clause"]

# After SIGTERM, a live process gets this long to exit before SIGKILL. A
# stopped process cannot act on SIGTERM and gets SIGKILL at once.
TERMINATE_GRACE_S = 5.0
# How long exits are collected after the first sign of failure before blaming.
BLAME_WINDOW_S = 1.0

_TRACEBACK_HEADER = "Traceback (most recent call last):"
# An exception's closing line in a traceback: "ValueError: boom", "pkg.PeerFailed: ...".
_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*)(:|$)")
# Exceptions a process raises because another one failed (or died).
_CONSEQUENCES = ("PeerFailed", "PeerDied", "JobFinished")
# A receive that waited past its deadline: the peer waited on may be the cause.
_TIMEOUTS = ("RecvTimeout",)


class FailureKind(enum.IntEnum):
    """What a failure sign is, in the order of blame."""

    KILLED = 0       # killed by a signal, or stopped
    OWN_ERROR = 1    # exited non-zero with its own error
    REPORTED = 2     # the scheduler's report (a silent or stalled process, a mismatch)
    TIMED_OUT = 3    # a receive of its step timed out (on a peer that may have stalled)
    CONSEQUENCE = 4  # exited because a peer failed


ERROR_KINDS = (FailureKind.OWN_ERROR, FailureKind.TIMED_OUT, FailureKind.CONSEQUENCE)


class Process(Protocol):
    """A backend's record of one process, as far as blame reads it."""

    label: Label
    error: str | None  # the last error line it printed ("ValueError: boom")


@dataclass(frozen=True)
class FailureSign:
    """One sign that the job failed; the culprit is the first by (kind, seen)."""
    kind: FailureKind
    seen: float
    label: Label | None
    exit_code: int
    what: str           # "worker 1 (pid 7) exited with code 1" or the scheduler's reason
    process: Process | None = None  # the process the sign is of (None: the scheduler's)
    cause: str | None = None  # what the kernel says of it ("out of memory: ..."), if anything


@dataclass(frozen=True)
class Outcome:
    """How one start of the job ended: the launcher's exit code and its last line."""
    exit_code: int
    summary: str


class ErrorLine:
    """Follows a process's output and keeps the last line of its last
    traceback, or the one line the bootstrap writes for a splitrun error."""

    def __init__(self) -> None:
        self.in_traceback = False
        self.line: str | None = None

    def feed(self, line: str) -> None:
        if line.startswith(ERROR_MARK):
            self.line = line[len(ERROR_MARK):].strip()
            self.in_traceback = False
        elif line.startswith(_TRACEBACK_HEADER):
            self.in_traceback = True
        elif self.in_traceback and _EXCEPTION_LINE.match(line):
            # Frames are indented; "During handling of ..." does not match.
            self.line = line.strip()
            self.in_traceback = False


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


def culprit_of(signs: list[FailureSign]) -> FailureSign:
    """The sign to blame: exits with an error judged by the error line read
    by now, then the first by (kind, seen); where that is the scheduler's
    report of a process that also left a sign of its own (its exit, its
    error), that sign, which says it in its own words."""
    judged = [_reclassified(sign) for sign in signs]
    culprit = min(judged, key=lambda s: (s.kind, s.seen))
    if culprit.kind is not FailureKind.REPORTED or culprit.label is None:
        return culprit
    own = [s for s in judged if s.process is not None and s.label == culprit.label]
    return min(own, key=lambda s: s.seen) if own else culprit


def _reclassified(sign: FailureSign) -> FailureSign:
    if sign.kind in ERROR_KINDS and sign.process is not None:
        return dataclasses.replace(sign, kind=error_kind(sign.process.error))
    return sign


def failure_line(culprit: FailureSign, step: int | None, num_others: int) -> str:
    """The launcher's last line for a failure: the culprit, its step and its
    own error, and the processes stopped because of it (`num_others` still
    ran besides the culprit when the failure was judged)."""
    if culprit.kind is FailureKind.REPORTED and culprit.process is None:
        return f"job failed: {culprit.what}{stopped_clause(num_others, False)}"
    at = f" at step {step}" if step is not None else ""
    error = culprit.process.error if culprit.process is not None else None
    because = "".join(f": {said}" for said in (culprit.cause, error) if said)
    return f"{culprit.what}{at}{because}{stopped_clause(num_others)}"


def count_of(number: int, noun: str, plural: str | None = None) -> str:
    """`1 worker`, `2 workers`, `0 servers`, `1 process`, `3 processes`."""
    return f"{number} {noun if number == 1 else plural or noun + 's'}"


def stopped_clause(num_others: int, is_one_process: bool = True) -> str:
    """The end of a failure line: the processes stopped because of it, the
    others than the culprit (`is_one_process`) or every one; nothing said when
    none was left running."""
    if num_others == 0:
        return ""
    if not is_one_process:
        return "; stopped every process"
    return f"; stopped the other {count_of(num_others, 'process', 'processes')}"
