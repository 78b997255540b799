"""The `Transport` protocol: how an executor hands tensors to its peers.

Sends never wait for the receiver to reach its receive (the receiver buffers),
and every receive has a deadline. That, with schedules in one global order, is
what makes a split program deadlock-free.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from splitrun.splitter.labels import Label

__all__ = ["MessageKey", "Transport", "OUT_OF_PLAN"]

# Channels that are not part of the step's plan (control, state for
# checkpoints) start with this; only plan channels end when the job finishes.
OUT_OF_PLAN = "@"


@dataclass(frozen=True, slots=True)
class MessageKey:
    """Identifies one message: a restarted peer has a new incarnation, so its
    stale messages are refused instead of mixed in."""

    incarnation: int
    step: int
    channel: str

    def __str__(self) -> str:
        return f"channel {self.channel!r} step {self.step} (incarnation {self.incarnation})"

    @property
    def is_in_plan(self) -> bool:
        return not self.channel.startswith(OUT_OF_PLAN)


class Transport(Protocol):
    label: Label

    def send(self, dst: Label, key: MessageKey, tensors: Sequence[torch.Tensor]) -> None:
        """Queue `tensors` for `dst`; returns without waiting for the receiver."""

    def recv(self, src: Label, key: MessageKey, timeout_s: float,
             control: tuple[MessageKey, Callable[[Label, list[torch.Tensor]], None]] | None = None,
             ) -> list[torch.Tensor]:
        """The tensors `src` sent under `key`; raises `RecvTimeout` past the deadline.
        While waiting, a message under `control`'s key goes to its handler."""

    def abort(self, error: BaseException) -> None:
        """Wake every pending receive of this process with `error`."""

    def finish_at(self, num_steps: int) -> None:
        """Receives for steps >= `num_steps` end with `JobFinished`."""

    def flush(self, timeout_s: float) -> None:
        """Wait until every queued send has been delivered."""

    def route(self, prefix: str,
              handler: Callable[[MessageKey, Label, list[torch.Tensor]], None]) -> None:
        """Hand incoming messages on channels starting with `prefix` to `handler`."""

    def close(self) -> None:
        """Release resources; pending sends are flushed or reported."""
