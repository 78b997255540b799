"""`RingWriter`: the producer end of a shared-memory ring (see `ring`)."""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .job_files import SHM_DIR, ring_paths, unlink_quietly
from .ring_errors import RingAttachTimeout, RingError, RingPeerGone
from .ring_records import CLOSED, HELLO, RECORD, SYNC, Positions, recv_exact, send_record
from .ring_segment import (
    FRAME,
    FRAME_MAGIC,
    HEADER_PAGE,
    LENDABLE_BYTES,
    MAX_HEADER_BYTES,
    PAYLOAD_ALIGN,
    POPULATE_AHEAD_BYTES,
    SKIP_MAGIC,
    Segment,
    copy_bytes,
    device_bytes,
    frame_header_field,
    host_bytes,
    payload_padding,
)

__all__ = ["RingSettings", "RingWriter"]

logger = logging.getLogger(__name__)

_SMALLEST_RING = 64 << 10
# Bounds close()'s wait to tell a consumer that does not read its socket.
_CLOSE_NOTICE_S = 1.0


@dataclass(frozen=True, slots=True)
class RingSettings:
    """Sizes and deadlines of one ring; both ends need not agree (the consumer
    reads the capacity from the segment)."""

    # Data bytes of the ring. Larger messages stream through it in pieces.
    capacity_bytes: int = 64 << 20
    # Bounds the consumer's wait for the producer's segment to appear, and the
    # producer's wait for the consumer to attach.
    attach_timeout_s: float = 30.0


class RingWriter:
    """The producer end: creates the segment and waits for the consumer.

        writer = RingWriter(prefix, "w0-s0", owner="worker 0", peer="server 0")
        ... the consumer attaches (RingReader.attach) ...
        writer.send(envelope_bytes, [memoryview(...), ...], timeout_s=60)
        writer.close()
    """

    def __init__(self, prefix: str, name: str, *, owner: str, peer: str,
                 settings: RingSettings | None = None, directory: str = SHM_DIR) -> None:
        self.settings = settings or RingSettings()
        self.capacity = self.settings.capacity_bytes
        if self.capacity < _SMALLEST_RING or self.capacity % PAYLOAD_ALIGN:
            raise RingError(f"ring capacity {self.capacity}: need a multiple of "
                            f"{PAYLOAD_ALIGN} of at least {_SMALLEST_RING} bytes")
        self.name = name
        self._tag = f"[{owner}] ring to {peer}"
        self.peer = peer
        self.ring_path, self.socket_path = ring_paths(prefix, name, directory)
        # Reentrant: `send` holds it while it waits for the consumer to attach.
        self._lock = threading.RLock()
        self._head = 0
        self._num_sent = 0
        self._conn: socket.socket | None = None
        self._tails: Positions | None = None
        self._is_closed = False
        self._broken: BaseException | None = None
        fd = os.open(self.ring_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.fchmod(fd, 0o600)
            # Allocated now: a full /dev/shm fails here, with a message, rather
            # than with SIGBUS on a later write into the mapping.
            try:
                os.posix_fallocate(fd, 0, HEADER_PAGE + self.capacity)
            except OSError as exc:
                raise RingError(
                    f"{self._tag}: cannot allocate {HEADER_PAGE + self.capacity} bytes "
                    f"for {self.ring_path}: {exc.strerror}; is {directory} full? (each "
                    f"same-host pair of processes maps two rings: SPLITRUN_SHM_RING_MB=N "
                    f"makes them smaller, SPLITRUN_TRANSPORT=grpc uses none)") from None
            self._segment = Segment(fd, self.capacity)
        except BaseException:
            os.close(fd)
            unlink_quietly(self.ring_path)
            raise
        os.close(fd)
        self._segment.write_header()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            old_umask = os.umask(0o177)
            try:
                self._listener.bind(self.socket_path)
            finally:
                os.umask(old_umask)
            os.chmod(self.socket_path, 0o600)
            self._listener.listen(1)
        except BaseException:
            self._listener.close()
            self._segment.close()
            unlink_quietly(self.ring_path)
            unlink_quietly(self.socket_path)
            raise
        logger.debug("%s created %s (%d bytes)", self._tag, self.ring_path, self.capacity)

    @property
    def is_attached(self) -> bool:
        return self._conn is not None

    def wait_attached(self, timeout_s: float | None = None) -> None:
        """Wait for the consumer to attach; then unlink the files (the mapping
        and the connection stay valid)."""
        if self._conn is not None:
            return
        timeout_s = self.settings.attach_timeout_s if timeout_s is None else timeout_s
        self._listener.settimeout(timeout_s)
        try:
            conn, _ = self._listener.accept()
        except (TimeoutError, socket.timeout):
            raise RingAttachTimeout(
                f"{self._tag}: {self.peer} did not attach to {self.ring_path} within "
                f"{timeout_s:g} s; is it running and on this host?") from None
        # The greeting follows the connection at once; a short wait (a slice of
        # a longer one) must not cut it off on a loaded machine.
        conn.settimeout(max(timeout_s, self.settings.attach_timeout_s))
        try:
            hello = recv_exact(conn, RECORD.size)
        except OSError:
            hello = b""
        if len(hello) != RECORD.size or RECORD.unpack(hello)[0] != HELLO:
            conn.close()
            raise RingError(f"{self._tag}: the process that connected to "
                            f"{self.socket_path} did not greet as a ring consumer")
        conn.settimeout(None)
        with self._lock:  # `close` may run meanwhile: it uses the listener under the lock
            if self._is_closed:
                # Closed while the consumer attached: tell it, as `close` would have.
                try:
                    send_record(conn, CLOSED, time.monotonic() + _CLOSE_NOTICE_S)
                except OSError:
                    pass  # the consumer is gone or stuck; closing anyway
                conn.close()
                return
            self._conn = conn
            self._tails = Positions(conn)
            self._listener.close()
        unlink_quietly(self.ring_path)
        unlink_quietly(self.socket_path)
        logger.debug("%s: %s attached", self._tag, self.peer)

    def _check_sendable(self, deadline: float) -> None:
        """Under the lock, before a send: the ring is open, unbroken and its
        consumer attached (waited for until `deadline`)."""
        if self._is_closed:
            raise RingError(f"{self._tag}: send after close")
        if self._broken is not None:
            raise RingError(f"{self._tag}: the ring is unusable after an earlier "
                            f"failure: {self._broken}")
        if self._conn is None:
            self.wait_attached(max(deadline - time.monotonic(), 0.0))

    def send(self, header: bytes, views: Sequence[memoryview], timeout_s: float) -> None:
        """Copy one message (header plus the bytes of `views`, in order) into the
        ring, streaming it when it is larger; returns once all of it is in the
        ring (not necessarily read). `RingPeerGone` if the consumer is gone."""
        if len(header) > MAX_HEADER_BYTES:
            raise RingError(f"{self._tag}: a header of {len(header)} bytes is over the "
                            f"{MAX_HEADER_BYTES}-byte limit")
        deadline = time.monotonic() + timeout_s
        with self._lock:
            self._check_sendable(deadline)
            try:
                self._send_frame(header, views, deadline)
            except BaseException as exc:
                # A frame cut short leaves the stream unreadable: no more sends.
                self._broken = exc
                raise
            self._num_sent += 1

    def send_tensors(self, header: bytes, tensors: Sequence[torch.Tensor],
                     timeout_s: float) -> None:
        """`send` of the tensors' bytes, in order: CPU tensors from their own
        memory, CUDA tensors straight from the device into the pinned ring."""
        self.send(header, [device_bytes(t) if t.is_cuda else host_bytes(t) for t in tensors],
                  timeout_s)

    def send_filled(self, header: bytes, payload_bytes: int,
                    fill: Callable[[torch.Tensor], None], timeout_s: float) -> bool:
        """Send one message whose payload `fill(payload)` writes straight into
        the ring (no copy of its own): `payload` is a flat uint8 tensor of
        `payload_bytes` over the ring's memory, reserved for this message and
        valid only during the call (keep no view of it). The frame lies in one
        piece (a skip frame fills the ring's end if needed), so this waits for
        that much room. False, with nothing sent and `fill` not called, when
        the message takes more than half the ring (or the ring's end is too
        short for a skip frame): `send` it instead. If `fill` raises, nothing
        is sent, the ring stays usable, and the error propagates."""
        if len(header) > MAX_HEADER_BYTES:
            raise RingError(f"{self._tag}: a header of {len(header)} bytes is over the "
                            f"{MAX_HEADER_BYTES}-byte limit")
        capacity = self.capacity
        if FRAME.size + len(header) + PAYLOAD_ALIGN + payload_bytes > capacity // 2:
            return False
        deadline = time.monotonic() + timeout_s
        with self._lock:
            self._check_sendable(deadline)
            start = self._head % capacity
            padding = payload_padding(start + FRAME.size + len(header))
            total = FRAME.size + len(header) + padding + payload_bytes
            try:
                if start + total > capacity:
                    if capacity - start < FRAME.size:
                        return False  # rare: no room for a skip frame at the end
                    self._skip_to_ring_start(deadline)
                    start = 0
                    padding = payload_padding(FRAME.size + len(header))
                    total = FRAME.size + len(header) + padding + payload_bytes
                self._wait_for_room(deadline, total)
            except BaseException as exc:
                # The consumer is gone or stuck: the ring is no more use (a
                # skip frame written is whole, and the stream still readable).
                self._broken = exc
                raise
            # The frame's pages filled before `fill` writes them, as `_send_frame` does.
            self._segment.populate_through(capacity if payload_bytes >= POPULATE_AHEAD_BYTES
                                           else min(self._head + total, capacity))
            data = self._segment.data
            at = start + FRAME.size
            data[start:at] = FRAME.pack(FRAME_MAGIC, frame_header_field(len(header), padding),
                                        payload_bytes)
            data[at:at + len(header)] = header
            at += len(header) + padding
            if payload_bytes:
                # Over the mapping's address, not an export of it: close() needs none.
                memory = (ctypes.c_char * payload_bytes).from_address(self._segment.address + at)
                payload = torch.frombuffer(memory, dtype=torch.uint8)
                try:
                    fill(payload)  # nothing is published yet: a failure sends nothing
                finally:
                    del payload, memory
            else:
                fill(torch.empty(0, dtype=torch.uint8))
            self._head += total
            try:
                self._publish(deadline)
            except BaseException as exc:
                self._broken = exc
                raise
            self._num_sent += 1
            return True

    def _send_frame(self, header: bytes, views: Sequence[memoryview | torch.Tensor],
                    deadline: float) -> None:
        """Copy one frame in: in one go when it fits without wrapping, else
        streamed in pieces as the consumer makes room. A source is a byte view
        or a flat uint8 CUDA tensor."""
        views = [view if isinstance(view, torch.Tensor) or (view.format == "B" and view.ndim == 1)
                 else view.cast("B") for view in views]
        payload_bytes = sum(view.nbytes for view in views)
        capacity = self.capacity
        start = self._head % capacity
        padding = payload_padding(start + FRAME.size + len(header))
        total = FRAME.size + len(header) + padding + payload_bytes
        if (payload_bytes >= LENDABLE_BYTES and start + total > capacity
                and total <= capacity // 2 and capacity - start >= FRAME.size):
            # A payload the consumer may view in place lies in one piece: skip
            # the ring's end (at most half a ring of such a payload is wasted).
            self._skip_to_ring_start(deadline)
            start = 0
            padding = payload_padding(FRAME.size + len(header))
            total = FRAME.size + len(header) + padding + payload_bytes
        # The frame's pages are filled before the copies (on the ring's first
        # pass): for a large payload the whole ring's at once (a stream of them
        # soon walks all of it), else those up to the frame's end.
        self._segment.populate_through(capacity if payload_bytes >= POPULATE_AHEAD_BYTES
                                       else min(self._head + total, capacity))
        prefix = FRAME.pack(FRAME_MAGIC, frame_header_field(len(header), padding),
                            payload_bytes)
        has_device = any(isinstance(view, torch.Tensor) for view in views)
        if (not has_device and total <= capacity - (self._head - self._tails.last)
                and start + total <= capacity and total <= capacity // 4):
            # The common small message: room for all of it without wrapping.
            data = self._segment.data
            at = start + FRAME.size
            data[start:at] = prefix
            data[at:at + len(header)] = header
            at += len(header) + padding
            for view in views:
                copy_bytes(data[at:at + view.nbytes], view)
                at += view.nbytes
            self._head += total
        else:
            self._write(memoryview(prefix + header), deadline)
            self._advance(padding, deadline)
            for view in views:
                self._write(view, deadline)
        self._publish(deadline)

    def _skip_to_ring_start(self, deadline: float) -> None:
        """A skip frame over the rest of the ring (its bytes are not written)."""
        gap = self.capacity - self._head % self.capacity
        self._wait_for_room(deadline, gap)
        start = self._head % self.capacity
        FRAME.pack_into(self._segment.data, start, SKIP_MAGIC, 0, gap - FRAME.size)
        self._head += gap

    def _advance(self, n: int, deadline: float) -> None:
        """Count `n` bytes (padding, not written) as written, once there is room."""
        if n:
            self._wait_for_room(deadline, n)
            self._head += n

    def _write(self, view: memoryview | torch.Tensor, deadline: float) -> None:
        capacity = self._segment.capacity
        is_device = isinstance(view, torch.Tensor)
        data = self._segment.tensor() if is_device else self._segment.data
        # Publish at least every quarter ring so the consumer starts on a
        # large message while the rest is copied.
        piece = capacity // 4
        done, total = 0, view.nbytes
        while done < total:
            free = capacity - (self._head - self._tails.last)
            if free == 0:
                self._publish(deadline)
                self._wait_for_room(deadline)
                continue
            start = self._head % capacity
            n = min(total - done, free, capacity - start, piece)
            if is_device:
                data[start:start + n].copy_(view[done:done + n])  # device -> pinned: DMA
            else:
                copy_bytes(data[start:start + n], view[done:done + n])
            done += n
            self._head += n
            if n == piece or self._head % piece == 0:
                self._publish(deadline)

    def _publish(self, deadline: float) -> None:
        """Tell the consumer how far the ring is written (its wake-up)."""
        self._send_record(self._head, deadline)

    def _send_record(self, value: int, deadline: float) -> None:
        try:
            send_record(self._conn, value, deadline)
        except TimeoutError:
            raise RingError(f"{self._tag}: {self.peer} has not read the ring's "
                            f"notifications past the deadline; is it stuck?") from None
        except OSError as exc:
            raise self._gone() from exc

    def _wait_for_room(self, deadline: float, n: int = 1) -> None:
        """Wait until `n` bytes of the ring are free (the consumer has read, and
        released what it viewed in place)."""
        self._wait_tail(lambda: self.capacity - (self._head - self._tails.last) >= n, deadline,
                        lambda: f"no room in the ring past the deadline: {self.peer} "
                                f"neither reads nor releases the "
                                f"{self._head - self._tails.last} of its {self.capacity} "
                                f"bytes it holds")

    def wait_consumed(self, timeout_s: float) -> None:
        """Wait until the consumer has read every message sent so far (a flush):
        asks for its tail with a sync record, which it answers once it has
        nothing left to read. `RingPeerGone` if it dies meanwhile."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            if self._conn is None or self._is_closed or self._read_up_to() == self._head:
                return
            self._send_record(SYNC, deadline)
            self._wait_tail(lambda: self._read_up_to() >= self._head, deadline,
                            lambda: f"{self.peer} has not read the last "
                                    f"{self._head - self._read_up_to()} bytes within "
                                    f"{timeout_s:g} s; is it stuck?")

    def _read_up_to(self) -> int:
        """How far the consumer has read (free bytes are read; lent ones too)."""
        return max(self._tails.last, self._tails.read_up_to)

    def _wait_tail(self, done, deadline: float, why_late) -> None:
        """Read the consumer's tail reports until `done()`; `RingPeerGone` if it
        dies, `RingError` with `why_late()` past the deadline."""
        tails = self._tails
        tails.read(None)
        while not done():
            if tails.is_eof:
                raise self._gone()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RingError(f"{self._tag}: {why_late()}")
            tails.read(remaining)

    def _gone(self) -> RingPeerGone:
        return RingPeerGone(
            f"{self._tag}: {self.peer} dropped its end of the ring after "
            f"{self._num_sent} messages (did the process die?)")

    def close(self) -> None:
        """Tell the consumer no more messages come; release the mapping and files."""
        with self._lock:
            if self._is_closed:
                return
            self._is_closed = True
            self._segment.mark_closed()
            if self._conn is not None:
                try:
                    send_record(self._conn, CLOSED, time.monotonic() + _CLOSE_NOTICE_S)
                except OSError:
                    pass  # the consumer is gone or stuck; closing anyway
                self._conn.close()
            else:
                self._tell_waiting_consumer()
                self._listener.close()
            self._segment.close()
            unlink_quietly(self.ring_path)
            unlink_quietly(self.socket_path)


    def _tell_waiting_consumer(self) -> None:
        """Closing before the first send: a consumer that has connected already
        (it waits in the listener's backlog) is told the ring closed, so it does
        not take the closed listener for a dead producer."""
        self._listener.settimeout(0)
        try:
            conn, _ = self._listener.accept()
        except (BlockingIOError, TimeoutError, socket.timeout, OSError):
            return  # nobody is waiting
        try:
            send_record(conn, CLOSED, time.monotonic() + _CLOSE_NOTICE_S)
        except OSError:
            pass  # the consumer is gone or stuck; closing anyway
        finally:
            conn.close()
