"""The sending side of `GrpcTransport`: per peer, a send queue bounded in bytes
(`outgoing`) and the thread that carries it to the peer over `DeliverStream` calls.

`send()` only queues (the receiver buffers, so a send never waits for the
receiver's receive). One thread per peer drains a FIFO bounded in bytes into a
long-lived `DeliverStream` call that carries message after message: measured
here, a message on an open stream costs about a third of a unary call, and
large tensors are cut into chunks so no gRPC message limit is hit. A stream
ends when idle (or old), and the server's trailing metadata says how many
messages it delivered, so every message is confirmed. A peer that is not up
yet is retried until a connect deadline; any other failure is fatal: it
aborts this process's mailbox and is raised from the next `send`/`recv`.

Reaching a peer is a `Ping` call with `wait_for_ready`, made before the first
stream and after the peer was unavailable: not `grpc.channel_ready_future`,
whose connectivity-polling thread (gRPC's, not ours) outlives the future and
raised `ValueError: Cannot invoke RPC: Channel closed!` when the channel
closed at the end of a successful job.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import grpc

from splitrun.splitter.labels import Label

from ...errors import TransportError
from ...rpc.service import (
    DELIVER_STREAM_METHOD,
    DELIVERED_METADATA_KEY,
    PING_METHOD,
    TOKEN_METADATA_KEY,
)
from ...rpc.tls import TlsFiles
from ..endpoint import Endpoint
from ..framing import frame_message
from ..keys import MessageKey
from .outgoing import Outgoing, SendQueue
from .settings import GrpcSettings

# The parts `GrpcTransport` is built from.
__all__ = ["JOIN_GRACE_S", "PeerSender", "call_metadata", "channel_options", "open_channel"]

logger = logging.getLogger(__name__)

# A stream starts no new message after this many (bounds the bookkeeping of
# unconfirmed messages); the next message opens a new stream.
_MAX_STREAM_MESSAGES = 1 << 16
# Bounds how long a sender thread sleeps between checks while it waits for work.
_IDLE_POLL_S = 1.0
# Backoff between attempts to reach a peer that is not up yet.
_RETRY_BACKOFF_S = (0.05, 0.1, 0.2, 0.5, 1.0)
# Bounds the last joins of close() after its own deadline passed.
JOIN_GRACE_S = 2.0
# The shortest deadline a connect ping gets (gRPC refuses a deadline in the past).
_MIN_CALL_TIMEOUT_S = 0.01


@dataclass(eq=False)
class _StreamState:
    """What one DeliverStream call carried: its sender thread and its request
    generator (run by gRPC's thread) share it."""

    sent: list[MessageKey] = field(default_factory=list)  # fully handed to gRPC, in order
    current: Outgoing | None = None                      # being handed over
    error: BaseException | None = None                     # raised inside the generator
    ended: threading.Event = field(default_factory=threading.Event)


class PeerSender:
    """One peer's queue, and the thread that carries it over one stream at a time."""

    def __init__(self, endpoint: Endpoint, settings: GrpcSettings, tls: TlsFiles | None,
                 peer: Label, address: str) -> None:
        self.peer = peer
        self.address = address
        self._settings = settings
        self._tag = endpoint.tag
        self._metadata = call_metadata(endpoint.token)
        self._on_fatal = endpoint.fail  # a sender's failure fails the whole transport
        self._channel = open_channel(address, settings, tls)
        self._stream = self._channel.stream_unary(
            DELIVER_STREAM_METHOD, request_serializer=None, response_deserializer=None)
        self._ping = self._channel.unary_unary(
            PING_METHOD, request_serializer=None, response_deserializer=None)
        # False until a call reached the peer, and again once it was unavailable.
        self._is_reachable = False
        self._queue = SendQueue(self._settings.max_queued_bytes)
        self._stop = threading.Event()
        # The stream call or connect wait in progress, so close() can cancel it.
        self._future: grpc.Future | None = None
        # Messages queued, and messages the peer confirmed it delivered; flush()
        # waits for the second to catch up with the first.
        self._confirm = threading.Condition()
        self.num_queued = 0
        self.num_confirmed = 0
        self._num_flushing = 0
        self._error: TransportError | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"splitrun-send-{endpoint.label}->{peer}", daemon=True)
        self._thread.start()

    # -- called by the transport --

    def put(self, message: Outgoing) -> None:
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
        self._thread.join(JOIN_GRACE_S)
        return TransportError(
            f"{self._tag} could not flush {left} messages to {self.peer.describe()} at "
            f"{self.address} within close_timeout_s={self._settings.close_timeout_s:g} s")

    def shutdown(self) -> None:
        """Close the channel; after `join`, so no call of ours is in flight."""
        self._stop.set()
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
        except ValueError as exc:
            if not self._stop.is_set():
                raise
            # The channel was closed under a thread that outlived join()'s grace.
            logger.debug("%s sender to %s stopped: %s", self._tag, self.peer.describe(), exc)
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
        self._on_fatal(error)

    def _connect(self, head: Outgoing, since: float) -> None:
        """Wait until the peer answers a ping, up to the connect deadline (once,
        and again after the peer was unavailable)."""
        if self._is_reachable:
            return
        remaining = since + self._settings.connect_timeout_s - time.monotonic()
        future = self._ping.future(b"", timeout=max(remaining, _MIN_CALL_TIMEOUT_S),
                                   metadata=self._metadata, wait_for_ready=True)
        self._future = future
        try:
            future.result()
        except grpc.FutureCancelledError:
            raise TransportError(
                f"{self._tag} transport closed while connecting to "
                f"{self.peer.describe()} at {self.address} to send {head.key}") from None
        except grpc.RpcError as err:
            if err.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
                raise TransportError(
                    f"{self._tag} cannot reach {self.peer.describe()} at {self.address} to "
                    f"send {head.key}: no connection within "
                    f"connect_timeout_s={self._settings.connect_timeout_s:g} s; is "
                    f"{self.peer.describe()} running? (it may have exited; check its "
                    f"log)") from None
            raise TransportError(
                f"{self._tag} {self.peer.describe()} at {self.address} refused a ping before "
                f"{head.key}: {err.code().name}: {err.details()}") from None
        finally:
            self._future = None
        self._is_reachable = True

    def _stream_once(self, unreachable_since: float) -> bool:
        """Carry messages over one DeliverStream call until it idles; True once
        it delivered, False when the peer was unavailable and it should retry."""
        settings = self._settings
        state = _StreamState()
        deadline_s = settings.stream_max_s + settings.message_timeout_s
        future = self._stream.future(self._requests(state), timeout=deadline_s,
                                     metadata=self._metadata)
        self._future = future
        try:
            future.result(timeout=deadline_s + JOIN_GRACE_S)
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
            self._is_reachable = False
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


def call_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The call metadata every call to a peer carries: the job's token."""
    return ((TOKEN_METADATA_KEY, token),)


def open_channel(address: str, settings: GrpcSettings, tls: TlsFiles | None) -> grpc.Channel:
    """A channel to a peer's server: over TLS when the process has it."""
    options = channel_options(settings)
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, tls.channel_credentials(), options=options)


def channel_options(settings: GrpcSettings) -> list[tuple[str, int]]:
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
