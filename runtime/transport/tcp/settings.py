"""`TcpSettings`: the limits and deadlines of the TCP data plane."""

from __future__ import annotations

from dataclasses import dataclass

from .wire import MAX_STRIPES

__all__ = ["TcpSettings"]


@dataclass(frozen=True, slots=True)
class TcpSettings:
    """Every process of a job should use the same values."""

    # Bounds connecting to a peer's data port, its TLS handshake and its hello.
    connect_timeout_s: float = 30.0
    # Bounds a connection's hello on the server: a caller that connects and
    # says nothing holds one thread this long, never a message.
    hello_timeout_s: float = 10.0
    # Bounds one message's transfer once its first byte came (a sender that
    # stalls mid-message), and a send() blocked because the receiver does not
    # read (its socket buffer is full).
    message_timeout_s: float = 600.0
    # Bounds close(): the last flush, then the receiving threads.
    close_timeout_s: float = 30.0
    # Messages up to this many bytes go out in one write with their header.
    coalesce_bytes: int = 64 << 10
    # Connections per peer: messages of stripe_min_bytes or more are cut into
    # this many parts, written and read by as many threads at once (`stripes`).
    # 2: measured faster than one connection between two hosts on 2 cores
    # (docs/data-plane.md); 1 turns striping off.
    stripes: int = 2
    # Below this a message goes whole on the main connection: waking the
    # stripes' threads costs more than a few MiB take to copy.
    stripe_min_bytes: int = 4 << 20

    def __post_init__(self) -> None:
        if not 1 <= self.stripes <= MAX_STRIPES:
            raise ValueError(f"TcpSettings.stripes must be 1 to {MAX_STRIPES}, got "
                             f"{self.stripes}")
