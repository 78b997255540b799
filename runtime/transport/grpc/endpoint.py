"""What the sending and receiving sides of a `GrpcTransport` are given: its
`GrpcSettings` and one frozen `Endpoint` (who this process is, the job's
token, its mailbox, buffer pool and receive contracts, and where fatal errors
go). Neither side holds the transport itself.

`set_identity` gives the process a new label and incarnation after its server
is up: the transport then builds a new `Endpoint` and puts it in the
`CurrentEndpoint` the receiving side reads on every call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from splitrun.splitter.labels import Label

from ...errors import TransportError
from ...rpc.service import TOKEN_METADATA_KEY
from ...rpc.tls import TlsFiles
from ..buffers import BufferPool
from ..contract import ReceiveContracts
from ..framing import DEFAULT_MAX_MESSAGE_BYTES
from ..mailbox import Mailbox

__all__ = ["GrpcSettings", "Endpoint", "CurrentEndpoint"]


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


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One process's side of the transport, as its sender and receiver see it."""

    label: Label
    incarnation: int
    token: str
    settings: GrpcSettings
    mailbox: Mailbox
    pool: BufferPool
    contracts: ReceiveContracts
    # Called with the first failure of a sender: fails the whole transport.
    on_fatal: Callable[[TransportError], None]
    # TLS for this process's server and its channels to peers; None: plaintext.
    tls: TlsFiles | None = None
    # `[worker 1]`: how this process's log lines and errors start.
    tag: str = field(init=False)
    # The call metadata every call to a peer carries.
    metadata: tuple[tuple[str, str], ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tag", f"[{self.label.describe()}]")
        object.__setattr__(self, "metadata", ((TOKEN_METADATA_KEY, self.token),))


class CurrentEndpoint:
    """The transport's endpoint as of now; replaced (never changed) by `set_identity`."""

    __slots__ = ("endpoint",)

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
