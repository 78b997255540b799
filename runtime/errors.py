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
