"""Progress on the driver (worker 0): step, loss and steps/s.

A tqdm bar on a terminal; under `splitrun launch` (output is a pipe whose lines
get prefixed) a plain log line instead of carriage returns: at the first step
this process runs (the job is past its start-up: tests wait for this line),
then every few seconds and at the last step.
"""

from __future__ import annotations

import logging
import sys
import time

__all__ = ["Progress"]

logger = logging.getLogger(__name__)

# Under a launcher, one line per this many seconds keeps logs readable.
_LINE_EVERY_S = 2.0


class Progress:
    def __init__(self, total: int | None = None, enabled: bool = True) -> None:
        self.total = total
        self.enabled = enabled
        self._started = time.perf_counter()
        self._last_line: float | None = None  # no line yet: the first step shows one
        self._bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm
            self._bar = tqdm(total=total, unit="step", dynamic_ncols=True)

    def update(self, step: int, loss: float | None, extra: str = "") -> None:
        if not self.enabled:
            return
        done = step + 1
        rate = done / max(time.perf_counter() - self._started, 1e-9)
        loss_text = "" if loss is None else f"loss {loss:.4f}"
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix_str(" ".join(x for x in (loss_text, extra) if x))
            return
        now = time.perf_counter()
        if (self._last_line is None or now - self._last_line >= _LINE_EVERY_S
                or (self.total and done == self.total)):
            self._last_line = now
            of = f"/{self.total}" if self.total else ""
            logger.info("%s", " ".join(part for part in (f"step {done}{of}", loss_text,
                                                         f"{rate:.1f} steps/s", extra) if part))

    def close(self) -> float:
        """Stop; return the steps per second over the whole run."""
        if self._bar is not None:
            self._bar.close()
        return time.perf_counter() - self._started
