"""Errors raised while processes run. All derive from `SplitrunError`.

`JobFinished` is the one exception here that is not an error: it is how a
process that serves steps learns that the workers finished.
"""

from __future__ import annotations

from splitrun.splitter.errors import SplitrunError

__all__ = [
    "SplitrunError",
    "TransportError",
    "RecvTimeout",
    "PeerDied",
    "MessageRejected",
    "ChannelMismatch",
    "UnknownChannel",
    "WrongSender",
    "PeerFailed",
    "StepFailed",
    "CollectiveFailed",
    "ClusterError",
    "CacheError",
    "CheckpointError",
    "MemoryCapError",
    "JobFinished",
]


class TransportError(SplitrunError):
    """A message could not be sent or received."""


class RecvTimeout(TransportError):
    """A receive whose message did not come before its deadline. Raised by a
    step, it names the peer waited on (`peer`, a Label) and for how long
    (`waited_s`): the scheduler then tells a stalled peer from a slow one."""

    def __init__(self, message: str, *, peer=None, waited_s: float | None = None) -> None:
        super().__init__(message)
        self.peer = peer
        self.waited_s = waited_s


class PeerDied(TransportError):
    """A peer's end of the connection to it went away without a close: the
    peer died. This process fails because of it, as with `PeerFailed`: the
    launcher names the dead process, not this one. `peer`: the dead one,
    where known (the scheduler names it, and its memory, when it went near
    its memory cap)."""

    def __init__(self, message: str, peer=None) -> None:
        super().__init__(message)
        self.peer = peer


class MessageRejected(TransportError):
    """A message that does not match what the plan expects (channel, incarnation,
    dtype, shape, byte count, token)."""


class ChannelMismatch(MessageRejected):
    """A message whose tensors break its channel's receive contract: another
    count, dtype or shape than the plan says."""


class UnknownChannel(ChannelMismatch):
    """A message on a channel this process does not receive."""


class WrongSender(ChannelMismatch):
    """A message from another process than its channel's sender."""


class CollectiveFailed(TransportError):
    """A torch.distributed collective (or forming its process group) that failed
    or missed its deadline."""


class PeerFailed(SplitrunError):
    """This process stopped because another process of the job failed."""


class StepFailed(SplitrunError):
    """An op of this process's subgraph raised."""


class ClusterError(SplitrunError):
    """Membership went wrong: registration refused, plan mismatch, lost process,
    an address that cannot be bound."""


class CacheError(SplitrunError):
    """An embedding table or cache that cannot be served as asked (too many
    rows, an id outside its table, a cache too small for one batch)."""


class MemoryCapError(SplitrunError):
    """State a process is about to make that its memory cap (its memory
    cgroup's limit) cannot hold: said before it is made, not an OOM kill."""


class CheckpointError(SplitrunError):
    """A checkpoint that cannot be resumed from: unreadable, corrupt (checksum),
    or not matching the model (keys, dtype, shape, non-finite values, step)."""


class JobFinished(Exception):  # noqa: N818 - a signal, named for what happened
    """Not an error: the workers finished after `num_steps` steps, so the step
    a serving process waits for will never run. It ends a server's serving
    loop and is never reported as a failure."""

    def __init__(self, num_steps: int) -> None:
        super().__init__(f"the workers finished after {num_steps} steps")
        self.num_steps = num_steps
