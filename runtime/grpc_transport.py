"""`GrpcTransport`: the `Transport` protocol over real gRPC between processes.

Receiving: one `TensorService` server per process. Every call must carry the
job's token; every message is checked against what this process's plan
expects (channel, sender, incarnation, dtypes, shapes, byte counts) before a
byte is buffered, and a refused message gets a gRPC status naming what was
expected and what came, is logged, and never reaches the mailbox.

Sending: `send()` only queues (the receiver buffers, so a send never waits for
the receiver's receive). One thread per peer drains a FIFO bounded in bytes
into a long-lived `DeliverStream` call that carries message after message:
measured here, a message on an open stream costs about a third of a unary
call, and large tensors are cut into chunks so no gRPC message limit is hit.
A stream ends when idle (or old), and the server's trailing metadata says how
many messages it delivered, so every message is confirmed. A peer that is not
up yet is retried until a connect deadline; any other failure is fatal: it
aborts this process's mailbox and is raised from the next `send`/`recv`.
"""

from __future__ import annotations

import hmac
import logging
import queue
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import torch

from splitrun.splitter.errors import LabelError
from splitrun.splitter.labels import Label
from splitrun.splitter.plan import SplitPlan
from splitrun.splitter.program import Program

from .codec import (
    DEFAULT_MAX_MESSAGE_BYTES,
    BufferPool,
    EncodedTensors,
    EnvelopeWriter,
    MessageBuffer,
    MessageLayout,
    TensorSpec,
    dtype_name,
    encode,
    frame_message,
    is_step_free,
    parse_chunk,
    parse_envelope,
    specs_from_envelope,
    split_step,
)
from .errors import MessageRejected, TransportError
from .mailbox import Mailbox
from .transport import MessageKey
from .wire import splitrun_pb2

__all__ = ["GrpcTransport", "GrpcSettings", "ExpectedChannel", "expected_channels",
           "TOKEN_METADATA_KEY"]

logger = logging.getLogger(__name__)

TOKEN_METADATA_KEY = "splitrun-token"
# Trailing metadata of Deliver/DeliverStream: how many messages the server
# delivered to its mailbox, so the sender knows which message a refusal hit.
DELIVERED_METADATA_KEY = "splitrun-delivered"

_SERVICE = splitrun_pb2.DESCRIPTOR.services_by_name["TensorService"].full_name
_DELIVER = f"/{_SERVICE}/Deliver"
_DELIVER_STREAM = f"/{_SERVICE}/DeliverStream"
_PING = f"/{_SERVICE}/Ping"

# Room for a Chunk's framing besides its data and envelope.
_CHUNK_OVERHEAD = 64
# CPU messages up to this size are framed (copied) in send() itself: cheaper
# than framing them later on gRPC's thread, and the caller's tensors are free
# again at once.
_FRAME_AT_SEND_BYTES = 64 << 10
# A stream starts no new message after this many (bounds the bookkeeping of
# unconfirmed messages); the next message opens a new stream.
_MAX_STREAM_MESSAGES = 1 << 16
# Bounds how long a sender thread sleeps between checks while it waits for work.
_IDLE_POLL_S = 1.0
# Messages above this are checked against the mailbox for duplicates before
# their data is received, not only after.
_EARLY_DUPLICATE_CHECK_BYTES = 1 << 20
_IS_LITTLE_ENDIAN = sys.byteorder == "little"
# Bounds the checked envelopes a receiver remembers (about one per channel).
_MAX_KNOWN_ENVELOPES = 4096
# Backoff between attempts to reach a peer that is not up yet.
_RETRY_BACKOFF_S = (0.05, 0.1, 0.2, 0.5, 1.0)
# Bounds the last joins of close() after its own deadline passed.
_JOIN_GRACE_S = 2.0


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
    tensors: tuple[tuple[torch.dtype, tuple[int, ...]] | None, ...]

    def __post_init__(self) -> None:
        # Shapes compare as tuples of ints, whatever sequence the caller gave.
        normal = tuple(None if meta is None else (meta[0], tuple(int(d) for d in meta[1]))
                       for meta in self.tensors)
        object.__setattr__(self, "tensors", normal)


def expected_channels(plan: SplitPlan, program: Program | None, label: Label
                      ) -> dict[str, ExpectedChannel]:
    """What `label` may receive under `plan`: from `plan.recv_channels(label)`
    and the dtype/shape each value has in the program's graph."""
    program = program or plan.program
    if program is None:
        raise TransportError("expected_channels needs the program the plan was split from")
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


@dataclass(frozen=True, slots=True)
class _ChannelRule:
    """An `ExpectedChannel` compiled for the receive path: a message whose
    envelope matches `wire_metas` needs no further checks, and its buffer
    layout is computed once."""

    expected: ExpectedChannel
    src_text: str
    wire_metas: list[tuple[str, tuple[int, ...]]] | None  # None: some shape is dynamic
    layout: MessageLayout | None


def _compile_rule(expected: ExpectedChannel) -> _ChannelRule:
    if any(meta is None for meta in expected.tensors):
        return _ChannelRule(expected, str(expected.src), None, None)
    specs = [TensorSpec(dtype, tuple(shape)) for dtype, shape in expected.tensors]
    wire_metas = [(dtype_name(spec.dtype), spec.shape) for spec in specs]
    return _ChannelRule(expected, str(expected.src), wire_metas, MessageLayout(specs))


def _describe_meta(meta: tuple[torch.dtype, tuple[int, ...]] | None) -> str:
    return "any tensor" if meta is None else str(TensorSpec(meta[0], meta[1]))


def _format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


# -- receiving -------------------------------------------------------------------


class _Refusal(Exception):
    """Internal: a request this server refuses with `code`; never leaves the module."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


@dataclass(eq=False, slots=True)
class _Incoming:
    key: MessageKey
    src: Label
    buffer: MessageBuffer


class _Receiver:
    """Checks incoming messages against the plan and puts them in the mailbox.

    An envelope that passed the checks is remembered without its step (see
    `EnvelopeWriter`): the next step's envelope of the same channel is then
    recognised by its bytes, without parsing or checking it again.
    """

    def __init__(self, transport: GrpcTransport) -> None:
        self._transport = transport
        # Keys whose data is on the wire; dict operations are atomic, so two
        # streams carrying the same key cannot both pass.
        self._inflight: dict[MessageKey, object] = {}
        self._known: dict[bytes, tuple[_ChannelRule, MessageLayout, int, str]] = {}
        self._known_rules: dict[str, _ChannelRule] | None = None

    @property
    def _tag(self) -> str:
        return self._transport._tag

    def _refuse(self, code: grpc.StatusCode, where: str, why: str) -> _Refusal:
        return _Refusal(code, f"{self._tag} refused {where}: {why}")

    def begin(self, raw: memoryview, peer: str) -> _Incoming:
        """Check a serialized envelope and reserve a buffer for its message."""
        transport = self._transport
        split = split_step(raw)
        if split is not None and self._known_rules is transport._rules:
            # A bytes key: hashing a memoryview hashes the whole chunk under it.
            known = self._known.get(split[1].tobytes())
            if known is not None:
                rule, layout, incarnation, channel = known
                return self._reserve(MessageKey(incarnation, split[0], channel), rule, layout,
                                     peer)
        try:
            envelope = parse_envelope(raw)
        except MessageRejected as exc:
            raise _Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                           f"{self._tag} refused a message from {peer}: {exc}") from None
        rules = transport._rules if transport._rules is not None else transport._wait_rules()
        rule = rules.get(envelope.channel) if rules is not None else None
        if (rule is not None and rule.wire_metas is not None
                and envelope.incarnation == transport.incarnation
                and envelope.src == rule.src_text
                and envelope.total_bytes == rule.layout.total_bytes
                and envelope.little_endian == _IS_LITTLE_ENDIAN
                and [(m.dtype, tuple(m.shape)) for m in envelope.tensors] == rule.wire_metas):
            layout = rule.layout  # exactly what the plan expects
        else:
            layout = self._check(envelope, peer, rules)
            rule = rules[envelope.channel]
        if split is not None and split[0] == envelope.step and is_step_free(split[1]):
            if self._known_rules is not rules or len(self._known) >= _MAX_KNOWN_ENVELOPES:
                self._known = {}
                self._known_rules = rules
            self._known[split[1].tobytes()] = (rule, layout, envelope.incarnation,
                                               envelope.channel)
        return self._reserve(MessageKey(envelope.incarnation, envelope.step, envelope.channel),
                             rule, layout, peer)

    def _reserve(self, key: MessageKey, rule: _ChannelRule, layout: MessageLayout,
                 peer: str) -> _Incoming:
        """Claim `key` for this message and allocate its buffer."""
        src = rule.expected.src
        marker = object()
        if (self._inflight.setdefault(key, marker) is not marker
                or (layout.total_bytes > _EARLY_DUPLICATE_CHECK_BYTES
                    and key in self._transport._mailbox.pending())):
            if self._inflight.get(key) is marker:
                del self._inflight[key]
            raise _Refusal(
                grpc.StatusCode.ALREADY_EXISTS,
                f"{self._tag} refused a second message for {key} from {src.describe()} "
                f"({peer}): the first is already here or on its way; each is sent once")
        try:
            buffer = MessageBuffer(layout, self._transport._pool)
        except (MemoryError, RuntimeError) as exc:
            self._release(key)
            raise self._refuse(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"{key} from {src.describe()} ({peer})",
                               f"cannot allocate {layout.buffer_bytes} bytes: {exc}") from None
        return _Incoming(key, src, buffer)

    @staticmethod
    def _where(envelope: splitrun_pb2.Envelope, peer: str) -> str:
        return (f"channel {envelope.channel[:200]!r} step {envelope.step} from "
                f"{envelope.src[:40]!r} ({peer})")

    def _check(self, envelope: splitrun_pb2.Envelope, peer: str,
               rules: dict[str, _ChannelRule] | None) -> MessageLayout:
        """The full check of an envelope the fast path did not pass: refuse it
        with the precise reason, or return the layout of a channel whose
        shapes the plan leaves open."""
        transport = self._transport
        where = self._where(envelope, peer)
        if envelope.incarnation != transport.incarnation:
            raise self._refuse(
                grpc.StatusCode.FAILED_PRECONDITION, where,
                f"incarnation {envelope.incarnation}, but the job's incarnation is "
                f"{transport.incarnation}; the sender belongs to "
                f"{'a previous' if envelope.incarnation < transport.incarnation else 'a newer'} "
                f"run of the job")
        if rules is None:
            raise self._refuse(
                grpc.StatusCode.FAILED_PRECONDITION, where,
                f"this process has no plan yet (expect() not called within "
                f"{transport.settings.expect_timeout_s:g} s)")
        rule = rules.get(envelope.channel)
        if rule is None:
            known = ", ".join(sorted(rules)[:8]) or "none"
            raise self._refuse(
                grpc.StatusCode.NOT_FOUND, where,
                f"no such channel into this process (it receives {known}"
                f"{', ...' if len(rules) > 8 else ''}); the sender's plan differs from "
                f"this one: same script and cluster on every process?")
        try:
            src = Label.parse(envelope.src)
        except LabelError as exc:
            raise self._refuse(grpc.StatusCode.INVALID_ARGUMENT, where, str(exc)) from None
        if src is not rule.expected.src:
            raise self._refuse(
                grpc.StatusCode.PERMISSION_DENIED, where,
                f"this channel comes from {rule.expected.src.describe()}, the envelope "
                f"says {src.describe()}")
        try:
            specs = specs_from_envelope(envelope, max_bytes=transport.settings.max_message_bytes)
        except MessageRejected as exc:
            raise self._refuse(grpc.StatusCode.INVALID_ARGUMENT, where, str(exc)) from None
        self._check_specs(where, specs, rule.expected)
        return MessageLayout(specs)

    def _check_specs(self, where: str, specs: Sequence[TensorSpec],
                     expected: ExpectedChannel) -> None:
        if len(specs) != len(expected.tensors):
            raise self._refuse(
                grpc.StatusCode.INVALID_ARGUMENT, where,
                f"expected {len(expected.tensors)} tensors, got {len(specs)}; the "
                f"sender's plan differs from this one")
        for index, (spec, meta) in enumerate(zip(specs, expected.tensors)):
            if meta is not None and (spec.dtype, spec.shape) != meta:
                raise self._refuse(
                    grpc.StatusCode.INVALID_ARGUMENT, where,
                    f"tensor {index} expected {_describe_meta(meta)}, got {spec}; the "
                    f"sender's step differs from the plan (same script and batch shapes "
                    f"on every process? autocast changing dtypes?)")

    def finish(self, incoming: _Incoming, peer: str) -> None:
        """Hand a complete message to the mailbox."""
        key = incoming.key
        try:
            # The incarnation was checked, so the mailbox refuses only a
            # duplicate that arrived while this one was on the wire.
            self._transport._mailbox.put(key, incoming.src, incoming.buffer.tensors())
        except MessageRejected as exc:  # already names this process, key and sender
            raise _Refusal(grpc.StatusCode.ALREADY_EXISTS, f"{exc} ({peer})") from None
        finally:
            self._inflight.pop(key, None)
        logger.debug("%s received %s from %s", self._tag, key, incoming.src)

    def _release(self, key: MessageKey) -> None:
        self._inflight.pop(key, None)

    def discard(self, incoming: _Incoming | None) -> None:
        """Forget a message whose stream broke off."""
        if incoming is not None:
            self._release(incoming.key)


class _Servicer:
    """The TensorService handlers: raw bytes in, parsed and checked here, so bad
    bytes get INVALID_ARGUMENT with a reason instead of gRPC's generic error."""

    def __init__(self, transport: GrpcTransport) -> None:
        self._transport = transport
        self._receiver = _Receiver(transport)
        self._token = transport._token.encode()

    @property
    def _tag(self) -> str:
        return self._transport._tag

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(_SERVICE, {
            "Deliver": grpc.unary_unary_rpc_method_handler(self.deliver),
            "DeliverStream": grpc.stream_unary_rpc_method_handler(self.deliver_stream),
            "Ping": grpc.unary_unary_rpc_method_handler(self.ping),
        })

    def _abort(self, context: grpc.ServicerContext, refusal: _Refusal, delivered: int) -> None:
        logger.warning("%s (%s, %s)", refusal.details, refusal.code.name, context.peer())
        context.set_trailing_metadata(((DELIVERED_METADATA_KEY, str(delivered)),))
        context.abort(refusal.code, refusal.details)

    def _check_token(self, context: grpc.ServicerContext) -> None:
        tokens = [value for key, value in (context.invocation_metadata() or ())
                  if key == TOKEN_METADATA_KEY]
        if not tokens:
            why = f"no {TOKEN_METADATA_KEY!r} in the call metadata"
        elif not hmac.compare_digest(str(tokens[0]).encode(), self._token):
            why = "the job token is wrong"
        else:
            return
        self._abort(context, _Refusal(
            grpc.StatusCode.UNAUTHENTICATED,
            f"{self._tag} refused a call from {context.peer()}: {why}; every process of "
            f"a job must use the job's token"), 0)

    def _internal(self, exc: Exception, peer: str, incoming: _Incoming | None) -> _Refusal:
        """A bug on this side: INTERNAL, with this process and the traceback."""
        what = "a message" if incoming is None else f"{incoming.key}"
        logger.exception("%s failed on %s from %s", self._tag, what, peer)
        return _Refusal(grpc.StatusCode.INTERNAL,
                        f"{self._tag} failed on {what} from {peer}: {type(exc).__name__}: "
                        f"{exc}\n{traceback.format_exc()}")

    def deliver(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        """One whole message in one Chunk."""
        return self._receive((raw,), context, is_unary=True)

    def deliver_stream(self, requests, context: grpc.ServicerContext) -> bytes:
        """Messages back to back: a chunk with an envelope starts each one."""
        return self._receive(requests, context, is_unary=False)

    def _receive(self, requests, context: grpc.ServicerContext, *, is_unary: bool) -> bytes:
        """Check and deliver the messages in `requests`; the first refusal ends
        the call, its trailing metadata saying how many were delivered."""
        self._check_token(context)
        peer = context.peer()
        receiver = self._receiver
        incoming = None
        delivered = 0
        failure = None
        try:
            for raw in requests:
                try:
                    envelope, data = parse_chunk(raw)
                    if envelope is not None:
                        if incoming is not None:
                            raise MessageRejected(
                                f"a new envelope came after {incoming.buffer.received} of "
                                f"the message's {incoming.buffer.total_bytes} bytes")
                        incoming = receiver.begin(envelope, peer)
                    elif incoming is None:
                        raise MessageRejected(
                            "a chunk without an envelope; a message's first chunk must "
                            "carry its envelope")
                    buffer = incoming.buffer
                    buffer.write(data)
                except MessageRejected as exc:
                    what = "a request" if incoming is None else f"{incoming.key}"
                    raise _Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"{self._tag} refused {what} from {peer}: {exc}") from None
                if buffer.received == buffer.layout.total_bytes:
                    receiver.finish(incoming, peer)
                    incoming = None
                    delivered += 1
            if incoming is not None:
                how, fix = ("Deliver carried", "; a message in several chunks goes through "
                            "DeliverStream") if is_unary else ("the stream ended after", "")
                raise _Refusal(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{self._tag} refused {incoming.key} from {peer}: {how} "
                    f"{incoming.buffer.received} of the envelope's "
                    f"{incoming.buffer.total_bytes} bytes{fix}")
        except _Refusal as refusal:
            failure = refusal
        except grpc.RpcError:
            # The sender cancelled or went away mid-stream; it reports that itself.
            logger.debug("%s stream from %s broke off after %d messages", self._tag,
                         peer, delivered)
            return b""
        except Exception as exc:  # noqa: BLE001 - reported to the sender as INTERNAL
            failure = self._internal(exc, peer, incoming)
        finally:
            receiver.discard(incoming)
        if failure is not None:
            self._abort(context, failure, delivered)
        context.set_trailing_metadata(((DELIVERED_METADATA_KEY, str(delivered)),))
        return b""

    def ping(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        self._check_token(context)
        return splitrun_pb2.PingReply(label=str(self._transport.label)).SerializeToString()


# -- sending ---------------------------------------------------------------------


@dataclass(eq=False, slots=True)
class _Outgoing:
    """A queued message: either already framed (`chunk`, small CPU messages,
    copied at send time) or framed when its turn comes (`encoded` views)."""

    key: MessageKey
    nbytes: int
    chunk: bytes | None = None
    envelope: bytes = b""
    encoded: EncodedTensors | None = None
    ready: tuple = ()  # CUDA events to wait on before the bytes may be read


class _SendQueue:
    """A FIFO bounded in bytes. `put` blocks while the queue is over its bound
    (a message larger than the bound goes when the queue is empty); the head
    stays queued until its last byte is handed to gRPC, then `pop` frees it.

    The consumer is woken through a `queue.SimpleQueue` of tokens, which
    measured several times cheaper than a `threading.Condition` on the
    small-message path; a condition serves only senders held back by the bound.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._items: deque[_Outgoing] = deque()
        self._bytes = 0
        self._lock = threading.Lock()
        self._space = threading.Condition(self._lock)
        self._num_waiting = 0  # senders held back by the bound
        self._signal: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._is_closed = False
        self._error: BaseException | None = None

    def put(self, item: _Outgoing, timeout_s: float) -> bool:
        """Queue `item`; False if the bound held it back for `timeout_s`."""
        with self._lock:
            if self._bytes and self._bytes + item.nbytes > self.max_bytes:
                deadline = time.monotonic() + timeout_s
                self._num_waiting += 1
                try:
                    while self._bytes and self._bytes + item.nbytes > self.max_bytes:
                        if self._error is not None:
                            raise self._error
                        remaining = deadline - time.monotonic()
                        if remaining <= 0:
                            return False
                        self._space.wait(remaining)
                finally:
                    self._num_waiting -= 1
            if self._error is not None:
                raise self._error
            if self._is_closed:
                raise TransportError("the transport is closed; nothing more is sent")
            self._items.append(item)
            self._bytes += item.nbytes
        self._signal.put(None)
        return True

    def peek(self, timeout_s: float, stop: Callable[[], bool] = lambda: False,
             end_when_empty: Callable[[], bool] = lambda: False) -> _Outgoing | None:
        """The head, waiting up to `timeout_s`; None when failed or stopped, when
        closed (or `end_when_empty`) and empty, or when nothing came in time."""
        deadline = None
        while True:
            if self._error is not None or stop():
                return None
            items = self._items
            if items:
                return items[0]
            if self._is_closed or end_when_empty():
                return None
            if deadline is None:
                deadline = time.monotonic() + timeout_s
                remaining = timeout_s
            else:
                remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            try:
                self._signal.get(timeout=remaining)
            except queue.Empty:
                return None

    def pop(self, item: _Outgoing) -> None:
        with self._lock:
            if self._items and self._items[0] is item:
                self._items.popleft()
                self._bytes -= item.nbytes
                if self._num_waiting:
                    self._space.notify_all()

    def close(self) -> None:
        self._is_closed = True
        self.wake()

    def wake(self) -> None:
        """Make a waiting `peek` look again (at its predicates, too)."""
        self._signal.put(None)

    def fail(self, error: BaseException) -> list[_Outgoing]:
        """Refuse further puts with `error`; return the messages dropped."""
        with self._lock:
            self._error = error
            dropped = list(self._items)
            self._items.clear()
            self._bytes = 0
            self._space.notify_all()
        self._signal.put(None)
        return dropped

    @property
    def is_closed(self) -> bool:
        return self._is_closed

    def __len__(self) -> int:
        return len(self._items)

    @property
    def nbytes(self) -> int:
        return self._bytes


@dataclass(eq=False)
class _StreamState:
    """What one DeliverStream call carried: its sender thread and its request
    generator (run by gRPC's thread) share it."""

    sent: list[MessageKey] = field(default_factory=list)  # fully handed to gRPC, in order
    current: _Outgoing | None = None                      # being handed over
    error: BaseException | None = None                     # raised inside the generator
    ended: threading.Event = field(default_factory=threading.Event)


class _PeerSender:
    """One peer's queue, and the thread that carries it over one stream at a time."""

    def __init__(self, transport: GrpcTransport, peer: Label, address: str) -> None:
        self.peer = peer
        self.address = address
        self._transport = transport
        self._settings = transport.settings
        self._tag = transport._tag
        self._metadata = ((TOKEN_METADATA_KEY, transport._token),)
        self._channel = grpc.insecure_channel(address, options=_channel_options(self._settings))
        self._stream = self._channel.stream_unary(
            _DELIVER_STREAM, request_serializer=None, response_deserializer=None)
        self._queue = _SendQueue(self._settings.max_queued_bytes)
        self._stop = threading.Event()
        # The stream call or connect wait in progress, so close() can cancel it.
        self._future: grpc.Future | None = None
        self.num_streams = 0
        # Messages queued, and messages the peer confirmed it delivered; flush()
        # waits for the second to catch up with the first.
        self._confirm = threading.Condition()
        self.num_queued = 0
        self.num_confirmed = 0
        self._num_flushing = 0
        self._error: TransportError | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"splitrun-send-{transport.label}->{peer}", daemon=True)
        self._thread.start()

    # -- called by the transport --

    def put(self, message: _Outgoing) -> None:
        if not self._queue.put(message, self._settings.send_timeout_s):
            raise TransportError(
                f"{self._tag} send {message.key} to {self.peer.describe()}: blocked for "
                f"{self._settings.send_timeout_s:g} s behind {self._queue.nbytes} queued "
                f"bytes (max_queued_bytes {self._settings.max_queued_bytes}); "
                f"{self.peer.describe()} at {self.address} is not draining them")
        with self._confirm:
            self.num_queued += 1

    def flush(self, deadline: float) -> None:
        """Wait until the peer confirmed every message queued so far: the
        stream ends as soon as the queue is empty, and its end confirms."""
        with self._confirm:
            target = self.num_queued
            self._num_flushing += 1
        self._queue.wake()
        try:
            with self._confirm:
                while self.num_confirmed < target:
                    if self._error is not None:
                        raise self._error
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise TransportError(
                            f"{self._tag} flush: {target - self.num_confirmed} messages to "
                            f"{self.peer.describe()} at {self.address} not confirmed in time; "
                            f"{len(self._queue)} still queued")
                    self._confirm.wait(remaining)
        finally:
            with self._confirm:
                self._num_flushing -= 1

    def _confirmed(self, count: int) -> None:
        with self._confirm:
            self.num_confirmed += count
            self._confirm.notify_all()

    def close(self) -> None:
        """Stop taking messages; the thread flushes the queue, then exits."""
        self._queue.close()

    def join(self, deadline: float) -> TransportError | None:
        """Wait for the flush until `deadline`; past it, cancel and report."""
        self._thread.join(max(deadline - time.monotonic(), 0))
        if not self._thread.is_alive():
            return None
        left = len(self._queue)
        self._stop.set()
        future = self._future
        if future is not None:
            future.cancel()
        self._queue.fail(TransportError(f"{self._tag} transport closed"))
        self._thread.join(_JOIN_GRACE_S)
        return TransportError(
            f"{self._tag} could not flush {left} messages to {self.peer.describe()} at "
            f"{self.address} within close_timeout_s={self._settings.close_timeout_s:g} s")

    def shutdown(self) -> None:
        self._channel.close()

    # -- the thread --

    def _run(self) -> None:
        try:
            unreachable_since: float | None = None
            while True:
                head = self._queue.peek(_IDLE_POLL_S)
                if head is None:
                    if self._queue.is_closed or self._stop.is_set():
                        return
                    continue
                if unreachable_since is None:
                    unreachable_since = time.monotonic()
                self._connect(head, unreachable_since)
                if self._stream_once(unreachable_since):
                    unreachable_since = None
        except TransportError as error:
            self._fail(error)
        except Exception as exc:  # noqa: BLE001 - any bug here must reach the caller
            logger.exception("%s sender to %s crashed", self._tag, self.peer.describe())
            self._fail(TransportError(
                f"{self._tag} sender to {self.peer.describe()} crashed: "
                f"{type(exc).__name__}: {exc}"))

    def _fail(self, error: TransportError) -> None:
        with self._confirm:
            self._error = error
            self._confirm.notify_all()
        dropped = self._queue.fail(error)
        if dropped and not self._stop.is_set():
            logger.error("%s dropping %d queued messages to %s: %s", self._tag, len(dropped),
                         self.peer.describe(), error)
        self._transport._fatal(error)

    def _connect(self, head: _Outgoing, since: float) -> None:
        """Wait until the peer accepts connections, up to the connect deadline."""
        remaining = since + self._settings.connect_timeout_s - time.monotonic()
        ready = grpc.channel_ready_future(self._channel)
        self._future = ready
        try:
            ready.result(timeout=max(remaining, 0))
        except (grpc.FutureTimeoutError, grpc.FutureCancelledError):
            ready.cancel()
            raise TransportError(
                f"{self._tag} cannot reach {self.peer.describe()} at {self.address} to "
                f"send {head.key}: no connection within "
                f"connect_timeout_s={self._settings.connect_timeout_s:g} s; is "
                f"{self.peer.describe()} running? (it may have exited; check its log)") from None
        finally:
            self._future = None

    def _stream_once(self, unreachable_since: float) -> bool:
        """Carry messages over one DeliverStream call until it idles; True once
        it delivered, False when the peer was unavailable and it should retry."""
        settings = self._settings
        state = _StreamState()
        deadline_s = settings.stream_max_s + settings.message_timeout_s
        self.num_streams += 1
        future = self._stream.future(self._requests(state), timeout=deadline_s,
                                     metadata=self._metadata)
        self._future = future
        try:
            future.result(timeout=deadline_s + _JOIN_GRACE_S)
            status, details, trailing = grpc.StatusCode.OK, "", future.trailing_metadata()
        except grpc.FutureCancelledError:
            status, details, trailing = grpc.StatusCode.CANCELLED, "cancelled at close", None
        except grpc.FutureTimeoutError:
            future.cancel()
            status, details, trailing = grpc.StatusCode.DEADLINE_EXCEEDED, "no reply", None
        except grpc.RpcError as err:
            status, details, trailing = err.code(), err.details(), err.trailing_metadata()
        finally:
            state.ended.set()
            self._queue.wake()  # let a generator still waiting in peek() return
            self._future = None
        delivered = _delivered_count(trailing)
        if status is grpc.StatusCode.OK and delivered == len(state.sent):
            self._confirmed(delivered)
            return True
        if state.error is not None:
            raise TransportError(
                f"{self._tag} preparing {state.current.key if state.current else 'a message'} "
                f"for {self.peer.describe()} failed: {state.error}") from state.error
        if status is grpc.StatusCode.UNAVAILABLE and (not state.sent
                                                     or delivered == len(state.sent)):
            self._confirmed(len(state.sent))
            self._backoff(unreachable_since, status, details)
            return False
        raise self._stream_error(state, status, details, delivered)

    def _backoff(self, since: float, status: grpc.StatusCode, details: str) -> None:
        elapsed = time.monotonic() - since
        if elapsed >= self._settings.connect_timeout_s:
            raise TransportError(
                f"{self._tag} cannot deliver to {self.peer.describe()} at {self.address}: "
                f"{status.name} for {elapsed:.1f} s (connect_timeout_s="
                f"{self._settings.connect_timeout_s:g}): {details}")
        attempt = min(int(elapsed / 0.2), len(_RETRY_BACKOFF_S) - 1)
        logger.warning("%s %s unavailable (%s); retrying", self._tag, self.peer.describe(),
                       details)
        self._stop.wait(_RETRY_BACKOFF_S[attempt])

    def _stream_error(self, state: _StreamState, status: grpc.StatusCode, details: str,
                      delivered: int | None) -> TransportError:
        """The fatal error for a stream that failed: which message, which status."""
        if delivered is not None and delivered < len(state.sent):
            what = f"sending {state.sent[delivered]}"
        elif state.current is not None:
            what = f"sending {state.current.key}"
        else:
            what = "the stream"
        lost = ""
        if delivered is None and state.sent:
            lost = (f"; {len(state.sent)} messages on this stream are unconfirmed "
                    f"(last {state.sent[-1]})")
        hint = {
            grpc.StatusCode.UNAVAILABLE: f"; {self.peer.describe()} is gone or unreachable",
            grpc.StatusCode.DEADLINE_EXCEEDED: "; the transfer took longer than its deadline",
        }.get(status, "")
        return TransportError(
            f"{self._tag} {what} to {self.peer.describe()} at {self.address} failed: "
            f"{status.name}: {details}{hint}{lost}")

    def _requests(self, state: _StreamState):
        """The stream's requests; run by gRPC's thread, which pulls one chunk,
        writes it, then pulls the next (so at most one chunk is in flight)."""
        settings = self._settings
        started = time.monotonic()
        stop = lambda: state.ended.is_set() or self._stop.is_set()  # noqa: E731
        flushing = lambda: self._num_flushing > 0  # noqa: E731
        try:
            while (time.monotonic() - started < settings.stream_max_s
                   and len(state.sent) < _MAX_STREAM_MESSAGES):
                message = self._queue.peek(settings.stream_idle_s, stop, flushing)
                if message is None:
                    return
                state.current = message
                if message.chunk is not None:
                    yield message.chunk
                else:
                    for event in message.ready:
                        event.synchronize()
                    yield from frame_message(message.envelope, message.encoded.views,
                                             message.encoded.total_bytes, settings.chunk_bytes)
                self._queue.pop(message)
                state.sent.append(message.key)
                state.current = None
                logger.debug("%s sent %s to %s", self._tag, message.key, self.peer)
        except Exception as exc:
            state.error = exc
            raise


def _delivered_count(trailing) -> int | None:
    for key, value in trailing or ():
        if key == DELIVERED_METADATA_KEY:
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _channel_options(settings: GrpcSettings) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", settings.max_request_bytes),
        ("grpc.max_receive_message_length", settings.max_request_bytes),
        # We retry ourselves, knowing which messages were delivered.
        ("grpc.enable_retries", 0),
        # A peer that is starting: reconnect quickly, not after gRPC's 1 s+.
        ("grpc.initial_reconnect_backoff_ms", 50),
        ("grpc.min_reconnect_backoff_ms", 50),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]


def _server_options(settings: GrpcSettings) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", settings.max_request_bytes),
        ("grpc.max_send_message_length", settings.max_request_bytes),
        # Never share a port with another server by accident.
        ("grpc.so_reuseport", 0),
    ]


def _stage(tensors: Sequence[torch.Tensor]) -> tuple[Sequence[torch.Tensor], tuple]:
    """CPU tensors for the wire, and the CUDA events to wait on before reading
    them: CUDA tensors are copied into pinned host memory without blocking (torch's
    caching host allocator recycles the pinned blocks); CPU ones pass as they are."""
    for tensor in tensors:
        if not tensor.is_cpu:
            break
    else:
        return tensors, ()
    staged = []
    devices = set()
    for tensor in tensors:
        if tensor.is_cpu:
            staged.append(tensor)
        elif tensor.is_cuda and torch.cuda.is_available():
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor.detach(), non_blocking=True)
            staged.append(host)
            devices.add(tensor.device)
        else:
            staged.append(tensor.detach().to("cpu"))
    events = []
    for device in sorted(devices, key=str):
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events.append(event)
    return staged, tuple(events)


# -- the transport ----------------------------------------------------------------


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
