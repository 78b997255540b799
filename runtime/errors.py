"""Errors raised while processes run. All derive from `SplitrunError`."""

from __future__ import annotations

from splitrun.splitter.errors import SplitrunError

__all__ = [
    "SplitrunError",
    "TransportError",
    "RecvTimeout",
    "MessageRejected",
    "PeerFailed",
    "StepFailed",
    "ClusterError",
    "JobFinished",
]


class TransportError(SplitrunError):
    """A message could not be sent or received."""


class RecvTimeout(TransportError):
    """A receive whose message did not come before its deadline."""


class MessageRejected(TransportError):
    """A message that does not match what the plan expects (channel, incarnation,
    dtype, shape, byte count, token)."""


class PeerFailed(SplitrunError):
    """This process stopped because another process of the job failed."""


class StepFailed(SplitrunError):
    """An op of this process's subgraph raised."""


class ClusterError(SplitrunError):
    """Membership went wrong: registration refused, plan mismatch, lost process."""


class JobFinished(SplitrunError):
    """Not a failure: the workers finished, so the step being waited for will
    never run. Ends a server's serving loop."""

    def __init__(self, num_steps: int) -> None:
        super().__init__(f"the workers finished after {num_steps} steps")
        self.num_steps = num_steps
