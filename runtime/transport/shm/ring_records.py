"""The ring's positions between its two ends: 8-byte records over a Unix
stream socket. The producer sends its head (bytes published), the consumer its
tail (bytes consumed); the records are the wake-up, their syscalls order the
memory accesses, and the socket's end-of-file says the other process died."""

from __future__ import annotations

import select
import socket
import struct
import time

__all__ = ["RECORD", "HELLO", "CLOSED", "SYNC", "READ_FLAG", "send_record", "recv_exact",
           "Positions"]

RECORD = struct.Struct("<Q")           # a head (producer) or tail (consumer) position
HELLO = 0x4845_4C4C_4F53_524E           # the consumer's first record
CLOSED = (1 << 64) - 1                 # the producer's last record: closed in order
SYNC = (1 << 64) - 2                   # the producer asks for the consumer's tail (flush)
# Set on a consumer's record that says how far it has read, as against how far
# the ring is free (plain records): a payload lent in place is read, not free.
READ_FLAG = 1 << 62


def send_record(sock: socket.socket, value: int, deadline: float | None) -> None:
    """Send one position record, waiting for socket room until `deadline`
    (None: as long as it takes). OSError when the peer's end is gone."""
    data = memoryview(RECORD.pack(value))
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


class Positions:
    """Records from the other end of the socket, read with deadlines. Keeps the
    largest position seen (`last`; for a consumer's records, how far the ring
    is free, and `read_up_to`, how far it is read); notices end-of-file (the
    peer's end is gone)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._poller = select.poll()
        self._poller.register(sock, select.POLLIN)
        self._buffer = bytearray(4096)
        self._view = memoryview(self._buffer)
        self._pending = 0      # bytes of a partial record at the buffer's start
        self.last = 0
        self.read_up_to = 0
        self.is_closed = False  # the peer sent CLOSED
        self.is_sync_requested = False  # the peer sent SYNC and has no answer yet
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
        whole = end - end % RECORD.size
        for (value,) in RECORD.iter_unpack(self._view[:whole]):
            if value == CLOSED:
                self.is_closed = True
            elif value == SYNC:
                self.is_sync_requested = True
            elif value & READ_FLAG:
                self.read_up_to = max(self.read_up_to, value & ~READ_FLAG)
            else:
                self.last = max(self.last, value)
        self._pending = end - whole
        if self._pending:
            self._buffer[:self._pending] = self._buffer[whole:end]
        return True


def recv_exact(conn: socket.socket, nbytes: int) -> bytes:
    data = b""
    while len(data) < nbytes:
        more = conn.recv(nbytes - len(data))
        if not more:
            break
        data += more
    return data
