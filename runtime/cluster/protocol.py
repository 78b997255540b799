"""`Membership`: what a running process asks of its job's membership, from
its loop and its checkpoints. The scheduler's client (`SchedulerClient`)
answers it for processes; `InProcessMembership` for threads of one process."""

from __future__ import annotations

from typing import Protocol

from splitrun.splitter.labels import Label

__all__ = ["Membership"]


class Membership(Protocol):
    def report_finished(self, label: Label, num_steps: int) -> object:
        """`label`, a worker, ran its last step; once every worker has, the job ends."""

    def report_done(self, label: Label) -> None:
        """`label` finished and leaves."""

    def report_failure(self, label: Label, message: str, dead_peer: Label | None = None) -> None:
        """`label` failed (of `dead_peer`'s death, where known); every other
        process is stopped, told why."""

    def barrier(self, name: str, label: Label, timeout_s: float) -> None:
        """Wait until every process reached the barrier `name`."""

    def kv_put(self, key: str, value: bytes) -> None:
        """Publish `value` under `key` to every process."""

    def kv_get(self, key: str, timeout_s: float) -> bytes:
        """The value under `key`, waiting up to `timeout_s` for it."""

    def close(self) -> None:
        """This process is done with the membership."""
