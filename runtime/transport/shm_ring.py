"""A single-producer, single-consumer byte ring in shared memory between two
processes of one host: the payload path of the same-host transport.

Layout. One file per (job, sender, receiver) under /dev/shm, created mode
0600 with the job's random prefix (`splitrun-<hex>-<name>.ring`): a 4 KiB
header page (magic, version, capacity) and `capacity` data bytes, reused for
every message. The positions do not live in the shared memory: the producer's
head (bytes published) and the consumer's tail (bytes consumed) travel as
8-byte records over a Unix stream socket (`...<name>.sock`) between the two.
That socket is the wake-up (no gRPC round trip), its syscalls order the
memory accesses on any CPU, and its end-of-file is how each side learns that
the other process died. The consumer reports its tail every quarter ring, so
a stream of small messages costs one record per message, not two.

CUDA tensors (`send_tensors`, `recv_payload_into_tensor`) are copied between
the device and the ring directly, the ring registered as pinned host memory
(`cudaHostRegister`) on first use, so the copies are DMA and still one per
side. (Coded; not run on a device yet.)

Messages. A frame is a 16-byte prefix (magic, header length, payload length),
the header bytes (the transport's envelope) and the payload. A payload larger
than the ring streams through it in pieces: the producer copies each piece
from the tensors' own memory into the ring (one copy), the consumer copies it
into the buffer it chose for the message (one copy); nothing is allocated per
message on either side.

Clean-up. Once the consumer has attached, the producer unlinks both files:
the mapping stays valid for the two processes and nothing is left in /dev/shm
whatever happens to them later. Between creation and attachment the files
exist; `remove_job_segments(prefix)` removes every file of a job (a launcher
or a surviving process after a SIGKILL).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import re
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import RecvTimeout, TransportError

__all__ = [
    "SHM_DIR",
    "RingSettings",
    "RingError",
    "RingAttachTimeout",
    "RingPeerGone",
    "RingClosed",
    "RingWriter",
    "RingReader",
    "new_job_prefix",
    "ring_paths",
    "job_file_path",
    "remove_job_segments",
    "boot_id",
]

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_PREFIX_PATTERN = re.compile(r"^splitrun-[0-9a-f]{12,64}-$")
_NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.-]{1,100}$")
_HEADER_PAGE = 4096
_SEGMENT_MAGIC = 0x5350_4C49_5452_494E  # "SPLITRIN"
_VERSION = 1
_SEGMENT_HEADER = struct.Struct("<QIQ")   # magic, version, capacity
_FRAME_MAGIC = 0x5352_4E47              # "SRNG"
_FRAME = struct.Struct("<IIQ")          # magic, header bytes, payload bytes
_RECORD = struct.Struct("<Q")           # a head (producer) or tail (consumer) position
_HELLO = 0x4845_4C4C_4F53_524E           # the consumer's first record
_CLOSED = (1 << 64) - 1                 # the producer's last record: closed in order
_SYNC = (1 << 64) - 2                   # the producer asks for the consumer's tail (flush)
# A header (the transport's envelope) larger than this is refused as corrupt.
_MAX_HEADER_BYTES = 16 << 20
_SMALLEST_RING = 64 << 10
# Bounds close()'s wait to tell a consumer that does not read its socket.
_CLOSE_NOTICE_S = 1.0
# Pieces at least this large are copied by torch, which lets go of the GIL
# while it copies (a memoryview assignment holds it): a server's readers of
# two workers' rings copy at once, and the main thread runs meanwhile.
_GIL_FREE_COPY_BYTES = 256 << 10


class RingError(TransportError):
    """The shared-memory ring failed (setup, a broken frame, a peer gone)."""


class RingPeerGone(RingError):
    """The process at the other end of the ring died (or dropped its end)
    without closing it in order."""


class RingAttachTimeout(RingError):
    """The consumer did not attach within the wait (`RingWriter.wait_attached`);
    waiting again may still see it attach."""


class RingClosed(RingError):
    """The producer closed the ring in order; no more messages come."""


@dataclass(frozen=True, slots=True)
class RingSettings:
    """Sizes and deadlines of one ring; both ends need not agree (the consumer
    reads the capacity from the segment)."""

    # Data bytes of the ring. Larger messages stream through it in pieces.
    capacity_bytes: int = 64 << 20
    # Bounds the consumer's wait for the producer's segment to appear, and the
    # producer's wait for the consumer to attach.
    attach_timeout_s: float = 30.0


def new_job_prefix() -> str:
    """A fresh random prefix for one job's segments."""
    return f"splitrun-{secrets.token_hex(8)}-"


def _check_prefix(prefix: str) -> None:
    if not _PREFIX_PATTERN.match(prefix):
        raise RingError(
            f"segment prefix {prefix!r} is not one of new_job_prefix()'s "
            f"('splitrun-<hex>-'); refusing to create or remove files by it")


def ring_paths(prefix: str, name: str, directory: str = SHM_DIR) -> tuple[str, str]:
    """The segment file and the socket file of ring `name` of the job `prefix`."""
    _check_prefix(prefix)
    if not _NAME_PATTERN.match(name):
        raise RingError(f"ring name {name!r}: use letters, digits, '_', '.', '-' (1-100)")
    base = os.path.join(directory, prefix + name)
    return base + ".ring", base + ".sock"


def job_file_path(prefix: str, name: str, suffix: str, directory: str = SHM_DIR) -> str:
    """Another file of the job `prefix` (e.g. a process's marker): removed with
    the job's segments by `remove_job_segments`."""
    _check_prefix(prefix)
    if not _NAME_PATTERN.match(name + suffix):
        raise RingError(f"file name {name + suffix!r}: use letters, digits, '_', '.', '-'")
    return os.path.join(directory, prefix + name + suffix)


def remove_job_segments(prefix: str, directory: str = SHM_DIR) -> list[str]:
    """Remove every file of the job `prefix` under `directory`; returns their paths."""
    _check_prefix(prefix)
    removed = []
    try:
        entries = os.listdir(directory)
    except FileNotFoundError:
        return removed
    for entry in sorted(entries):
        if entry.startswith(prefix):
            path = os.path.join(directory, entry)
            try:
                os.unlink(path)
            except FileNotFoundError:
                continue
            removed.append(path)
    if removed:
        logger.info("removed %d shared-memory files of job %s", len(removed), prefix)
    return removed


def boot_id() -> str:
    """This machine's boot id: two processes share memory only if theirs match."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _send_record(sock: socket.socket, value: int, deadline: float | None) -> None:
    """Send one position record, waiting for socket room until `deadline`
    (None: as long as it takes). OSError when the peer's end is gone."""
    data = memoryview(_RECORD.pack(value))
    poller = None
    while data:
        try:
            n = sock.send(data, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
        except BlockingIOError:
            # The other end has not read thousands of records: it is busy,
            # and drains them before it next waits for us.
            if poller is None:
                poller = select.poll()
                poller.register(sock, select.POLLOUT)
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError("no room in the socket to the peer") from None
            poller.poll(None if remaining is None else remaining * 1000)
            continue
        data = data[n:]


class _Positions:
    """Records from the other end of the socket, read with deadlines. Keeps the
    largest position seen; notices end-of-file (the peer's end is gone)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._poller = select.poll()
        self._poller.register(sock, select.POLLIN)
        self._buffer = bytearray(4096)
        self._view = memoryview(self._buffer)
        self._pending = 0      # bytes of a partial record at the buffer's start
        self.last = 0
        self.is_closed = False  # the peer sent _CLOSED
        self.is_sync_requested = False  # the peer sent _SYNC and has no answer yet
        self.is_eof = False

    def read(self, timeout_s: float | None) -> bool:
        """Take the records that are there, waiting up to `timeout_s` for some
        (None or <= 0: do not wait); True if any came."""
        if self.is_eof:
            return False
        try:
            n = self._sock.recv_into(self._view[self._pending:], 0, socket.MSG_DONTWAIT)
        except BlockingIOError:
            if timeout_s is None or timeout_s <= 0 or not self._poller.poll(timeout_s * 1000):
                return False
            return self.read(None)
        except OSError:
            self.is_eof = True
            return False
        if n == 0:
            self.is_eof = True
            return False
        end = self._pending + n
        whole = end - end % _RECORD.size
        for (value,) in _RECORD.iter_unpack(self._view[:whole]):
            if value == _CLOSED:
                self.is_closed = True
            elif value == _SYNC:
                self.is_sync_requested = True
            else:
                self.last = max(self.last, value)
        self._pending = end - whole
        if self._pending:
            self._buffer[:self._pending] = self._buffer[whole:end]
        return True


class _Segment:
    """The mapped segment file: header page plus data."""

    def __init__(self, fd: int, capacity: int) -> None:
        self.capacity = capacity
        # Populated: the page tables are filled now, not by a fault on each
        # page's first touch (measured: a 1 MiB message walking through fresh
        # pages of a 64 MiB ring ran 4x slower than over mapped ones).
        self._map = mmap.mmap(fd, _HEADER_PAGE + capacity,
                              mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                              mmap.PROT_READ | mmap.PROT_WRITE)
        self._view = memoryview(self._map)
        self.data = self._view[_HEADER_PAGE:]
        anchor = ctypes.c_char.from_buffer(self._map, _HEADER_PAGE)
        self.address = ctypes.addressof(anchor)
        del anchor  # no export of the map may outlive close()
        self._tensor: torch.Tensor | None = None
        self._is_pinned = False

    def write_header(self) -> None:
        _SEGMENT_HEADER.pack_into(self._map, 0, _SEGMENT_MAGIC, _VERSION, self.capacity)

    def tensor(self) -> torch.Tensor:
        """The data as a flat uint8 tensor over the same memory, pinned for
        CUDA copies (registered on first use)."""
        if self._tensor is None:
            raw = (ctypes.c_char * self.capacity).from_address(self.address)
            self._tensor = torch.frombuffer(raw, dtype=torch.uint8)
        if not self._is_pinned:
            code = torch.cuda.cudart().cudaHostRegister(self.address, self.capacity, 0)
            if int(code) != 0:
                raise RingError(f"cudaHostRegister of a {self.capacity}-byte ring failed "
                                f"(cudaError {int(code)}); is the memlock limit too low?")
            self._is_pinned = True
        return self._tensor

    def close(self) -> None:
        if self._is_pinned:
            torch.cuda.cudart().cudaHostUnregister(self.address)
            self._is_pinned = False
        self._tensor = None
        self.data.release()
        self._view.release()
        self._map.close()


def _copy_bytes(dst: memoryview, src: memoryview) -> None:
    """`dst[:] = src` (byte views of one size); large copies without the GIL."""
    if dst.nbytes >= _GIL_FREE_COPY_BYTES and not (dst.readonly or src.readonly):
        torch.frombuffer(dst, dtype=torch.uint8).copy_(torch.frombuffer(src, dtype=torch.uint8))
    else:
        dst[:] = src


def _device_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor's data as a flat uint8 tensor (a copy only if it is not
    contiguous)."""
    return tensor.detach().contiguous().view(-1).view(torch.uint8)


def _host_bytes(tensor: torch.Tensor) -> memoryview:
    """A CPU tensor's data as a flat byte view (a copy only if it is not
    contiguous); the view keeps the memory alive."""
    flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
    return memoryview(flat.numpy())


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
        if self.capacity < _SMALLEST_RING or self.capacity % 8:
            raise RingError(f"ring capacity {self.capacity}: need a multiple of 8 of at "
                            f"least {_SMALLEST_RING} bytes")
        self.name = name
        self._tag = f"[{owner}] ring to {peer}"
        self.peer = peer
        self.ring_path, self.socket_path = ring_paths(prefix, name, directory)
        self._lock = threading.Lock()
        self._head = 0
        self._num_sent = 0
        self._conn: socket.socket | None = None
        self._tails: _Positions | None = None
        self._is_closed = False
        self._broken: BaseException | None = None
        fd = os.open(self.ring_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.fchmod(fd, 0o600)
            # Allocated now: a full /dev/shm fails here, with a message, rather
            # than with SIGBUS on a later write into the mapping.
            try:
                os.posix_fallocate(fd, 0, _HEADER_PAGE + self.capacity)
            except OSError as exc:
                raise RingError(
                    f"{self._tag}: cannot allocate {_HEADER_PAGE + self.capacity} bytes "
                    f"for {self.ring_path}: {exc.strerror}; is {directory} full? (a "
                    f"smaller RingSettings.capacity_bytes needs less)") from None
            self._segment = _Segment(fd, self.capacity)
        except BaseException:
            os.close(fd)
            _unlink_quietly(self.ring_path)
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
            _unlink_quietly(self.ring_path)
            _unlink_quietly(self.socket_path)
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
            hello = _recv_exact(conn, _RECORD.size)
        except OSError:
            hello = b""
        if len(hello) != _RECORD.size or _RECORD.unpack(hello)[0] != _HELLO:
            conn.close()
            raise RingError(f"{self._tag}: the process that connected to "
                            f"{self.socket_path} did not greet as a ring consumer")
        conn.settimeout(None)
        self._conn = conn
        self._tails = _Positions(conn)
        self._listener.close()
        _unlink_quietly(self.ring_path)
        _unlink_quietly(self.socket_path)
        logger.debug("%s: %s attached", self._tag, self.peer)

    def send(self, header: bytes, views: Sequence[memoryview], timeout_s: float) -> None:
        """Copy one message (header plus the bytes of `views`, in order) into the
        ring, streaming it when it is larger; returns once all of it is in the
        ring (not necessarily read). `RingPeerGone` if the consumer is gone."""
        if len(header) > _MAX_HEADER_BYTES:
            raise RingError(f"{self._tag}: a header of {len(header)} bytes is over the "
                            f"{_MAX_HEADER_BYTES}-byte limit")
        deadline = time.monotonic() + timeout_s
        with self._lock:
            if self._is_closed:
                raise RingError(f"{self._tag}: send after close")
            if self._broken is not None:
                raise RingError(f"{self._tag}: the ring is unusable after an earlier "
                                f"failure: {self._broken}")
            if self._conn is None:
                self.wait_attached(max(deadline - time.monotonic(), 0.0))
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
        self.send(header, [_device_bytes(t) if t.is_cuda else _host_bytes(t) for t in tensors],
                  timeout_s)

    def _send_frame(self, header: bytes, views: Sequence[memoryview | torch.Tensor],
                    deadline: float) -> None:
        """Copy one frame in: in one go when it fits without wrapping, else
        streamed in pieces as the consumer makes room. A source is a byte view
        or a flat uint8 CUDA tensor."""
        views = [view if isinstance(view, torch.Tensor) or (view.format == "B" and view.ndim == 1)
                 else view.cast("B") for view in views]
        payload_bytes = sum(view.nbytes for view in views)
        total = _FRAME.size + len(header) + payload_bytes
        start = self._head % self.capacity
        has_device = any(isinstance(view, torch.Tensor) for view in views)
        if (not has_device and total <= self.capacity - (self._head - self._tails.last)
                and start + total <= self.capacity and total <= self.capacity // 4):
            # The common small message: room for all of it without wrapping.
            data = self._segment.data
            _FRAME.pack_into(data, start, _FRAME_MAGIC, len(header), payload_bytes)
            at = start + _FRAME.size
            data[at:at + len(header)] = header
            at += len(header)
            for view in views:
                _copy_bytes(data[at:at + view.nbytes], view)
                at += view.nbytes
            self._head += total
        else:
            self._write(memoryview(_FRAME.pack(_FRAME_MAGIC, len(header), payload_bytes)
                                   + header), deadline)
            for view in views:
                self._write(view, deadline)
        self._publish(deadline)

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
                _copy_bytes(data[start:start + n], view[done:done + n])
            done += n
            self._head += n
            if n == piece or self._head % piece == 0:
                self._publish(deadline)

    def _publish(self, deadline: float) -> None:
        """Tell the consumer how far the ring is written (its wake-up)."""
        try:
            _send_record(self._conn, self._head, deadline)
        except TimeoutError:
            raise RingError(f"{self._tag}: {self.peer} has not read the ring's "
                            f"notifications past the deadline; is it stuck?") from None
        except OSError as exc:
            raise self._gone() from exc

    def _wait_for_room(self, deadline: float) -> None:
        tails = self._tails
        tails.read(None)
        while self.capacity - (self._head - tails.last) == 0:
            if tails.is_eof:
                raise self._gone()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RingError(
                    f"{self._tag}: no room in the ring for {self.capacity} bytes of "
                    f"waiting data past the deadline; {self.peer} does not read")
            tails.read(remaining)

    def wait_consumed(self, timeout_s: float) -> None:
        """Wait until the consumer has read every message sent so far (a flush):
        asks for its tail with a sync record, which it answers once it has
        nothing left to read. `RingPeerGone` if it dies meanwhile."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            if self._conn is None or self._is_closed or self._head == self._tails.last:
                return
            try:
                _send_record(self._conn, _SYNC, deadline)
            except TimeoutError:
                raise RingError(f"{self._tag}: {self.peer} has not read the ring's "
                                f"notifications past the deadline; is it stuck?") from None
            except OSError as exc:
                raise self._gone() from exc
            tails = self._tails
            tails.read(None)
            while tails.last < self._head:
                if tails.is_eof:
                    raise self._gone()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RingError(
                        f"{self._tag}: {self.peer} has not read the last "
                        f"{self._head - tails.last} bytes within {timeout_s:g} s; is it stuck?")
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
            if self._conn is not None:
                try:
                    _send_record(self._conn, _CLOSED, time.monotonic() + _CLOSE_NOTICE_S)
                except OSError:
                    pass  # the consumer is gone or stuck; closing anyway
                self._conn.close()
            else:
                self._tell_waiting_consumer()
                self._listener.close()
            self._segment.close()
            _unlink_quietly(self.ring_path)
            _unlink_quietly(self.socket_path)


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
            _send_record(conn, _CLOSED, time.monotonic() + _CLOSE_NOTICE_S)
        except OSError:
            pass  # the consumer is gone or stuck; closing anyway
        finally:
            conn.close()


def _recv_exact(conn: socket.socket, nbytes: int) -> bytes:
    data = b""
    while len(data) < nbytes:
        more = conn.recv(nbytes - len(data))
        if not more:
            break
        data += more
    return data


class RingReader:
    """The consumer end: attaches to a producer's segment.

        reader = RingReader.attach(prefix, "w0-s0", owner="server 0", peer="worker 0")
        header, nbytes = reader.recv_header(timeout_s=60)
        reader.recv_payload_into(buffer_of_nbytes, timeout_s=60)
        reader.close()
    """

    def __init__(self, conn: socket.socket, segment: _Segment, *, owner: str, peer: str,
                 name: str) -> None:
        self._conn = conn
        self._segment = segment
        self.capacity = segment.capacity
        self.name = name
        self.peer = peer
        self._tag = f"[{owner}] ring from {peer}"
        self._heads = _Positions(conn)
        self._tail = 0
        self._reported = 0
        self._is_producer_gone = False
        self._payload_left = 0
        self._num_received = 0
        self._prefix = bytearray(_FRAME.size)
        self._lock = threading.Lock()
        self._is_closed = False

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
                except BaseException:
                    conn.close()
                    os.close(fd)
                    raise
                break
            except (FileNotFoundError, ConnectionRefusedError):
                # The producer has not created its files yet (a bounded poll:
                # there is nothing to wait on before the files exist).
                if time.monotonic() + delay > deadline:
                    raise RingError(
                        f"{tag}: {ring_path} did not appear within {timeout_s:g} s; is "
                        f"{peer} running on this host with the same job prefix?") from None
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
        try:
            size = os.fstat(fd).st_size
            header = os.pread(fd, _SEGMENT_HEADER.size, 0)
            magic, version, capacity = _SEGMENT_HEADER.unpack(header)
            if magic != _SEGMENT_MAGIC or version != _VERSION or size != _HEADER_PAGE + capacity:
                raise RingError(f"{tag}: {ring_path} is not a version-{_VERSION} ring "
                                f"(magic {magic:#x}, version {version}, {size} bytes)")
            segment = _Segment(fd, capacity)
        except BaseException:
            conn.close()
            raise
        finally:
            os.close(fd)
        try:
            conn.sendall(_RECORD.pack(_HELLO))
        except OSError as exc:
            conn.close()
            segment.close()
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
            available = self._wait_available(_FRAME.size, deadline, is_start=True)
            data, start = self._segment.data, self._tail % self.capacity
            if start + _FRAME.size <= self.capacity:
                magic, header_bytes, payload_bytes = _FRAME.unpack_from(data, start)
                self._consume(_FRAME.size)
            else:
                self._read_into(memoryview(self._prefix), deadline)
                magic, header_bytes, payload_bytes = _FRAME.unpack(self._prefix)
            if magic != _FRAME_MAGIC or header_bytes > _MAX_HEADER_BYTES:
                raise RingError(f"{self._tag}: broken frame after {self._num_received} "
                                f"messages (magic {magic:#x}, header {header_bytes} bytes)")
            start = self._tail % self.capacity
            if available - _FRAME.size >= header_bytes and start + header_bytes <= self.capacity:
                header = bytes(data[start:start + header_bytes])
                self._consume(header_bytes)
            else:
                buffer = bytearray(header_bytes)
                self._read_into(memoryview(buffer), deadline)
                header = bytes(buffer)
            self._payload_left = payload_bytes
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
            while self._payload_left:
                n = self._wait_available(1, deadline)
                n = min(n, self._payload_left)
                self._consume(n)
                self._payload_left -= n
            self._num_received += 1

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
                _copy_bytes(dst[done:done + n], data[start:start + n])
            done += n
            self._consume(n)

    def _wait_available(self, need: int, deadline: float, is_start: bool = False) -> int:
        heads = self._heads
        while heads.last - self._tail < need:
            if heads.is_closed and heads.last == self._tail:
                raise RingClosed(f"{self._tag}: {self.peer} closed the ring after "
                                 f"{self._num_received} messages")
            if heads.is_eof:
                where = ("" if is_start else " in the middle of a message")
                raise RingPeerGone(
                    f"{self._tag}: {self.peer} dropped its end of the ring{where} after "
                    f"{self._num_received} messages (did the process die?)")
            if heads.is_sync_requested:
                # Nothing left to read: everything published is consumed.
                heads.is_sync_requested = False
                self._report()
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
        """Tell the producer how far the ring is read. Every quarter ring is
        enough for it never to wait on room that is free: when it finds the
        ring full, the consumer has read at most a quarter ring it has not
        reported, so the consumer is not waiting for data."""
        if self._is_producer_gone:
            return
        try:
            # The producer reads these only when it runs out of room, so its
            # socket buffer holds a ring's worth of reports many times over.
            _send_record(self._conn, self._tail, None)
        except OSError:
            # The producer closed or died; what it published before is still
            # read (its records are in our socket), then the end-of-file says so.
            self._is_producer_gone = True
        self._reported = self._tail

    def close(self) -> None:
        with self._lock:
            if self._is_closed:
                return
            self._is_closed = True
            self._conn.close()
            self._segment.close()
