"""Message keys: how a message is named on every transport."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MessageKey", "OUT_OF_PLAN"]

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
