"""The receiving side of `GrpcTransport`: the `TensorService` server, which
checks incoming messages against their receive contracts and puts them in
the mailbox.

Every call must carry the job's token; every message is checked (its
incarnation, its envelope's byte counts, and its channel's contract: sender,
dtypes, shapes) before a byte is buffered, and a refused message gets a gRPC status
naming what was expected and what came, is logged, and never reaches the
mailbox.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Mapping
from dataclasses import dataclass

import grpc

from splitrun.splitter.errors import LabelError
from splitrun.splitter.labels import Label

from ...errors import ChannelMismatch, MessageRejected, UnknownChannel, WrongSender
from ...rpc.auth import one_line
from ...rpc.service import DELIVERED_METADATA_KEY, SERVICE_NAME, TOKEN_METADATA_KEY
from ...rpc.wire import splitrun_pb2
from ..buffers import MessageBuffer, MessageLayout
from ..contract import ChannelContract, check_message, find_contract, refusal_prefix
from ..dtypes import IS_LITTLE_ENDIAN, dtype_name
from ..framing import is_step_free, parse_chunk, parse_envelope, specs_from_envelope, split_step
from ..keys import MessageKey
from ..mailbox import Mailbox
from .endpoint import CurrentEndpoint, Endpoint, GrpcSettings

# The parts `GrpcTransport` is built from.
__all__ = ["TensorServicer", "server_options"]

logger = logging.getLogger(__name__)

# Messages above this are checked against the mailbox for duplicates before
# their data is received, not only after.
_EARLY_DUPLICATE_CHECK_BYTES = 1 << 20
# Bounds the checked envelopes a receiver remembers (about one per channel).
_MAX_KNOWN_ENVELOPES = 4096


@dataclass(frozen=True, slots=True)
class _ChannelRule:
    """A `ChannelContract` compiled for the receive path: a message whose
    envelope matches `wire_metas` (and comes from `src_text`) meets the
    contract, and its buffer layout is computed once."""

    contract: ChannelContract
    src_text: str
    wire_metas: list[tuple[str, tuple[int, ...]]] | None  # None: some shape is dynamic
    layout: MessageLayout | None


def _compile_rule(contract: ChannelContract) -> _ChannelRule:
    if not contract.is_static:
        return _ChannelRule(contract, str(contract.src), None, None)
    wire_metas = [(dtype_name(spec.dtype), spec.shape) for spec in contract.tensors]
    return _ChannelRule(contract, str(contract.src), wire_metas, MessageLayout(contract.tensors))


class _Refusal(Exception):
    """Internal: a request this server refuses with `code`; never leaves the module."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


# The status each kind of broken contract is refused with.
_MISMATCH_CODES = {UnknownChannel: grpc.StatusCode.NOT_FOUND,
                   WrongSender: grpc.StatusCode.PERMISSION_DENIED}


@dataclass(eq=False, slots=True)
class _Incoming:
    key: MessageKey
    src: Label
    buffer: MessageBuffer
    mailbox: Mailbox  # the endpoint's, when the message came


class _Receiver:
    """Checks incoming messages against their receive contracts and puts them
    in the mailbox.

    The fast path is the contract compiled (`_ChannelRule`): an envelope equal
    to it meets the contract; any other envelope gets the full check
    (`check_message`). An envelope that passed is remembered without its step
    (see `EnvelopeWriter`): the next step's envelope of the same channel is
    then recognised by its bytes, without parsing or checking it again.
    """

    def __init__(self, current: CurrentEndpoint) -> None:
        self._current = current
        # Keys whose data is on the wire; dict operations are atomic, so two
        # streams carrying the same key cannot both pass.
        self._inflight: dict[MessageKey, object] = {}
        # Compiled rules and remembered envelopes, valid for one endpoint and
        # one contract table; forgotten when either is replaced.
        self._valid_for: tuple[Endpoint, Mapping[str, ChannelContract]] | None = None
        self._rules: dict[str, _ChannelRule] = {}
        self._known: dict[bytes, tuple[_ChannelRule, MessageLayout, int, str]] = {}

    def _table(self, endpoint: Endpoint) -> Mapping[str, ChannelContract] | None:
        """The contract table, waiting for `expect` if a message came first."""
        # Returns at once once `expect` has run; a message that came first waits.
        table = endpoint.contracts.wait(endpoint.settings.expect_timeout_s)
        valid_for = self._valid_for
        if valid_for is None or valid_for[0] is not endpoint or valid_for[1] is not table:
            self._valid_for = (endpoint, table)
            self._rules = {}
            self._known = {}
        return table

    def _rule(self, table: Mapping[str, ChannelContract], channel: str) -> _ChannelRule | None:
        rule = self._rules.get(channel)
        if rule is None:
            contract = table.get(channel)
            if contract is None:
                return None
            rule = self._rules[channel] = _compile_rule(contract)
        return rule

    def begin(self, raw: memoryview, peer: str) -> _Incoming:
        """Check a serialized envelope and reserve a buffer for its message."""
        endpoint = self._current.endpoint
        table = self._table(endpoint)
        split = split_step(raw)
        if split is not None:
            # A bytes key: hashing a memoryview hashes the whole chunk under it.
            known = self._known.get(split[1].tobytes())
            if known is not None:
                rule, layout, incarnation, channel = known
                return self._reserve(endpoint, MessageKey(incarnation, split[0], channel),
                                     rule, layout, peer)
        try:
            envelope = parse_envelope(raw)
        except MessageRejected as exc:
            raise _Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                           f"{endpoint.tag} refused a message from {peer}: {exc}") from None
        rule = self._rule(table, envelope.channel) if table is not None else None
        if (rule is not None and rule.wire_metas is not None
                and envelope.incarnation == endpoint.incarnation
                and envelope.src == rule.src_text
                and envelope.total_bytes == rule.layout.total_bytes
                and envelope.little_endian == IS_LITTLE_ENDIAN
                and [(m.dtype, tuple(m.shape)) for m in envelope.tensors] == rule.wire_metas):
            layout = rule.layout  # exactly what the contract says
        else:
            layout = self._check(endpoint, table, envelope, peer)
            rule = self._rule(table, envelope.channel)
        if split is not None and split[0] == envelope.step and is_step_free(split[1]):
            if len(self._known) >= _MAX_KNOWN_ENVELOPES:
                self._known = {}
            self._known[split[1].tobytes()] = (rule, layout, envelope.incarnation,
                                               envelope.channel)
        return self._reserve(endpoint,
                             MessageKey(envelope.incarnation, envelope.step, envelope.channel),
                             rule, layout, peer)

    def _reserve(self, endpoint: Endpoint, key: MessageKey, rule: _ChannelRule,
                 layout: MessageLayout, peer: str) -> _Incoming:
        """Claim `key` for this message and allocate its buffer."""
        src = rule.contract.src
        mailbox = endpoint.mailbox
        marker = object()
        if (self._inflight.setdefault(key, marker) is not marker
                or (layout.total_bytes > _EARLY_DUPLICATE_CHECK_BYTES and mailbox.holds(key))):
            if self._inflight.get(key) is marker:
                del self._inflight[key]
            raise _Refusal(
                grpc.StatusCode.ALREADY_EXISTS,
                f"{endpoint.tag} refused a second message for {key} from {src.describe()} "
                f"({peer}): the first is already here or on its way; each is sent once")
        try:
            buffer = MessageBuffer(layout, endpoint.pool)
        except (MemoryError, RuntimeError) as exc:
            self._release(key)
            raise _Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"{endpoint.tag} refused {key} from {src.describe()} ({peer}): "
                           f"cannot allocate {layout.buffer_bytes} bytes: {exc}") from None
        return _Incoming(key, src, buffer, mailbox)

    def _check(self, endpoint: Endpoint, table: Mapping[str, ChannelContract] | None,
               envelope: splitrun_pb2.Envelope, peer: str) -> MessageLayout:
        """The full check of an envelope the fast path did not pass: refuse it
        with the precise reason, or return the layout of a channel whose
        shapes the contract leaves open."""
        key = MessageKey(envelope.incarnation, envelope.step, envelope.channel)
        where = refusal_prefix(endpoint.label, key, envelope.src, peer)

        def refuse(code: grpc.StatusCode, why: str) -> _Refusal:
            return _Refusal(code, f"{where}: {why}")

        if envelope.incarnation != endpoint.incarnation:
            raise refuse(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"incarnation {envelope.incarnation}, but the job's incarnation is "
                f"{endpoint.incarnation}; the sender belongs to "
                f"{'a previous' if envelope.incarnation < endpoint.incarnation else 'a newer'} "
                f"run of the job")
        if table is None:
            raise refuse(
                grpc.StatusCode.FAILED_PRECONDITION,
                endpoint.contracts.why_no_table(endpoint.settings.expect_timeout_s))
        try:
            contract = find_contract(table, key, envelope.src, receiver=endpoint.label,
                                     via=peer)
            try:
                src = Label.parse(envelope.src)
            except LabelError as exc:
                raise refuse(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
            specs = specs_from_envelope(envelope,
                                        max_bytes=endpoint.settings.max_message_bytes)
            check_message(contract, key, src, specs, receiver=endpoint.label, via=peer)
        except ChannelMismatch as exc:  # says where itself
            raise _Refusal(_MISMATCH_CODES.get(type(exc), grpc.StatusCode.INVALID_ARGUMENT),
                           str(exc)) from None
        except MessageRejected as exc:  # the envelope's own checks
            raise refuse(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        return MessageLayout(specs)

    def finish(self, incoming: _Incoming, peer: str) -> None:
        """Hand a complete message to the mailbox."""
        key = incoming.key
        try:
            # The incarnation was checked, so the mailbox refuses only a
            # duplicate that arrived while this one was on the wire.
            incoming.mailbox.put(key, incoming.src, incoming.buffer.tensors())
        except MessageRejected as exc:  # already names this process, key and sender
            raise _Refusal(grpc.StatusCode.ALREADY_EXISTS, f"{exc} ({peer})") from None
        finally:
            self._inflight.pop(key, None)
        logger.debug("%s received %s from %s", self._current.endpoint.tag, key, incoming.src)

    def _release(self, key: MessageKey) -> None:
        self._inflight.pop(key, None)

    def discard(self, incoming: _Incoming | None) -> None:
        """Forget a message whose stream broke off."""
        if incoming is not None:
            self._release(incoming.key)


class TensorServicer:
    """The TensorService handlers: raw bytes in, parsed and checked here, so bad
    bytes get INVALID_ARGUMENT with a reason instead of gRPC's generic error."""

    def __init__(self, current: CurrentEndpoint) -> None:
        self._current = current
        self._receiver = _Receiver(current)

    @property
    def _tag(self) -> str:
        return self._current.endpoint.tag

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(SERVICE_NAME, {
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
        elif not hmac.compare_digest(str(tokens[0]).encode(),
                                     self._current.endpoint.token.encode()):
            why = "the job token is wrong"
        else:
            return
        self._abort(context, _Refusal(
            grpc.StatusCode.UNAUTHENTICATED,
            f"{self._tag} refused a call from {context.peer()}: {why}; every process of "
            f"a job must use the job's token"), 0)

    def _internal(self, exc: Exception, peer: str, incoming: _Incoming | None) -> _Refusal:
        """A bug on this side: INTERNAL with one line naming this process; the
        traceback goes to this process's log, never to the caller."""
        what = "a message" if incoming is None else f"{incoming.key}"
        logger.exception("%s failed on %s from %s", self._tag, what, peer)
        return _Refusal(grpc.StatusCode.INTERNAL,
                        f"{self._tag} failed on {what} from {peer}: {type(exc).__name__}: "
                        f"{one_line(str(exc))}")

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
        return splitrun_pb2.PingReply(label=str(self._current.endpoint.label)).SerializeToString()


def server_options(settings: GrpcSettings) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", settings.max_request_bytes),
        ("grpc.max_send_message_length", settings.max_request_bytes),
        # Never share a port with another server by accident.
        ("grpc.so_reuseport", 0),
    ]
