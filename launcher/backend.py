"""What a launcher backend does with the processes of one start of a job,
named once: the local supervisor (child processes of the launcher) and the
Ray job (one actor per process) are both a `Backend`, and `watch` is the
loop both run, from the processes' start to the line that ends the job."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from splitrun.splitter.labels import Label

from .failures import BLAME_WINDOW_S, FailureKind, FailureSign, Outcome, parse_label

__all__ = ["Backend", "watch", "finished_line"]


def finished_line(num_processes: int, elapsed_s: float) -> str:
    """The launcher's last line when every process finished."""
    every = "the 1 process" if num_processes == 1 else f"all {num_processes} processes"
    return f"{every} finished in {elapsed_s:.1f} s"


class Backend(Protocol):
    """The processes of one start of a job, as the launcher drives them."""

    def say(self, text: str) -> None:
        """A line of the launcher's own ("[splitrun] ..."), always shown."""

    def note(self, text: str) -> None:
        """A lifecycle line (a process started, where the scheduler listens): -v only."""

    def relay(self, label: Label, lines: Sequence[str]) -> None:
        """Lines process `label` printed: to the console, prefixed, and its log."""

    def poll(self, now: float) -> tuple[list[FailureSign], int]:
        """Look at the processes (waiting briefly where that is how they answer):
        the new signs of failure since the last poll, and how many still run."""

    def stop_all(self) -> None:
        """Stop every process still running (SIGTERM, SIGKILL after a grace
        period) and read what each printed last."""

    def blame(self, signs: list[FailureSign]) -> Outcome:
        """Stop the rest and name the culprit among `signs`."""


def watch(backend: Backend, num_processes: int,
          report: Callable[[], tuple[str, str] | None] | None,
          interrupted: Callable[[], signal.Signals | None], poll_s: float = 0.0,
          on_failure: Callable[[], None] | None = None) -> Outcome:
    """Wait for the processes: every one finished (exit 0), or the first sign
    of failure, after which signs are collected for `BLAME_WINDOW_S` (or until
    none runs) and `backend.blame` names the culprit. `report()` is the
    scheduler's word, (label, reason), once it has one; `interrupted()` the
    signal the launcher got, if any; `poll_s` the pause between polls;
    `on_failure()` is called at the first sign (a restart gets ready)."""
    started = time.monotonic()
    signs: list[FailureSign] = []
    is_reported = False
    blame_at: float | None = None
    while True:
        sig = interrupted()
        if sig is not None:
            backend.stop_all()
            return Outcome(128 + int(sig), f"interrupted by {sig.name}; stopped every process")
        new, running = backend.poll(time.monotonic())
        now = time.monotonic()
        signs += new
        if not is_reported and report is not None:
            failure = report()
            if failure is not None:
                is_reported = True
                signs.append(FailureSign(FailureKind.REPORTED, now, parse_label(failure[0]), 1,
                                         failure[1]))
        if signs and blame_at is None:
            blame_at = now + BLAME_WINDOW_S
            if on_failure is not None:
                on_failure()
        if blame_at is not None and (now >= blame_at or not running):
            return backend.blame(signs)
        if not running and blame_at is None:
            return Outcome(0, finished_line(num_processes, now - started))
        if poll_s:
            time.sleep(poll_s)
