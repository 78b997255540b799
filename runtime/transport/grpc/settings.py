"""`GrpcSettings`: the tuning and limits of a `GrpcTransport`."""

from __future__ import annotations

from dataclasses import dataclass

from ..framing import DEFAULT_MAX_MESSAGE_BYTES

__all__ = ["GrpcSettings"]


@dataclass(frozen=True, slots=True)
class GrpcSettings:
    """Tuning and limits of a `GrpcTransport`; every process of a job should use
    the same values."""

    # Data per Chunk of a message: 1 MiB measured best on loopback (smaller
    # costs per-chunk overhead, larger stalls the pipeline between copies).
    chunk_bytes: int = 1 << 20
    # Per peer: bytes queued (not yet on the wire) before send() blocks.
    max_queued_bytes: int = 256 << 20
    # Envelopes declaring more than this are refused before any allocation.
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    # gRPC's limit on one Chunk (data plus envelope), both ways.
    max_request_bytes: int = 16 << 20
    # Bounds reaching a peer that is not up yet (and noticing one that is gone).
    connect_timeout_s: float = 30.0
    # Bounds a send() blocked on a full queue: the peer does not drain it.
    send_timeout_s: float = 300.0
    # Bounds close(): flushing queued sends, then stopping the server.
    close_timeout_s: float = 30.0
    # An idle stream ends after this: it confirms what it carried and frees
    # the peer's server thread (so a closing peer need not wait longer).
    stream_idle_s: float = 1.0
    # A stream starts no new message after this long; its gRPC deadline is
    # this plus message_timeout_s, the bound on one message's transfer.
    stream_max_s: float = 600.0
    message_timeout_s: float = 600.0
    # Bounds a receiving server's wait for expect() when a message arrives first:
    # a peer may start its first step while this process still captures and
    # splits its model (minutes on a loaded machine); receives inside a step
    # (120 s by default) give up before this does.
    expect_timeout_s: float = 300.0
    # Concurrent calls this process serves (one per sending peer, plus pings).
    max_server_threads: int = 64
    # Receive buffers kept for reuse, in bytes.
    pool_bytes: int = 1 << 30
    # Pooled receive buffers in pinned memory: for a process that computes on
    # CUDA, whose executor copies every received tensor to its GPU.
    pin_receive_buffers: bool = False
