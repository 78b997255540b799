"""`InProcessMembership`: the `Membership` of a job whose processes are
threads of one process (`run_threaded`), so that they run the same trainer
loop as real processes. It answers what a `Trainer` asks of the scheduler
(`report_finished`, `barrier`, `report_done`, `report_failure`, the
key-value store) and does what the scheduler's heartbeats would: once every
worker finished, every member's receives for later steps end with
`JobFinished` (a serving thread returns); the first failure wakes every
member's pending receive with `PeerFailed` naming the failed thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping

from splitrun.splitter.labels import Label, Role

from ..errors import ClusterError, PeerFailed
from ..transport.protocol import Transport

__all__ = ["InProcessMembership"]


class InProcessMembership:
    """The members `transports` names (every process of a plan, each a thread)."""

    def __init__(self, transports: Mapping[Label, Transport]) -> None:
        self._transports = dict(transports)
        self._workers = {label for label in transports if label.role is Role.WORKER}
        self._finished: dict[Label, int] = {}
        self._failure: str | None = None
        self._barriers: dict[str, threading.Barrier] = {}
        self._values: dict[str, bytes] = {}
        self._cond = threading.Condition()

    def report_finished(self, label: Label, num_steps: int) -> None:
        """`label` ran its last step; once every worker has, the job ends there."""
        with self._cond:
            self._finished[label] = num_steps
            if set(self._finished) != self._workers:
                return
            counts = set(self._finished.values())
        if len(counts) > 1:
            detail = ", ".join(f"{worker.describe()} {steps}"
                               for worker, steps in sorted(self._finished.items()))
            self.report_failure(label, f"workers ran different numbers of steps ({detail}); "
                                       f"every worker must run the same number of steps")
            return
        (steps,) = counts
        for transport in self._transports.values():
            transport.finish_at(steps)

    def report_done(self, label: Label) -> None:
        """Nothing waits for the members to leave: the caller joins the threads."""

    def report_failure(self, label: Label, message: str, dead_peer: Label | None = None) -> None:
        """`label` failed: every other member stops, told why."""
        with self._cond:
            if self._failure is not None:
                return
            self._failure = f"{label.describe()} failed: {message}"
            barriers = list(self._barriers.values())
            self._cond.notify_all()
        for barrier in barriers:
            barrier.abort()
        error = PeerFailed(f"job failed: {self._failure}")
        for member, transport in self._transports.items():
            if member != label:
                transport.abort(error)

    def barrier(self, name: str, label: Label, timeout_s: float) -> None:
        """Wait until every member reached the barrier `name`."""
        with self._cond:
            self._raise_if_failed()
            barrier = self._barriers.get(name)
            if barrier is None:
                barrier = self._barriers[name] = threading.Barrier(len(self._transports))
        try:
            barrier.wait(timeout_s)
        except threading.BrokenBarrierError:
            with self._cond:
                self._raise_if_failed()
            raise ClusterError(f"{label.describe()} waited {timeout_s:g} s at the barrier "
                               f"{name!r}; not every thread of the job reached it") from None

    def kv_put(self, key: str, value: bytes) -> None:
        with self._cond:
            self._values[key] = value
            self._cond.notify_all()

    def kv_get(self, key: str, timeout_s: float) -> bytes:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while key not in self._values:
                self._raise_if_failed()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ClusterError(f"no value for {key!r} within {timeout_s:g} s")
                self._cond.wait(remaining)
            return self._values[key]

    def close(self) -> None:
        """A member left; the threads' caller owns the membership."""

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise PeerFailed(f"job failed: {self._failure}")
