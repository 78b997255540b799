"""The receiving side of the TCP data plane: a listening socket and one
thread per incoming connection.

A connection must open with the job's token (`wire.hello`, read within
`hello_timeout_s`, over TLS when the job has TLS) before any frame of it is
read; a wrong or missing token is refused with UNAUTHENTICATED and the
connection closed. Then frames are read through the connection's fixed
read-ahead buffer (`reader`: one recv for a small message), and each message
is admitted (`admission`, the check the gRPC server and the shared-memory
rings run) from its envelope alone, before its data is given a place: a small
one-tensor message becomes its own copy of the bytes (`tensor_over`), a
larger message's data goes (beyond what the read-ahead holds) straight from
the kernel into the pooled buffer its tensors will view (`MessageBuffer`). A
refused message ends the connection: its refusal (a gRPC status name and
the admission's text) goes back on the connection, and by `refuse` (the
gRPC control plane) so that the sender fails at once, as a gRPC refusal
would. No traceback goes to a caller: an unexpected error is INTERNAL with
one line, its traceback in this process's log.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Callable

import torch

from splitrun.splitter.labels import Label

from ...errors import MessageRejected, UnknownChannel, WrongSender
from ...rpc.auth import one_line
from ..admission import Admission, Admitted, NotAdmitted
from ..buffers import SMALL_TENSOR_BYTES, MessageBuffer, tensor_over
from ..endpoint import Endpoint
from ..framing import parse_envelope
from ..keys import MessageKey
from . import wire
from .reader import FrameReader
from .settings import TcpSettings
from .stripes import StripeFailed, StripeGroup, bounds, views_between

__all__ = ["DataServer", "status_of", "Refuse"]

logger = logging.getLogger(__name__)

# Messages above this are checked against the mailbox for duplicates before
# their data is received, not only after.
_EARLY_DUPLICATE_CHECK_BYTES = 1 << 20
# How long a refused connection's remaining bytes are read and dropped.
_DRAIN_S = 1.0
# Bounds the joins of close() after its own deadline passed.
_JOIN_GRACE_S = 2.0

# How a refusal reaches its sender besides the connection: `refuse(src, why)`.
Refuse = Callable[[Label, str], None]


def status_of(exc: MessageRejected) -> str:
    """The gRPC status name a refusal is answered with (as the gRPC server does)."""
    if isinstance(exc, NotAdmitted):
        return "FAILED_PRECONDITION"
    if isinstance(exc, UnknownChannel):
        return "NOT_FOUND"
    if isinstance(exc, WrongSender):
        return "PERMISSION_DENIED"
    return "INVALID_ARGUMENT"


class _Refusal(Exception):
    def __init__(self, status: str, details: str, src: Label | None = None) -> None:
        super().__init__(details)
        self.status = status
        self.details = details
        self.src = src


class DataServer:
    """Listens on `host` (port 0 picks one) and admits messages into `endpoint`."""

    def __init__(self, endpoint: Endpoint, *, settings: TcpSettings,
                 tls: ssl.SSLContext | None, refuse: Refuse) -> None:
        self.endpoint = endpoint
        self.settings = settings
        self._tls = tls
        self._refuse = refuse
        self._listener: socket.socket | None = None
        self._accepting: threading.Thread | None = None
        self._connections: dict[int, socket.socket] = {}
        # Per connection: True once its hello passed. From then on only a frame
        # begun is read with a deadline: a timeout is the sender's stall, not an
        # idle connection (see `reader`).
        self._past_hello: dict[int, bool] = {}
        self._threads: list[threading.Thread] = []
        # Per main connection, by the link id its ACCEPTED told: where its
        # stripe connections join (`stripes`).
        self._groups: dict[bytes, StripeGroup] = {}
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self.port: int | None = None

    @property
    def _tag(self) -> str:
        return self.endpoint.tag

    def start(self, host: str) -> int:
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.bind((host.strip("[]"), 0))
        listener.listen(64)
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._accepting = threading.Thread(target=self._accept, daemon=True,
                                           name=f"splitrun-tcp-accept-{self.endpoint.label}")
        self._accepting.start()
        return self.port

    def close(self, deadline_s: float) -> None:
        """Stop accepting, end every connection (each ends at a frame boundary
        or mid-message: the sender's flush reports what was not delivered)."""
        self._closing.set()
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
            except OSError:
                pass
            self._listener.close()
        with self._lock:
            connections = list(self._connections.values())
            threads = list(self._threads)
        for conn in connections:
            try:
                # Wakes the connection's thread at a frame boundary; it tells
                # the sender how many messages it delivered, then closes.
                # (socket's own shutdown: an SSLSocket's would drop its TLS state
                # under the thread reading it.)
                socket.socket.shutdown(conn, socket.SHUT_RD)
            except OSError:
                pass
        if self._accepting is not None:
            self._accepting.join(_JOIN_GRACE_S)
        for thread in threads:
            thread.join(max(deadline_s, _JOIN_GRACE_S))

    # -- threads --

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                conn, address = self._listener.accept()
            except OSError:
                return  # closed
            thread = threading.Thread(target=self._serve, args=(conn, address), daemon=True,
                                      name=f"splitrun-tcp-recv-{self.endpoint.label}")
            with self._lock:
                self._connections[id(conn)] = conn
                self._threads = [t for t in self._threads if t.is_alive()] + [thread]
            thread.start()

    def _serve(self, conn: socket.socket, address) -> None:
        peer = f"{address[0]}:{address[1]} (tcp)"
        delivered = 0
        sock = conn
        group = StripeGroup(secrets.token_bytes(wire.LINK_ID_BYTES))
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(self.settings.hello_timeout_s)
            if self._tls is not None:
                sock = self._tls.wrap_socket(conn, server_side=True)  # detaches conn
                with self._lock:
                    self._connections[id(conn)] = sock
            self._check_hello(sock, peer)
            with self._lock:
                self._groups[group.link_id] = group
            sock.sendall(wire.frame(wire.ACCEPTED, group.link_id))
            delivered = self._messages(sock, peer, id(conn), group)
        except _Refusal as refusal:
            self._tell(sock, refusal, delivered, peer)
        except TimeoutError:
            if self._closing.is_set() or not self._past_hello.get(id(conn)):
                # A caller that said nothing within hello_timeout_s: dropped.
                logger.warning("%s dropped a data connection from %s: no hello within "
                               "hello_timeout_s=%g s", self._tag, peer,
                               self.settings.hello_timeout_s)
            else:
                self._tell(sock, _Refusal(
                    "DEADLINE_EXCEEDED",
                    f"{self._tag} dropped a data connection from {peer}: the sender "
                    f"stalled mid-message for message_timeout_s="
                    f"{self.settings.message_timeout_s:g} s"), delivered, peer)
        except StripeFailed as exc:
            # A stripe of this connection's message ended or stalled: the
            # message is dropped; the sender's send or flush reports it.
            logger.warning("%s dropped a message from %s: %s", self._tag, peer, exc)
        except (OSError, ssl.SSLError, wire.PeerClosed) as exc:
            # The sender went away or closed; it reports that itself.
            logger.debug("%s data connection from %s ended: %s", self._tag, peer, exc)
        except Exception as exc:  # noqa: BLE001 - reported to the sender as INTERNAL
            logger.exception("%s data connection from %s failed", self._tag, peer)
            self._tell(sock, _Refusal("INTERNAL", f"{self._tag} failed on a message from "
                                      f"{peer}: {type(exc).__name__}: {one_line(str(exc))}"),
                       delivered, peer)
        finally:
            with self._lock:
                self._connections.pop(id(conn), None)
                self._past_hello.pop(id(conn), None)
                self._groups.pop(group.link_id, None)
            group.fail(f"the main connection from {peer} ended")
            sock.close()

    def _tell(self, sock: socket.socket, refusal: _Refusal, delivered: int, peer: str) -> None:
        logger.warning("%s (%s, %s)", refusal.details, refusal.status, peer)
        if refusal.src is not None:  # first: the sender may be blocked in a receive
            self._refuse(refusal.src, f"{refusal.status}: {refusal.details}")
        try:
            sock.sendall(wire.refusal(delivered, refusal.status, refusal.details))
            _drain(sock)
        except (OSError, ssl.SSLError):
            pass

    def _check_hello(self, sock: socket.socket, peer: str) -> None:
        """The job's token, before any frame is read."""
        head = wire.read_exact(sock, len(wire.MAGIC) + 2)
        if head[:len(wire.MAGIC)] != wire.MAGIC:
            raise _Refusal("UNAUTHENTICATED",
                           f"{self._tag} refused a data connection from {peer}: it did not "
                           f"open with splitrun's hello; every process of a job must use the "
                           f"job's token")
        length = wire.token_length(head[len(wire.MAGIC):])
        if length > wire.MAX_TOKEN_BYTES:
            why = f"a token of {length} bytes (at most {wire.MAX_TOKEN_BYTES})"
        else:
            token = wire.read_exact(sock, length)
            if hmac.compare_digest(token, self.endpoint.token.encode()):
                return
            why = "the job token is wrong" if length else "no job token in its hello"
        raise _Refusal("UNAUTHENTICATED",
                       f"{self._tag} refused a data connection from {peer}: {why}; every "
                       f"process of a job must use the job's token")

    def _messages(self, sock: socket.socket, peer: str, conn_id: int,
                  group: StripeGroup) -> int:
        """Frames until BYE or the end of the connection; messages delivered.
        A connection whose first frame is JOIN is a stripe (`_stripe`)."""
        admission = Admission(self.endpoint)
        reader = FrameReader(sock, self.settings.message_timeout_s)
        self._past_hello[conn_id] = True  # from now on a timeout is a stall mid-frame
        delivered = 0
        first = True
        while True:
            try:
                kind, length = reader.header()
            except (wire.PeerClosed, ssl.SSLError, OSError):
                if self._closing.is_set():
                    # This process closes: the sender's flush learns what arrived.
                    _try_send(sock, wire.delivered(delivered))
                    return delivered
                raise
            if kind == wire.MESSAGE and length <= wire.MAX_ENVELOPE_BYTES:
                self._receive(reader, admission, reader.take(length), peer)
                delivered += 1
                first = False
                continue
            if kind == wire.JOIN and first and length <= wire.MAX_REPLY_BYTES:
                joined, index = self._join(reader.take(length).tobytes(), sock, peer)
                self._stripe(reader, f"{peer}, stripe connection {index}", joined, index)
                return 0
            first = False
            if kind == wire.SYNC and length == 0:
                sock.sendall(wire.delivered(delivered))
                continue
            if kind == wire.BYE and length == 0:
                return delivered
            if kind not in (wire.MESSAGE, wire.SPLIT):
                raise _Refusal("INVALID_ARGUMENT",
                               f"{self._tag} refused a frame from {peer}: kind {kind} with "
                               f"{length} bytes; expected a message, a sync or a bye")
            if length > wire.MAX_ENVELOPE_BYTES:
                raise _Refusal("INVALID_ARGUMENT",
                               f"{self._tag} refused a message from {peer}: an envelope of "
                               f"{length} bytes (at most {wire.MAX_ENVELOPE_BYTES})")
            body = reader.take(length)
            parts = body[0] if length else 0
            if not 2 <= parts <= wire.MAX_STRIPES:
                raise _Refusal("INVALID_ARGUMENT",
                               f"{self._tag} refused a message from {peer}: split in "
                               f"{parts} parts (2 to {wire.MAX_STRIPES})")
            self._receive(reader, admission, body[1:], peer, (group, delivered, parts))
            delivered += 1

    def _join(self, body: bytes, sock: socket.socket, peer: str) -> tuple[StripeGroup, int]:
        """A stripe connection joins its main connection's group: which, as
        which stripe."""
        try:
            link_id, index = wire.parse_join(body)
        except ValueError as exc:
            raise _Refusal("INVALID_ARGUMENT",
                           f"{self._tag} refused a stripe connection from {peer}: {exc}") from None
        with self._lock:
            group = self._groups.get(link_id)
        if group is None or not group.join(index, sock):
            raise _Refusal("INVALID_ARGUMENT",
                           f"{self._tag} refused a stripe connection from {peer}: it names no "
                           f"open data connection, or stripe {index} of it is taken or out of "
                           f"range (1 to {wire.MAX_STRIPES - 1})")
        sock.sendall(wire.frame(wire.ACCEPTED))
        return group, index

    def _stripe(self, reader: FrameReader, peer: str, group: StripeGroup, index: int) -> None:
        """A stripe connection's frames: PART (its bytes go where the main
        connection posted them, once it admitted the message) until BYE."""
        timeout = self.settings.message_timeout_s
        try:
            while True:
                try:
                    kind, length = reader.header()
                except (wire.PeerClosed, ssl.SSLError, OSError):
                    if self._closing.is_set():
                        return
                    raise
                if kind == wire.BYE and length == 0:
                    return
                if kind != wire.PART or length != 8:
                    raise _Refusal("INVALID_ARGUMENT",
                                   f"{self._tag} refused a frame from {peer}: kind {kind} "
                                   f"with {length} bytes; expected a part or a bye")
                seq = wire.seq_of(reader.take(length))
                try:
                    views = group.take(seq, index, timeout)
                except StripeFailed:
                    return  # the main connection ended, and says why
                for view in views:
                    reader.read_into(view)
                group.done(seq, index)
        except BaseException as exc:
            group.fail(f"{self._tag}: the data connection from {peer} failed: "
                       f"{type(exc).__name__}: {exc}")
            raise

    def _receive(self, reader: FrameReader, admission: Admission, envelope: memoryview,
                 peer: str, split: tuple[StripeGroup, int, int] | None = None) -> None:
        """Admit one message, then read its data into its buffer: all from
        `reader`, or (`split`: the group, the message's index, its parts) part 0
        from `reader` and the others by the group's stripe connections."""
        try:
            admitted = admission.admit(envelope, peer)
        except MessageRejected as exc:
            raise _Refusal(status_of(exc), str(exc), _sender_of(exc, envelope)) from None
        key = admitted.key
        mailbox = admitted.receiver.mailbox
        layout = admitted.layout
        single = layout.single
        if split is None and single is not None and 0 < layout.total_bytes <= SMALL_TENSOR_BYTES:
            tensors = [tensor_over(single, reader.copy(layout.total_bytes))]
        else:
            if layout.total_bytes > _EARLY_DUPLICATE_CHECK_BYTES and mailbox.holds(key):
                raise self._duplicate(admitted.receiver.tag, key, admitted.src, peer)
            tensors = self._read_data(reader, admitted, peer, split)
        logger.debug("%s received %s from %s over tcp", admitted.receiver.tag, key,
                     admitted.src)
        try:
            mailbox.put(key, admitted.src, tensors)
        except MessageRejected as exc:  # a duplicate that came meanwhile
            raise _Refusal("ALREADY_EXISTS", f"{exc} ({peer})", admitted.src) from None

    def _read_data(self, reader: FrameReader, admitted: Admitted, peer: str,
                   split: tuple[StripeGroup, int, int] | None) -> list[torch.Tensor]:
        """The message's data read into its buffer (see `_receive`); its tensors."""
        key = admitted.key
        try:
            buffer = MessageBuffer(admitted.layout, self.endpoint.pool)
        except (MemoryError, RuntimeError) as exc:
            raise _Refusal("RESOURCE_EXHAUSTED",
                           f"{admitted.receiver.tag} refused {key} from "
                           f"{admitted.src.describe()} ({peer}): cannot allocate "
                           f"{admitted.layout.buffer_bytes} bytes: {exc}",
                           admitted.src) from None
        if split is None:
            buffer.fill(reader.read_into)
        else:
            group, seq, parts = split
            views: list[memoryview] = []
            buffer.fill(views.append)  # the tensors' places, in wire order
            cuts = bounds(admitted.layout.total_bytes, parts)
            try:
                group.post(seq, {k: views_between(views, *cuts[k]) for k in range(1, parts)})
            except StripeFailed as exc:
                raise _Refusal("INVALID_ARGUMENT",
                               f"{admitted.receiver.tag} refused {key} from "
                               f"{admitted.src.describe()} ({peer}): {exc}",
                               admitted.src) from None
            for view in views_between(views, *cuts[0]):
                reader.read_into(view)
            group.wait(seq, self.settings.message_timeout_s)
        return buffer.tensors()

    @staticmethod
    def _duplicate(tag: str, key: MessageKey, src: Label, peer: str) -> _Refusal:
        return _Refusal("ALREADY_EXISTS",
                        f"{tag} refused a second message for {key} from {src.describe()} "
                        f"({peer}): the first is already here or on its way; each is sent "
                        f"once", src)


def _try_send(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except (OSError, ssl.SSLError):
        pass


def _drain(sock: socket.socket) -> None:
    """Read (and drop) what the sender still sends, briefly, before closing:
    closing with unread bytes resets the connection, and a reset can drop
    the refusal before the sender reads it."""
    sock.shutdown(socket.SHUT_WR) if not isinstance(sock, ssl.SSLSocket) else None
    sock.settimeout(_DRAIN_S)
    deadline = time.monotonic() + _DRAIN_S
    scratch = bytearray(1 << 20)
    while time.monotonic() < deadline and sock.recv_into(scratch):
        pass


def _sender_of(exc: MessageRejected, envelope: memoryview) -> Label | None:
    """Who to tell of a refusal besides the connection: the envelope's sender
    when it names one (a refusal of a message that names nobody reaches its
    sender on the connection alone)."""
    try:
        return Label.parse(parse_envelope(envelope).src)
    except Exception:  # noqa: BLE001 - an envelope that does not parse names nobody
        return None
