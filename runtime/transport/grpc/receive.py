"""The receiving side of `GrpcTransport`: the `TensorService` server, which
admits incoming messages into the process's `Endpoint` and puts them in its
mailbox.

Every call must carry the job's token; every message is admitted (its
incarnation, its envelope's byte counts, and its channel's contract: sender,
dtypes, shapes; `admission`, the check shared memory runs too) before a byte
is buffered, and a refused message gets a gRPC status naming what was
expected and what came, is logged, and never reaches the mailbox.
"""

from __future__ import annotations

import hmac
import logging
from dataclasses import dataclass

import grpc

from splitrun.splitter.labels import Label

from ...errors import MessageRejected, UnknownChannel, WrongSender
from ...rpc.auth import one_line
from ...rpc.service import DELIVERED_METADATA_KEY, SERVICE_NAME, TOKEN_METADATA_KEY
from ...rpc.wire import splitrun_pb2
from ..admission import Admission, NotAdmitted
from ..buffers import MessageBuffer, MessageLayout
from ..endpoint import Endpoint
from ..framing import parse_chunk
from ..keys import MessageKey
from ..mailbox import Mailbox
from .settings import GrpcSettings

# The parts `GrpcTransport` is built from.
__all__ = ["TensorServicer", "server_options"]

logger = logging.getLogger(__name__)

# Messages above this are checked against the mailbox for duplicates before
# their data is received, not only after.
_EARLY_DUPLICATE_CHECK_BYTES = 1 << 20


class _Refusal(Exception):
    """Internal: a request this server refuses with `code`; never leaves the module."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


def _refusal_of(exc: MessageRejected) -> _Refusal:
    """The status each kind of refusal is answered with; its text says where."""
    if isinstance(exc, NotAdmitted):
        code = grpc.StatusCode.FAILED_PRECONDITION
    elif isinstance(exc, UnknownChannel):
        code = grpc.StatusCode.NOT_FOUND
    elif isinstance(exc, WrongSender):
        code = grpc.StatusCode.PERMISSION_DENIED
    else:
        code = grpc.StatusCode.INVALID_ARGUMENT
    return _Refusal(code, str(exc))


@dataclass(eq=False, slots=True)
class _Incoming:
    key: MessageKey
    src: Label
    buffer: MessageBuffer
    mailbox: Mailbox  # the endpoint's, when the message came


class _Receiver:
    """Admits incoming messages (`Admission`, the check every transport
    shares), reserves their buffers and puts them in the mailbox; refuses a
    second message for a key already on its way."""

    def __init__(self, endpoint: Endpoint) -> None:
        self._endpoint = endpoint
        self._admission = Admission(endpoint)
        # Keys whose data is on the wire; dict operations are atomic, so two
        # streams carrying the same key cannot both pass.
        self._inflight: dict[MessageKey, object] = {}

    def begin(self, raw: memoryview, peer: str) -> _Incoming:
        """Check a serialized envelope and reserve a buffer for its message."""
        try:
            admitted = self._admission.admit(raw, peer)
        except MessageRejected as exc:
            raise _refusal_of(exc) from None
        return self._reserve(admitted.receiver.tag, admitted.receiver.mailbox, admitted.key,
                             admitted.src, admitted.layout, peer)

    def _reserve(self, tag: str, mailbox: Mailbox, key: MessageKey, src: Label,
                 layout: MessageLayout, peer: str) -> _Incoming:
        """Claim `key` for this message and allocate its buffer."""
        marker = object()
        if (self._inflight.setdefault(key, marker) is not marker
                or (layout.total_bytes > _EARLY_DUPLICATE_CHECK_BYTES and mailbox.holds(key))):
            if self._inflight.get(key) is marker:
                del self._inflight[key]
            raise _Refusal(
                grpc.StatusCode.ALREADY_EXISTS,
                f"{tag} refused a second message for {key} from {src.describe()} "
                f"({peer}): the first is already here or on its way; each is sent once")
        try:
            buffer = MessageBuffer(layout, self._endpoint.pool)
        except (MemoryError, RuntimeError) as exc:
            self._release(key)
            raise _Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"{tag} refused {key} from {src.describe()} ({peer}): "
                           f"cannot allocate {layout.buffer_bytes} bytes: {exc}") from None
        return _Incoming(key, src, buffer, mailbox)

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
        logger.debug("%s received %s from %s", self._endpoint.tag, key, incoming.src)

    def _release(self, key: MessageKey) -> None:
        self._inflight.pop(key, None)

    def discard(self, incoming: _Incoming | None) -> None:
        """Forget a message whose stream broke off."""
        if incoming is not None:
            self._release(incoming.key)


class TensorServicer:
    """The TensorService handlers: raw bytes in, parsed and checked here, so bad
    bytes get INVALID_ARGUMENT with a reason instead of gRPC's generic error."""

    def __init__(self, endpoint: Endpoint) -> None:
        self._endpoint = endpoint
        self._receiver = _Receiver(endpoint)

    @property
    def _tag(self) -> str:
        return self._endpoint.tag

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
                                     self._endpoint.token.encode()):
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
        return splitrun_pb2.PingReply(label=str(self._endpoint.label)).SerializeToString()


def server_options(settings: GrpcSettings) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", settings.max_request_bytes),
        ("grpc.max_send_message_length", settings.max_request_bytes),
        # Never share a port with another server by accident.
        ("grpc.so_reuseport", 0),
    ]
