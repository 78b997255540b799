"""A launcher's output, whichever backend runs the processes: its own lines
("[splitrun] ...") and each process's, prefixed ("[worker 1] ..."), on the
console (`Console`); with `splitrun --log-dir DIR`, one log file per process
beside it. `DIR/worker0.log` holds worker 0's lines as it wrote them (no
prefix), `DIR/launcher.log` the launcher's own. Files are appended to, so a
job restarted with --max-restarts continues them."""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Sequence
from typing import TextIO

from splitrun.splitter.labels import Label

from .bootstrap import ERROR_MARK

__all__ = ["Console", "ProcessLogs", "Tee", "LAUNCHER_LOG"]

logger = logging.getLogger(__name__)

LAUNCHER_LOG = "launcher.log"


class ProcessLogs:
    """The log files of one job's processes under `directory`."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = os.path.abspath(os.fspath(directory))
        os.makedirs(self.directory, exist_ok=True)

    def path_of(self, label: Label) -> str:
        return os.path.join(self.directory, f"{label.role.value}{label.rank}.log")

    def open(self, label: Label) -> TextIO:
        """The file `label`'s output lines go to (appended, line-buffered)."""
        return open(self.path_of(label), "a", buffering=1, encoding="utf-8")

    def open_launcher(self) -> TextIO:
        return open(os.path.join(self.directory, LAUNCHER_LOG), "a", buffering=1,
                    encoding="utf-8")


class Tee:
    """Writes to the console and to the launcher's log file (--log-dir)."""

    def __init__(self, *streams) -> None:
        self.streams = streams

    def write(self, text: str) -> None:
        for stream in self.streams:
            stream.write(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()


class Console:
    """The launcher's output: its own lines and each process's, prefixed, on
    `out` (stdout); with `logs` (--log-dir) also in launcher.log, and each
    process's lines as it wrote them in a file of its own. Safe to call from
    several threads (the local supervisor reads each child in its own)."""

    def __init__(self, logs: ProcessLogs | None = None, verbose: bool = True,
                 out: TextIO | None = None) -> None:
        self.logs = logs
        self.verbose = verbose
        self._files: dict[Label, TextIO] = {}
        self._lock = threading.Lock()
        self._launcher_log = logs.open_launcher() if logs is not None else None
        console = out or sys.stdout
        self.out = console if logs is None else Tee(console, self._launcher_log)

    def say(self, text: str) -> None:
        with self._lock:
            self.out.write(f"[splitrun] {text}\n")
            self.out.flush()

    def note(self, text: str) -> None:
        """A lifecycle line (a process started, where the scheduler listens):
        said with -v only."""
        if self.verbose:
            self.say(text)

    def open(self, label: Label) -> None:
        """Open `label`'s log file now (with --log-dir), before it prints anything."""
        if self.logs is not None and label not in self._files:
            self._files[label] = self.logs.open(label)

    def relay(self, label: Label, lines: Sequence[str]) -> None:
        """`label`'s `lines` into its log file, and prefixed to the console but
        the bootstrap's error line (the failure line shows it, once)."""
        if not lines:
            return
        prefix = f"[{label.describe()}] "
        shown = "".join(prefix + line + "\n" for line in lines
                        if not line.startswith(ERROR_MARK))
        with self._lock:
            if self.logs is not None:
                self.open(label)
                self._files[label].write("".join(line + "\n" for line in lines))
            if shown:
                self.out.write(shown)
                self.out.flush()

    def close_log(self, label: Label) -> None:
        with self._lock:
            log = self._files.pop(label, None)
        if log is not None:
            log.close()

    def close(self) -> None:
        """Close every log file; the console stays."""
        for label in list(self._files):
            self.close_log(label)
        if self._launcher_log is not None:
            self.out = self.out.streams[0]
            self._launcher_log.close()
            self._launcher_log = None
