"""TensorBoard scalars of one process (`splitrun --metrics-dir DIR`).

Each process writes its own event file under `DIR/<process>/` (`worker0`,
`server1`), so `tensorboard --logdir DIR` shows the processes side by side:

- `loss` (where the step's loss is delivered: worker 0), per step;
- `steps_per_s`, from the time between this process's steps;
- `recv_wait_s` (the step's time blocked in receives), and per channel
  `sent_bytes/<channel>`, `received_bytes/<channel>`, `recv_wait_s/<channel>`
  for the step (a channel `w0->s0#3` is tagged `w0_to_s0_3`);
- embedding-cache mode: `cache/<table>/hit_rate` of the step and
  `cache/<table>/evictions`.

`torch.utils.tensorboard` needs the `tensorboard` package (`pip install
'splitrun[metrics]'`); it is imported only when a metrics directory is given.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Mapping

from splitrun.splitter.labels import Label

from ..engine.executor import ExecutorStats
from ..errors import SplitrunError

__all__ = ["StepMetrics", "process_dir_name", "channel_tag"]

logger = logging.getLogger(__name__)

# Event files are flushed at least this often (and at close).
_FLUSH_EVERY_S = 10.0
_TAG_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def process_dir_name(label: Label) -> str:
    """`worker0`, `server1`: one folder (and event file) per process."""
    return f"{label.role.value}{label.rank}"


def channel_tag(channel: str) -> str:
    """A channel's name as a TensorBoard tag: `w0->s0#3` -> `w0_to_s0_3`."""
    return _TAG_UNSAFE.sub("_", channel.replace("->", "_to_"))


class StepMetrics:
    """Writes one process's scalars after each of its steps."""

    def __init__(self, directory: str | os.PathLike, label: Label) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise SplitrunError(
                f"--metrics-dir needs TensorBoard's writer, which did not import ({exc}); "
                f"pip install 'splitrun[metrics]' (or tensorboard), or drop --metrics-dir"
            ) from None
        self.path = os.path.join(os.fspath(directory), process_dir_name(label))
        self._writer = SummaryWriter(log_dir=self.path, flush_secs=_FLUSH_EVERY_S)
        self._last_time: float | None = None
        self._sent: dict[str, int] = {}
        self._received: dict[str, int] = {}
        self._waited: dict[str, float] = {}
        self._recv_wait_s = 0.0
        logger.info("%s: TensorBoard scalars in %s", label.describe(), self.path)

    def record(self, step: int, *, loss: float | None, stats: ExecutorStats,
               cache_counters: Mapping[str, Mapping] | None = None) -> None:
        """The scalars of `step`, just finished, from the running counters."""
        scalar = self._writer.add_scalar
        now = time.perf_counter()
        if loss is not None:
            scalar("loss", loss, step)
        if self._last_time is not None and now > self._last_time:
            scalar("steps_per_s", 1.0 / (now - self._last_time), step)
        self._last_time = now
        scalar("recv_wait_s", stats.recv_wait_s - self._recv_wait_s, step)
        self._recv_wait_s = stats.recv_wait_s
        for channel, counter in sorted(stats.sent.items()):
            scalar(f"sent_bytes/{channel_tag(channel)}",
                   counter.bytes - self._sent.get(channel, 0), step)
            self._sent[channel] = counter.bytes
        for channel, counter in sorted(stats.received.items()):
            tag = channel_tag(channel)
            scalar(f"received_bytes/{tag}", counter.bytes - self._received.get(channel, 0),
                   step)
            scalar(f"recv_wait_s/{tag}", counter.wait_s - self._waited.get(channel, 0.0),
                   step)
            self._received[channel], self._waited[channel] = counter.bytes, counter.wait_s
        for table, counters in sorted((cache_counters or {}).items()):
            last = counters.get("last_step", {})
            if last.get("unique_ids"):
                scalar(f"cache/{table}/hit_rate", last.get("hits", 0) / last["unique_ids"],
                       step)
            scalar(f"cache/{table}/evictions", last.get("evictions", 0), step)

    def close(self) -> None:
        self._writer.close()
