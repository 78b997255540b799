"""The errors of the shared-memory ring (`ring`)."""

from __future__ import annotations

from ...errors import TransportError

__all__ = ["RingError", "RingPeerGone", "RingAttachTimeout", "RingClosed"]


class RingError(TransportError):
    """The shared-memory ring failed (setup, a broken frame, a peer gone)."""


class RingPeerGone(RingError):
    """The process at the other end of the ring died (or dropped its end)
    without closing it in order."""


class RingAttachTimeout(RingError):
    """The other end did not show up within the wait: the consumer did not
    attach (`RingWriter.wait_attached`), or the producer's files did not appear
    (`RingReader.attach`). Waiting again may still see it."""


class RingClosed(RingError):
    """The producer closed the ring in order; no more messages come."""
