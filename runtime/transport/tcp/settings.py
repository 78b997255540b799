"""`TcpSettings`: the limits and deadlines of the TCP data plane."""

from __future__ import annotations

from dataclasses import dataclass

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
