"""The receiving side of `GrpcTransport`: the `TensorService` server, which
checks incoming messages against the plan and puts them in the mailbox.

Every call must carry the job's token; every message is checked against what
this process's plan expects (channel, sender, incarnation, dtypes, shapes, byte
counts) before a byte is buffered, and a refused message gets a gRPC status
naming what was expected and what came, is logged, and never reaches the
mailbox.
"""

from __future__ import annotations

import hmac
import logging
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import torch

from splitrun.splitter.errors import LabelError
from splitrun.splitter.labels import Label

from ..codec import (
    _IS_LITTLE_ENDIAN,
    MessageBuffer,
    MessageLayout,
    TensorSpec,
    dtype_name,
    is_step_free,
    parse_chunk,
    parse_envelope,
    specs_from_envelope,
    split_step,
)
from ...errors import MessageRejected
from .service import _SERVICE, DELIVERED_METADATA_KEY, TOKEN_METADATA_KEY
from ..protocol import MessageKey
from ..wire import splitrun_pb2

if TYPE_CHECKING:
    from .transport import ExpectedChannel, GrpcSettings, GrpcTransport

# Internal to `GrpcTransport`, which imports what it needs from here.
__all__: list[str] = []

logger = logging.getLogger(__name__)

# Messages above this are checked against the mailbox for duplicates before
# their data is received, not only after.
_EARLY_DUPLICATE_CHECK_BYTES = 1 << 20
# Bounds the checked envelopes a receiver remembers (about one per channel).
_MAX_KNOWN_ENVELOPES = 4096


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
    if expected.tensors is None or any(meta is None for meta in expected.tensors):
        return _ChannelRule(expected, str(expected.src), None, None)
    specs = [TensorSpec(dtype, tuple(shape)) for dtype, shape in expected.tensors]
    wire_metas = [(dtype_name(spec.dtype), spec.shape) for spec in specs]
    return _ChannelRule(expected, str(expected.src), wire_metas, MessageLayout(specs))


def _describe_meta(meta: tuple[torch.dtype, tuple[int, ...]] | None) -> str:
    return "any tensor" if meta is None else str(TensorSpec(meta[0], meta[1]))


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
        if expected.tensors is None:
            return  # a dynamic channel: its messages change size every time
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


def _server_options(settings: GrpcSettings) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", settings.max_request_bytes),
        ("grpc.max_send_message_length", settings.max_request_bytes),
        # Never share a port with another server by accident.
        ("grpc.so_reuseport", 0),
    ]
