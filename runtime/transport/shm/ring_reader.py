"""`RingReader`: the consumer end of a shared-memory ring (see `ring`)."""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import threading
import time
import weakref

import torch

from ...errors import RecvTimeout
from .job_files import SHM_DIR, ring_paths
from .ring_errors import RingAttachTimeout, RingClosed, RingError, RingPeerGone
from .ring_records import CLOSED, HELLO, READ_FLAG, RECORD, Positions, send_record
from .ring_segment import (
    FRAME,
    FRAME_MAGIC,
    HEADER_PAGE,
    MAX_HEADER_BYTES,
    PAYLOAD_ALIGN,
    POPULATE_AHEAD_BYTES,
    SEGMENT_HEADER,
    SEGMENT_MAGIC,
    SKIP_MAGIC,
    VERSION,
    Segment,
    copy_bytes,
    is_marked_closed,
    split_header_field,
)

__all__ = ["RingReader"]

logger = logging.getLogger(__name__)

# Room kept in the ring for the frames (prefix, envelope, padding) of the
# messages still to come in a step, beside their payloads (`can_lend`).
_FRAMES_SLACK = 1 << 20


class RingReader:
    """The consumer end: attaches to a producer's segment.

        reader = RingReader.attach(prefix, "w0-s0", owner="server 0", peer="worker 0")
        header, nbytes = reader.recv_header(timeout_s=60)
        reader.recv_payload_into(buffer_of_nbytes, timeout_s=60)
        reader.close()

    Or, for a large payload that lies in one piece, `lend_payload` views it in
    the ring itself: those bytes stay the consumer's (the producer does not
    write over them) until the last tensor viewing them is gone.
    """

    def __init__(self, conn: socket.socket, segment: Segment, *, owner: str, peer: str,
                 name: str) -> None:
        self._conn = conn
        self._segment = segment
        self.capacity = segment.capacity
        self.name = name
        self.peer = peer
        self._tag = f"[{owner}] ring from {peer}"
        self._heads = Positions(conn)
        self._tail = 0
        self._reported = 0
        self._is_producer_gone = False
        self._payload_left = 0
        self._num_received = 0
        self._prefix = bytearray(FRAME.size)
        self._lock = threading.Lock()
        self._is_closed = False
        # Lent payloads, start position -> bytes. The producer is told the
        # ring is free up to the first of them (or the tail). Reentrant: a
        # garbage collection inside a report may release a lent payload.
        self._lent: dict[int, int] = {}
        self._report_lock = threading.RLock()
        self.num_lent = 0

    @classmethod
    def attach(cls, prefix: str, name: str, *, owner: str, peer: str,
               timeout_s: float = 30.0, directory: str = SHM_DIR) -> RingReader:
        """Open the producer's segment and connect to it, waiting up to
        `timeout_s` for the producer to create them."""
        ring_path, socket_path = ring_paths(prefix, name, directory)
        tag = f"[{owner}] ring from {peer}"
        deadline = time.monotonic() + timeout_s
        delay = 0.001
        while True:
            try:
                fd = os.open(ring_path, os.O_RDWR)
                conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    conn.settimeout(max(deadline - time.monotonic(), 0.001))
                    conn.connect(socket_path)
                except ConnectionRefusedError:
                    # Refused after the segment exists: either the producer is
                    # still setting up, or it closed its listener already.
                    conn.close()
                    closed_in_order = is_marked_closed(fd)
                    os.close(fd)
                    if closed_in_order:
                        raise RingClosed(f"{tag}: {peer} closed the ring before sending "
                                         f"anything") from None
                    raise
                except BaseException:
                    conn.close()
                    os.close(fd)
                    raise
                break
            except (FileNotFoundError, ConnectionRefusedError):
                # The producer has not created its files yet (a bounded poll:
                # there is nothing to wait on before the files exist).
                if time.monotonic() + delay > deadline:
                    raise RingAttachTimeout(
                        f"{tag}: {ring_path} did not appear within {timeout_s:g} s; is "
                        f"{peer} running on this host with the same job prefix?") from None
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
        try:
            size = os.fstat(fd).st_size
            header = os.pread(fd, SEGMENT_HEADER.size, 0)
            magic, version, capacity = SEGMENT_HEADER.unpack(header)
            if magic != SEGMENT_MAGIC or version != VERSION or size != HEADER_PAGE + capacity:
                raise RingError(f"{tag}: {ring_path} is not a version-{VERSION} ring "
                                f"(magic {magic:#x}, version {version}, {size} bytes)")
            segment = Segment(fd, capacity)
        except BaseException:
            conn.close()
            raise
        finally:
            os.close(fd)
        try:
            conn.sendall(RECORD.pack(HELLO))
        except OSError as exc:
            # A producer that closes before its first message answers a
            # consumer waiting to attach with CLOSED, then hangs up: an
            # orderly end, not a death (the record is still readable). One
            # that closed its listener while our connect was in its backlog
            # sent nothing, but marked the segment closed first.
            closed_in_order = _reads_closed(conn) or segment.is_marked_closed()
            conn.close()
            segment.close()
            if closed_in_order:
                raise RingClosed(f"{tag}: {peer} closed the ring before sending anything") \
                    from None
            raise RingPeerGone(f"{tag}: {peer} closed the ring while attaching") from exc
        conn.settimeout(None)
        return cls(conn, segment, owner=owner, peer=peer, name=name)

    # -- reading --

    def recv_header(self, timeout_s: float) -> tuple[bytes, int]:
        """The next message's header and its payload's size; read the payload
        next with `recv_payload_into` (or `discard_payload`)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            if self._payload_left:
                raise RingError(f"{self._tag}: recv_header with {self._payload_left} payload "
                                f"bytes of the previous message unread")
            while True:
                available = self._wait_available(FRAME.size, deadline, is_start=True)
                data, start = self._segment.data, self._tail % self.capacity
                if start + FRAME.size <= self.capacity:
                    magic, field, payload_bytes = FRAME.unpack_from(data, start)
                    self._consume(FRAME.size)
                else:
                    self._read_into(memoryview(self._prefix), deadline)
                    magic, field, payload_bytes = FRAME.unpack(self._prefix)
                if magic != SKIP_MAGIC:
                    break
                if (self._tail + payload_bytes) % self.capacity:
                    raise RingError(f"{self._tag}: broken skip frame after "
                                    f"{self._num_received} messages ({payload_bytes} bytes "
                                    f"from ring offset {start})")
                self._skip(payload_bytes, deadline)
            header_bytes, padding = split_header_field(field)
            if magic != FRAME_MAGIC or header_bytes > MAX_HEADER_BYTES:
                raise RingError(f"{self._tag}: broken frame after {self._num_received} "
                                f"messages (magic {magic:#x}, header {header_bytes} bytes)")
            start = self._tail % self.capacity
            if available - FRAME.size >= header_bytes and start + header_bytes <= self.capacity:
                header = bytes(data[start:start + header_bytes])
                self._consume(header_bytes)
            else:
                buffer = bytearray(header_bytes)
                self._read_into(memoryview(buffer), deadline)
                header = bytes(buffer)
            self._skip(padding, deadline)
            self._payload_left = payload_bytes
            if payload_bytes >= POPULATE_AHEAD_BYTES:
                # Its producer had the whole ring's pages filled for it: this
                # end's page tables too, at once, not a fault per piece copied.
                self._segment.populate_through(self.capacity, is_reader=True)
            if not payload_bytes:
                self._num_received += 1
            return header, payload_bytes

    def recv_payload_into(self, dst: memoryview, timeout_s: float) -> None:
        """Copy the current message's payload into `dst` (exactly its size)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            if dst.nbytes != self._payload_left:
                raise RingError(f"{self._tag}: payload is {self._payload_left} bytes, the "
                                f"buffer {dst.nbytes}")
            self._read_into(dst.cast("B") if dst.format != "B" else dst, deadline)
            self._payload_left = 0
            self._num_received += 1

    def recv_payload_part_into(self, dst: memoryview, timeout_s: float) -> None:
        """Copy the next `dst.nbytes` bytes of the current message's payload into
        `dst` (a message's tensors each into their own place, one copy)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            if dst.nbytes > self._payload_left:
                raise RingError(f"{self._tag}: {self._payload_left} payload bytes left, the "
                                f"buffer takes {dst.nbytes}")
            self._read_into(dst.cast("B") if dst.format != "B" else dst, deadline)
            self._payload_left -= dst.nbytes
            if not self._payload_left:
                self._num_received += 1

    def recv_payload_into_tensor(self, dst: torch.Tensor, timeout_s: float) -> None:
        """`recv_payload_into` a contiguous tensor of exactly the payload's size:
        a CPU tensor's memory, or a CUDA tensor straight from the pinned ring."""
        if not dst.is_contiguous():
            raise RingError(f"{self._tag}: receiving into a non-contiguous tensor")
        if not dst.is_cuda:
            self.recv_payload_into(memoryview(dst.view(-1).view(torch.uint8).numpy()),
                                   timeout_s)
            return
        deadline = time.monotonic() + timeout_s
        flat = dst.view(-1).view(torch.uint8)
        with self._lock:
            if flat.numel() != self._payload_left:
                raise RingError(f"{self._tag}: payload is {self._payload_left} bytes, the "
                                f"tensor {flat.numel()}")
            self._read_into(flat, deadline)
            self._payload_left = 0
            self._num_received += 1

    def discard_payload(self, timeout_s: float) -> None:
        """Skip the current message's payload (a refused message)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            self._skip(self._payload_left, deadline)
            self._payload_left = 0
            self._num_received += 1

    def lend_payload(self, timeout_s: float) -> torch.Tensor | None:
        """The current message's whole payload as a flat uint8 tensor over the
        ring's own memory (no copy), if it lies there in one piece (as payloads
        of `LENDABLE_BYTES` or more do); else None, and `recv_payload_*` reads it.

        The producer does not write over those bytes until every tensor viewing
        them is gone: lend only what is dropped soon, and only when `can_lend`
        says the ring can spare the room meanwhile."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            n, start = self._payload_left, self._tail % self.capacity
            if not n or start + n > self.capacity or start % PAYLOAD_ALIGN or self._is_closed:
                return None
            self._wait_available(n, deadline)
            memory = (ctypes.c_char * n).from_address(self._segment.address + start)
            with self._report_lock:
                position = self._tail
                self._lent[position] = n
                self._tail += n
            # Runs when the last tensor viewing `memory` is gone, in that thread.
            weakref.finalize(memory, self._release, position).atexit = False
            self._payload_left = 0
            self._num_received += 1
            self.num_lent += 1
            return torch.frombuffer(memory, dtype=torch.uint8)

    def pin(self) -> None:
        """Register the ring as pinned memory, so that payloads lent from it
        reach a GPU by DMA (a process that computes on CUDA)."""
        self._segment.pin()

    def can_lend(self, later_bytes: int) -> bool:
        """Whether lending the current payload leaves the producer room for
        `later_bytes` more (its messages still to come in this step) even if
        nothing lent is released before: the ring from the first lent byte to
        this payload's end, plus those bytes twice (each may skip the ring's
        end), plus frames. And at most half the ring is held, so the producer
        can go on with its next step's messages."""
        with self._report_lock:
            held = self._tail + self._payload_left - self._free_position()
        return (held <= self.capacity // 2
                and held + 2 * later_bytes + _FRAMES_SLACK <= self.capacity)

    @property
    def num_received(self) -> int:
        return self._num_received

    @property
    def lent_bytes(self) -> int:
        """Bytes of payloads lent out and not yet released."""
        with self._report_lock:
            return sum(self._lent.values())

    def holds_address(self, address: int) -> bool:
        """Whether `address` (a CPU tensor's storage) lies in this ring's memory."""
        return self._segment.address <= address < self._segment.address + self.capacity

    def _release(self, position: int) -> None:
        with self._report_lock:
            self._lent.pop(position, None)
            if self._is_closed:
                if not self._lent:
                    self._segment.close()  # close() left the mapping to the last one
                return
            self._report()

    def _skip(self, n: int, deadline: float) -> None:
        """Consume `n` bytes without reading them (padding, a refused payload)."""
        while n:
            k = min(self._wait_available(1, deadline), n)
            self._consume(k)
            n -= k

    def recv(self, timeout_s: float) -> tuple[bytes, bytearray]:
        """Header and payload of the next message, in a fresh buffer (tests)."""
        header, nbytes = self.recv_header(timeout_s)
        payload = bytearray(nbytes)
        if nbytes:
            self.recv_payload_into(memoryview(payload), timeout_s)
        return header, payload

    def _read_into(self, dst: memoryview | torch.Tensor, deadline: float,
                   is_start: bool = False) -> None:
        """Copy the next `dst`'s size of bytes into `dst` (a byte view, or a flat
        uint8 CUDA tensor)."""
        capacity = self.capacity
        is_device = isinstance(dst, torch.Tensor)
        data = self._segment.tensor() if is_device else self._segment.data
        done, total = 0, dst.nbytes
        while done < total:
            available = self._wait_available(1, deadline, is_start=is_start and done == 0)
            start = self._tail % capacity
            n = min(total - done, available, capacity - start)
            if is_device:
                dst[done:done + n].copy_(data[start:start + n])  # pinned -> device: DMA
            else:
                copy_bytes(dst[done:done + n], data[start:start + n])
            done += n
            self._consume(n)

    def _wait_available(self, need: int, deadline: float, is_start: bool = False) -> int:
        heads = self._heads
        while heads.last - self._tail < need:
            if heads.is_closed and heads.last == self._tail:
                raise RingClosed(f"{self._tag}: {self.peer} closed the ring after "
                                 f"{self._num_received} messages")
            if heads.is_eof:
                if is_start and heads.last == self._tail and self._segment.is_marked_closed():
                    # Closed in order, but its CLOSED record never reached us
                    # (it shut its listener with our connection in the backlog).
                    raise RingClosed(f"{self._tag}: {self.peer} closed the ring after "
                                     f"{self._num_received} messages")
                where = ("" if is_start else " in the middle of a message")
                raise RingPeerGone(
                    f"{self._tag}: {self.peer} dropped its end of the ring{where} after "
                    f"{self._num_received} messages (did the process die?)")
            if heads.is_sync_requested:
                # Nothing left to read: everything published is read (a flush
                # waits for that, not for lent payloads to be released).
                heads.is_sync_requested = False
                self._report()
                self._report_read()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RecvTimeout(f"{self._tag}: no data from {self.peer} within the "
                                  f"deadline (after {self._num_received} messages)")
            heads.read(remaining)
        return heads.last - self._tail

    def _consume(self, n: int) -> None:
        self._tail += n
        if self._tail - self._reported >= self.capacity // 4:
            self._report()

    def _report(self) -> None:
        """Tell the producer how far the ring is free: read, and not lent out
        (a release reports too). Every quarter ring is enough for it never to
        wait on room that is free: when it finds the ring full, the consumer
        has read at most a quarter ring it has not reported, so the consumer
        is not waiting for data."""
        with self._report_lock:
            free = self._free_position()
            if self._is_producer_gone or free <= self._reported:
                return
            try:
                # The producer reads these only when it runs out of room, so its
                # socket buffer holds a ring's worth of reports many times over.
                send_record(self._conn, free, None)
            except OSError:
                # The producer closed or died; what it published before is still
                # read (its records are in our socket), then the end-of-file says so.
                self._is_producer_gone = True
            self._reported = free

    def _free_position(self) -> int:
        """How far the producer may write: the first lent byte, else the tail
        (under `_report_lock`)."""
        return min(self._lent) if self._lent else self._tail

    def _report_read(self) -> None:
        with self._report_lock:
            if self._is_producer_gone or not self._lent:
                return  # the free position just reported says it
            try:
                send_record(self._conn, self._tail | READ_FLAG, None)
            except OSError:
                self._is_producer_gone = True

    def close(self) -> None:
        with self._lock, self._report_lock:
            if self._is_closed:
                return
            self._is_closed = True
            self._conn.close()
            if self._lent:
                # Tensors still view lent payloads: the last release unmaps.
                logger.debug("%s closed with %d payloads lent out", self._tag, len(self._lent))
            else:
                self._segment.close()


def _reads_closed(conn: socket.socket) -> bool:
    """Whether the producer's CLOSED record waits on `conn` (read without waiting)."""
    conn.settimeout(0)
    try:
        record = conn.recv(RECORD.size)
    except OSError:
        return False
    return len(record) == RECORD.size and RECORD.unpack(record)[0] == CLOSED
