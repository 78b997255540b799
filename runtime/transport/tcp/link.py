"""The sending side of the TCP data plane: one connection to one peer, and
its stripe connections.

`send` writes on the caller's thread, under the link's lock: the envelope
and the header in one write with a small message's data, a large message's
data straight from its tensors' memory (no copy in Python; the kernel's
copy only), like a shared-memory send it returns once the bytes are handed
over, and blocks only while the receiver's socket buffer is full (bounded
by message_timeout_s: a receiver that reads nothing). Nothing is read on
the connection except in `flush` (a SYNC answered by DELIVERED), so a TLS
connection is never used by two threads at once. A refusal comes back on
the connection (read by the next flush or failed send) and, at once, over
the gRPC control plane (see `server`).

A message of `stripe_min_bytes` or more is cut into one part per
connection (`stripes`): part 0 after the envelope on this thread, the
others by the stripes' threads at once; the send returns when every part
is with the kernel. A stripe whose write fails stops the message's other
writes at once and the send fails naming the peer and the stripe.
"""

from __future__ import annotations

import logging
import select
import socket
import ssl
import threading
import time

from splitrun.splitter.labels import Label

from ...errors import TransportError
from ..buffers import EncodedTensors
from ..keys import MessageKey
from . import wire
from .settings import TcpSettings
from .stripes import StripeSender, bounds, views_between

__all__ = ["DataLink", "connect"]

logger = logging.getLogger(__name__)

# How long a send waits for its stripes' threads beyond message_timeout_s
# (each of their writes is bounded by it already).
_STRIPE_GRACE_S = 5.0


def connect(tag: str, peer: Label, host: str, port: int, token: str,
            tls: ssl.SSLContext | None, settings: TcpSettings) -> DataLink:
    """Open the data connection to `peer`'s port, and its stripe connections
    (`settings.stripes`, when the server names the connection for them to
    join); each authenticates with the job's token and waits for the server
    to accept it, all within connect_timeout_s."""
    deadline = time.monotonic() + settings.connect_timeout_s
    sock, link_id = _open(tag, peer, host, port, token, tls, deadline, None)
    senders: list[StripeSender] = []
    link = DataLink(tag, peer, f"{host}:{port}", sock, settings)
    try:
        if len(link_id) == wire.LINK_ID_BYTES:  # an older server names none: no stripes
            for index in range(1, settings.stripes):
                stripe, _ = _open(tag, peer, host, port, token, tls, deadline,
                                  (link_id, index))
                stripe.settimeout(settings.message_timeout_s)
                senders.append(StripeSender(stripe, index, f"splitrun-tcp-stripe-{peer}-{index}",
                                            link.part_failed))
    except BaseException:
        for sender in senders:
            sender.stop(0.0)
            sender.sock.close()
        sock.close()
        raise
    sock.settimeout(settings.message_timeout_s)
    link.add_stripes(senders)
    return link


def _open(tag: str, peer: Label, host: str, port: int, token: str,
          tls: ssl.SSLContext | None, deadline: float,
          join: tuple[bytes, int] | None) -> tuple[socket.socket, bytes]:
    """One authenticated connection (a stripe when `join` says whose and
    which); the link id the server's ACCEPTED names it by."""
    where = f"{peer.describe()} at {host}:{port} (tcp)"
    if join is not None:
        where = f"{where}, stripe connection {join[1]}"
    try:
        sock = socket.create_connection((host.strip("[]"), port),
                                        timeout=max(deadline - time.monotonic(), 0.01))
    except OSError as exc:
        raise TransportError(f"{tag} cannot reach {where}: {exc}") from None
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls is not None:
            sock = tls.wrap_socket(sock, server_hostname=host.strip("[]"))
        sock.sendall(wire.hello(token))
        sock.settimeout(max(deadline - time.monotonic(), 0.01))
        link_id = _accepted(tag, where, sock)
        if join is not None:
            sock.sendall(wire.join(*join))
            _accepted(tag, where, sock)
    except (OSError, ssl.SSLError, wire.PeerClosed) as exc:
        sock.close()
        raise TransportError(f"{tag} cannot open the data connection to {where}: "
                             f"{type(exc).__name__}: {exc}") from None
    except BaseException:
        sock.close()
        raise
    return sock, link_id


def _accepted(tag: str, where: str, sock: socket.socket) -> bytes:
    """Read the server's ACCEPTED (its body); TransportError for anything else."""
    kind, body = _read_frame(sock)
    if kind == wire.REFUSED:
        _, status, details = wire.parse_refusal(body)
        raise TransportError(f"{tag} {where} refused the data connection: {status}: "
                             f"{details}")
    if kind != wire.ACCEPTED:
        raise TransportError(f"{tag} {where} answered the hello with frame kind {kind}")
    return body


def _read_frame(sock: socket.socket) -> tuple[int, bytes]:
    kind, length = wire.HEADER.unpack(wire.read_exact(sock, wire.HEADER.size))
    if length > wire.MAX_REPLY_BYTES:
        raise wire.PeerClosed(f"a reply of {length} bytes (at most {wire.MAX_REPLY_BYTES})")
    return kind, wire.read_exact(sock, length)


class DataLink:
    """One open, authenticated data connection to `peer` (see the module)."""

    def __init__(self, tag: str, peer: Label, address: str, sock: socket.socket,
                 settings: TcpSettings) -> None:
        self.peer = peer
        self.address = address
        self._tag = tag
        self._sock = sock
        self._settings = settings
        self._lock = threading.Lock()
        self._keys: list[MessageKey] = []  # sent since the last confirmation, in order
        self._num_sent = 0
        self._num_confirmed = 0
        self._error: TransportError | None = None
        self._is_closed = False
        self._stripes: list[StripeSender] = []
        # The first stripe write that failed during the message in flight:
        # (its stripe's index, the error).
        self._part_failure: tuple[int, BaseException] | None = None
        self._parts_aborted = False  # this thread stopped the stripes' writes

    def add_stripes(self, senders: list[StripeSender]) -> None:
        self._stripes = senders

    @property
    def num_connections(self) -> int:
        return 1 + len(self._stripes)

    def send(self, key: MessageKey, envelope: bytes, encoded: EncodedTensors) -> None:
        header = wire.HEADER.pack(wire.MESSAGE, len(envelope))
        with self._lock:
            if self._error is not None or self._is_closed:
                self._check(key)
            try:
                if encoded.total_bytes <= self._settings.coalesce_bytes:
                    self._sock.sendall(b"".join((header, envelope, *encoded.views)))
                elif self._stripes and encoded.total_bytes >= self._settings.stripe_min_bytes:
                    self._send_striped(envelope, encoded)
                else:
                    self._sock.sendall(header + envelope)
                    for view in encoded.views:
                        if view.nbytes:
                            self._sock.sendall(view)
            except (OSError, ssl.SSLError) as exc:
                raise self._broken(f"sending {key}", exc) from None
            self._num_sent += 1
            self._keys.append(key)

    def _send_striped(self, envelope: bytes, encoded: EncodedTensors) -> None:
        """Part 0 after the envelope on this thread, part k on stripe k's
        thread, all at once; returns when every part is with the kernel."""
        cuts = bounds(encoded.total_bytes, self.num_connections)
        self._part_failure, self._parts_aborted = None, False
        for sender, (start, end) in zip(self._stripes, cuts[1:]):
            sender.start(self._num_sent, views_between(encoded.views, start, end))
        error: BaseException | None = None
        try:
            self._sock.sendall(wire.split(self.num_connections, envelope))
            for view in views_between(encoded.views, *cuts[0]):
                self._sock.sendall(view)
        except (OSError, ssl.SSLError) as exc:
            error = exc
            self._parts_aborted = True  # their failures are these aborts, not a cause
            for sender in self._stripes:
                sender.abort()  # the message cannot arrive: stop its other parts now
        for sender in self._stripes:
            outcome = sender.wait(self._settings.message_timeout_s + _STRIPE_GRACE_S)
            error = error or outcome
        if self._part_failure is not None:  # the cause, not the aborts it made
            index, failed = self._part_failure
            if isinstance(failed, TimeoutError):
                raise failed
            raise ConnectionError(f"stripe connection {index}: {type(failed).__name__}: "
                                  f"{failed}")
        if error is not None:
            raise error

    def part_failed(self, sender: StripeSender, error: BaseException) -> None:
        """A stripe's write failed (on its thread): stop the message's other
        writes at once; the sending thread then reports `error`."""
        if self._part_failure is None and not self._parts_aborted:
            self._part_failure = (sender.index, error)
        for other in self._stripes:
            if other is not sender:
                other.abort()
        try:
            # Ends a write of part 0 blocked on this thread's connection; its
            # reading side stays open for a refusal the receiver sent.
            socket.socket.shutdown(self._sock, socket.SHUT_WR)
        except (OSError, ssl.SSLError):
            pass

    def flush(self, deadline: float) -> None:
        """Wait until the peer put every message sent so far in its mailbox."""
        with self._lock:
            if self._error is not None:
                raise self._error
            if self._num_confirmed == self._num_sent:
                return
            try:
                # A closing receiver says what it delivered before it goes.
                if self._read_waiting() and self._num_confirmed >= self._num_sent:
                    return
                self._sock.settimeout(max(deadline - time.monotonic(), 0.001))
                try:
                    self._sock.sendall(wire.frame(wire.SYNC))
                except (OSError, ssl.SSLError):
                    pass  # what the receiver said before it went is still readable
                while self._num_confirmed < self._num_sent:
                    self._take(*_read_frame(self._sock))
            except TimeoutError:
                raise TransportError(
                    f"{self._tag} flush: {self._num_sent - self._num_confirmed} messages to "
                    f"{self.peer.describe()} at {self.address} (tcp) not confirmed in "
                    f"time") from None
            except (OSError, ssl.SSLError, wire.PeerClosed) as exc:
                if self._num_confirmed < self._num_sent:
                    raise self._broken("a flush", exc) from None
            finally:
                if self._error is None:
                    self._sock.settimeout(self._settings.message_timeout_s)

    def _read_waiting(self) -> bool:
        """Take the frames already here without waiting; True if any came."""
        came = False
        while True:
            pending = isinstance(self._sock, ssl.SSLSocket) and self._sock.pending()
            if not pending and not select.select([self._sock], [], [], 0)[0]:
                return came
            self._take(*_read_frame(self._sock))
            came = True

    def _take(self, kind: int, body: bytes) -> None:
        if kind == wire.DELIVERED:
            self._confirm(wire.count_of(body))
        elif kind == wire.REFUSED:
            raise self._refused(body)
        else:
            raise self._fail(f"{self._tag} {self.peer.describe()} at {self.address} (tcp) "
                             f"sent frame kind {kind}; expected a delivery count")

    def close(self, deadline: float) -> TransportError | None:
        """Flush, say goodbye, close; the flush's failure, if any."""
        problem = None
        if self._error is None:  # a known failure was reported already
            try:
                self.flush(deadline)
            except TransportError as exc:
                problem = exc
        with self._lock:
            self._is_closed = True
            for sock in [self._sock] + [sender.sock for sender in self._stripes]:
                if problem is None:
                    try:
                        sock.sendall(wire.frame(wire.BYE))
                    except (OSError, ssl.SSLError):
                        pass
            for sender in self._stripes:
                sender.stop(max(deadline - time.monotonic(), 0.0))
                sender.sock.close()
            self._sock.close()
        return problem

    # -- internals (under the lock) --

    def _check(self, key: MessageKey) -> None:
        if self._error is not None:
            raise self._error
        if self._is_closed:
            raise TransportError(f"{self._tag} send {key} to {self.peer.describe()}: the "
                                 f"transport is closed")

    def _confirm(self, count: int) -> None:
        done = count - self._num_confirmed
        if done > 0:
            del self._keys[:done]
            self._num_confirmed = count

    def _fail(self, text: str) -> TransportError:
        self._error = TransportError(text)
        return self._error

    def _refused(self, body: bytes) -> TransportError:
        count, status, details = wire.parse_refusal(body)
        self._confirm(count)
        what = f"sending {self._keys[0]}" if self._keys else "a message"
        return self._fail(f"{self._tag} {what} to {self.peer.describe()} at {self.address} "
                          f"(tcp) failed: {status}: {details}")

    def _broken(self, what: str, exc: BaseException) -> TransportError:
        """The connection broke: the peer's refusal if it sent one before
        closing, else the peer is gone."""
        if isinstance(exc, TimeoutError):
            return self._fail(
                f"{self._tag} {what} to {self.peer.describe()} at {self.address} (tcp) failed: "
                f"DEADLINE_EXCEEDED: the receiver took nothing for message_timeout_s="
                f"{self._settings.message_timeout_s:g} s")
        try:
            self._sock.settimeout(1.0)
            kind, body = _read_frame(self._sock)
            if kind == wire.REFUSED:
                return self._refused(body)
        except (OSError, ssl.SSLError, wire.PeerClosed, ValueError):
            pass
        return self._fail(
            f"{self._tag} {what} to {self.peer.describe()} at {self.address} (tcp) failed: "
            f"UNAVAILABLE: {type(exc).__name__}: {exc}; {self.peer.describe()} is gone or "
            f"unreachable")
