"""`splitrun --log-dir DIR`: one log file per process, next to the prefixed
console output. `DIR/worker0.log` holds worker 0's lines as it wrote them (no
prefix), `DIR/launcher.log` the launcher's own. Files are appended to, so a
job restarted with --max-restarts continues them."""

from __future__ import annotations

import logging
import os
from typing import TextIO

from splitrun.splitter.labels import Label

__all__ = ["ProcessLogs", "Tee", "LAUNCHER_LOG"]

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
        self._streams = streams

    def write(self, text: str) -> None:
        for stream in self._streams:
            stream.write(text)

    def flush(self) -> None:
        for stream in self._streams:
            stream.flush()
