"""`GrpcTransport`: the `Transport` protocol over real gRPC between processes.

This module is its public face: `GrpcTransport`, its `GrpcSettings`, and the
`ExpectedChannel`s it checks incoming messages against. The receiving side
(the `TensorService` server and its checks) lives in `grpc_receive`, the
sending side (per-peer queues, streams, retries) in `grpc_send`, and the
names both ends of a call share in `grpc_service`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass

import grpc
import torch

from splitrun.splitter.labels import Label
from splitrun.splitter.plan import SplitPlan
from splitrun.splitter.program import Program

from ..codec import (
    DEFAULT_MAX_MESSAGE_BYTES,
    BufferPool,
    EnvelopeWriter,
    encode,
    frame_message,
)
from ...errors import TransportError
from .receive import _ChannelRule, _compile_rule, _server_options, _Servicer
from .send import (
    _JOIN_GRACE_S,
    _channel_options,
    _Outgoing,
    _PeerSender,
    _SendQueue,  # noqa: F401 - re-exported: tests import it from here
    _stage,
)
from .service import _PING, TOKEN_METADATA_KEY
from ..mailbox import Mailbox
from ..protocol import MessageKey
from ..wire import splitrun_pb2

__all__ = ["GrpcTransport", "GrpcSettings", "ExpectedChannel", "expected_channels",
           "TOKEN_METADATA_KEY"]

logger = logging.getLogger(__name__)

# Room for a Chunk's framing besides its data and envelope.
_CHUNK_OVERHEAD = 64
# CPU messages up to this size are framed (copied) in send() itself: cheaper
# than framing them later on gRPC's thread, and the caller's tensors are free
# again at once.
_FRAME_AT_SEND_BYTES = 64 << 10


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
    # Bounds a receiving server's wait for expect() when a message arrives first.
    expect_timeout_s: float = 30.0
    # Concurrent calls this process serves (one per sending peer, plus pings).
    max_server_threads: int = 64
    # Receive buffers kept for reuse, in bytes.
    pool_bytes: int = 1 << 30


@dataclass(frozen=True, slots=True)
class ExpectedChannel:
    """A channel this process receives: from whom, and its tensors' dtype and
    shape (None for a value the plan has no static dtype/shape for)."""

    src: Label
    # None: a dynamic channel (any number of tensors of any dtype and shape,
    # e.g. embedding-cache requests); only the sender is checked.
    tensors: tuple[tuple[torch.dtype, tuple[int, ...]] | None, ...] | None

    def __post_init__(self) -> None:
        if self.tensors is None:
            return
        # Shapes compare as tuples of ints, whatever sequence the caller gave.
        normal = tuple(None if meta is None else (meta[0], tuple(int(d) for d in meta[1]))
                       for meta in self.tensors)
        object.__setattr__(self, "tensors", normal)


def expected_channels(plan: SplitPlan, program: Program, label: Label
                      ) -> dict[str, ExpectedChannel]:
    """What `label` may receive under `plan`: from `plan.recv_channels(label)`
    and the dtype/shape each value has in the program's graph."""
    nodes = {node.name: node for node in program.graph.nodes}
    out = {}
    for channel in plan.recv_channels(label):
        metas = []
        for value in channel.values:
            node = nodes.get(value)
            meta = None if node is None else node.meta.get("val")
            if isinstance(meta, torch.Tensor) and all(isinstance(d, int) for d in meta.shape):
                metas.append((meta.dtype, tuple(int(d) for d in meta.shape)))
            else:
                metas.append(None)
        out[channel.name] = ExpectedChannel(channel.src, tuple(metas))
    return out


def _format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class GrpcTransport:
    """The `Transport` protocol over gRPC: a server for this process, a stream
    to each peer.

        transport = GrpcTransport(label, token=token, incarnation=inc,
                                  expected=expected_channels(plan, program, label))
        address = transport.start()          # tell the peers (scheduler)
        transport.set_peers({peer: address_of_peer, ...})
        ... Executor(plan, label, transport, incarnation=inc) ...
        transport.close()

    Sent tensors are read after `send` returns, when their turn on the wire
    comes: do not modify them in place afterwards (the split program never does).
    """

    def __init__(self, label: Label, *, token: str, incarnation: int, host: str = "127.0.0.1",
                 port: int = 0, expected: Mapping[str, ExpectedChannel] | None = None,
                 settings: GrpcSettings | None = None) -> None:
        self.label = label
        self.incarnation = incarnation
        self.settings = settings or GrpcSettings()
        if self.settings.chunk_bytes + _CHUNK_OVERHEAD >= self.settings.max_request_bytes:
            raise TransportError(
                f"chunk_bytes {self.settings.chunk_bytes} must leave room for the "
                f"envelope below max_request_bytes {self.settings.max_request_bytes}")
        self.host = host
        self.port = port
        self.address: str | None = None
        self._tag = f"[{label.describe()}]"
        self._token = token
        self._envelopes = EnvelopeWriter(str(label))
        self._mailbox = Mailbox(label, incarnation)
        self._pool = BufferPool(self.settings.pool_bytes)
        self._rules: dict[str, _ChannelRule] | None = None
        self._rules_set = threading.Event()
        if expected is not None:
            self.expect(expected)
        self._peers: dict[Label, str] = {}
        self._senders: dict[Label, _PeerSender] = {}
        self._lock = threading.Lock()
        self._error: TransportError | None = None
        self._error_raised = False
        self._server: grpc.Server | None = None
        self._server_pool: futures.ThreadPoolExecutor | None = None
        self._is_closed = False

    def __enter__(self) -> GrpcTransport:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- setup --

    def start(self) -> str:
        """Bind and start the server; returns the bound "host:port" (port 0 picks one)."""
        if self._server is not None:
            return self.address
        settings = self.settings
        self._server_pool = futures.ThreadPoolExecutor(
            max_workers=settings.max_server_threads,
            thread_name_prefix=f"splitrun-recv-{self.label}")
        server = grpc.server(self._server_pool, options=_server_options(settings),
                             maximum_concurrent_rpcs=settings.max_server_threads)
        server.add_generic_rpc_handlers((_Servicer(self).handler(),))
        wanted = _format_address(self.host, self.port)
        try:
            port = server.add_insecure_port(wanted)
        except RuntimeError as exc:
            port, cause = 0, exc
        else:
            cause = None
        if not port:
            self._server_pool.shutdown(wait=False)
            raise TransportError(
                f"{self._tag} cannot listen on {wanted}: {cause or 'bind failed'}; is the "
                f"port taken? (port 0 picks a free one)")
        server.start()
        self._server = server
        self.port = port
        self.address = _format_address(self.host, port)
        logger.info("%s serving tensors on %s", self._tag, self.address)
        return self.address

    def set_peers(self, peers: Mapping[Label, str]) -> None:
        """Where each peer's server listens ("host:port"); merged with earlier calls."""
        with self._lock:
            for peer, address in peers.items():
                sender = self._senders.get(peer)
                if sender is not None and sender.address != address:
                    raise TransportError(
                        f"{self._tag} {peer.describe()} moved from {sender.address} to "
                        f"{address} while messages were sent to it; a restarted peer "
                        f"belongs to a new incarnation of the job")
                self._peers[peer] = address

    def set_identity(self, label: Label, incarnation: int) -> None:
        """The label and incarnation the scheduler assigned, once the server is
        up (its address is part of the registration); before any message."""
        with self._lock:
            if self._senders:
                raise TransportError(
                    f"{self._tag} set_identity({label}, {incarnation}) after messages were "
                    f"sent; a process's identity is fixed once it talks to peers")
            self.label = label
            self.incarnation = incarnation
            self._tag = f"[{label.describe()}]"
            self._envelopes = EnvelopeWriter(str(label))
            self._mailbox = Mailbox(label, incarnation)
            if self._rules is not None:
                self._rules = dict(self._rules)  # forget envelopes checked before

    def expect(self, expected: Mapping[str, ExpectedChannel]) -> None:
        """The channels this process may receive (see `expected_channels`)."""
        self._rules = {name: _compile_rule(channel) for name, channel in expected.items()}
        self._rules_set.set()

    def _wait_rules(self) -> dict[str, _ChannelRule] | None:
        self._rules_set.wait(self.settings.expect_timeout_s)
        return self._rules

    # -- the Transport protocol --

    def send(self, dst: Label, key: MessageKey, tensors: Sequence[torch.Tensor]) -> None:
        """Queue `tensors` for `dst`; blocks only while dst's queue is full."""
        self._raise_if_failed()
        if self._is_closed:
            raise TransportError(
                f"{self._tag} send {key} to {dst.describe()}: the transport is closed")
        staged, events = _stage(tensors)
        encoded = encode(staged)
        header = self._envelopes.serialize(key, encoded)
        room = self.settings.max_request_bytes - self.settings.chunk_bytes - _CHUNK_OVERHEAD
        if len(header) > room:
            raise TransportError(
                f"{self._tag} send {key}: the envelope of {len(encoded.tensors)} tensors "
                f"takes {len(header)} bytes, more than the {room} that max_request_bytes "
                f"leaves beside a chunk; fuse fewer values per channel or raise it")
        nbytes = encoded.total_bytes + len(header)
        if not events and encoded.total_bytes <= _FRAME_AT_SEND_BYTES:
            (chunk,) = frame_message(header, encoded.views, encoded.total_bytes,
                                     self.settings.chunk_bytes)
            message = _Outgoing(key, nbytes, chunk=chunk)
        else:
            message = _Outgoing(key, nbytes, envelope=header, encoded=encoded, ready=events)
        self._sender(dst).put(message)
        logger.debug("%s queued %s for %s (%d bytes)", self._tag, key, dst,
                     encoded.total_bytes)

    def recv(self, src: Label, key: MessageKey, timeout_s: float,
             control=None) -> list[torch.Tensor]:
        """The tensors `src` sent under `key` (CPU tensors); `RecvTimeout` past the
        deadline. While waiting, a message under `control`'s key goes to its handler."""
        self._raise_if_failed()
        try:
            return self._mailbox.take(key, src, timeout_s, control)
        except TransportError as exc:
            if exc is self._error:
                self._error_raised = True
            raise

    def abort(self, error: BaseException) -> None:
        """Wake every pending receive of this process with `error`."""
        self._mailbox.abort(error)

    def finish_at(self, num_steps: int) -> None:
        """Receives for steps >= `num_steps` end with `JobFinished`."""
        self._mailbox.finish_at(num_steps)

    def route(self, prefix: str, handler) -> None:
        """Hand incoming messages on channels starting with `prefix` to `handler`."""
        self._mailbox.route(prefix, handler)

    def flush(self, timeout_s: float) -> None:
        """Wait until every message queued so far is confirmed delivered."""
        self._raise_if_failed()
        deadline = time.monotonic() + timeout_s
        with self._lock:
            senders = list(self._senders.values())
        try:
            for sender in senders:
                sender.flush(deadline)
        except TransportError as exc:
            if exc is self._error:
                self._error_raised = True
            raise

    def ping(self, dst: Label, timeout_s: float = 5.0) -> str:
        """The label `dst`'s server answers with; `TransportError` if it does not."""
        address = self._address_of(dst)
        with grpc.insecure_channel(address, options=_channel_options(self.settings)) as channel:
            call = channel.unary_unary(_PING, request_serializer=None, response_deserializer=None)
            try:
                raw = call(b"", timeout=timeout_s, metadata=((TOKEN_METADATA_KEY, self._token),),
                           wait_for_ready=True)
            except grpc.RpcError as err:
                raise TransportError(
                    f"{self._tag} ping {dst.describe()} at {address}: {err.code().name}: "
                    f"{err.details()}") from None
        return splitrun_pb2.PingReply.FromString(raw).label

    def close(self) -> None:
        """Flush queued sends (within close_timeout_s), stop the senders and the
        server; raises a failure nobody has been told about yet."""
        if self._is_closed:
            return
        self._is_closed = True
        deadline = time.monotonic() + self.settings.close_timeout_s
        with self._lock:
            senders = list(self._senders.values())
        for sender in senders:
            sender.close()
        problems = [error for error in (sender.join(deadline) for sender in senders) if error]
        for sender in senders:
            sender.shutdown()
        if self._server is not None:
            # Grace lets peers' streams to us confirm what they carried.
            grace = max(deadline - time.monotonic(), 0.0)
            self._server.stop(grace).wait(grace + _JOIN_GRACE_S)
            self._server_pool.shutdown(wait=False)
        self._pool.clear()
        logger.info("%s transport closed", self._tag)
        if problems:
            self._error_raised = True
            raise TransportError("; ".join(str(p) for p in problems))
        if self._error is not None and not self._error_raised:
            self._error_raised = True
            raise self._error

    # -- internals --

    def _address_of(self, peer: Label) -> str:
        address = self._peers.get(peer)
        if address is None:
            known = ", ".join(f"{p}={a}" for p, a in sorted(self._peers.items())) or "none"
            raise TransportError(
                f"{self._tag} no address for {peer.describe()}; set_peers() knows {known}")
        return address

    def _sender(self, peer: Label) -> _PeerSender:
        sender = self._senders.get(peer)
        if sender is None:
            with self._lock:
                sender = self._senders.get(peer)
                if sender is None:
                    sender = _PeerSender(self, peer, self._address_of(peer))
                    self._senders[peer] = sender
        return sender

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            self._error_raised = True
            raise self._error

    def _fatal(self, error: TransportError) -> None:
        """Remember the first failure and wake every receive with it."""
        with self._lock:
            if self._error is None:
                self._error = error
                logger.error("%s", error)
        self._mailbox.abort(self._error)
