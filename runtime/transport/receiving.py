"""Which receive of its step a thread is inside, and whether it still waits.

A process's heartbeat tells the scheduler the peer its step waits on, and a
process that waits on a peer is never the stalled one. But a thread can be
stuck inside a receive without waiting: a signal handler, a control message's
handler or other user code run by the receiving thread while it waits, that
never returns. So the executor enters each receive of its step
(`receiving(peer)`), and the mailbox's wait loop, where every transport's
receive waits, wakes at least every `TICK_S` and ticks the receive its thread
is inside (`tick`). A receive whose last tick is older than `STUCK_AFTER_S`
is stuck: its process waits on no one, and the scheduler's stall check can
name it (`Receive.is_stuck`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from splitrun.splitter.labels import Label

__all__ = ["Receive", "receiving", "tick", "TICK_S", "STUCK_AFTER_S"]

# How often a waiting receive's loop turns at the latest (a wake-up costs microseconds).
TICK_S = 0.25
# A receive that has not turned for this long is stuck: several ticks missed,
# which a loaded machine's scheduling does not explain.
STUCK_AFTER_S = 2.0

_current = threading.local()


class Receive:
    """A receive inside a step: from whom, since when, last seen waiting
    (time.monotonic())."""

    __slots__ = ("peer", "since", "ticked")

    def __init__(self, peer: Label) -> None:
        self.peer = peer
        self.since = self.ticked = time.monotonic()

    def is_stuck(self, now: float | None = None) -> bool:
        """Its thread is inside it but no longer waiting."""
        return (time.monotonic() if now is None else now) - self.ticked > STUCK_AFTER_S


@contextmanager
def receiving(peer: Label) -> Iterator[Receive]:
    """The calling thread is inside a receive from `peer` until the block ends."""
    receive, previous = Receive(peer), getattr(_current, "receive", None)
    _current.receive = receive
    try:
        yield receive
    finally:
        _current.receive = previous


def tick() -> None:
    """The calling thread's receive still waits (no-op outside one)."""
    receive = getattr(_current, "receive", None)
    if receive is not None:
        receive.ticked = time.monotonic()
