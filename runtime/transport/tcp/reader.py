"""A data connection's frames, read through one fixed read-ahead buffer.

Why: a small message (its header, envelope and data) mostly arrives in one
TCP segment; one `recv` for all of it, instead of one for each part (each
with a `poll` and two changes of the socket's timeout mode), measured about
a quarter of a 4 KiB round trip's time on this machine (docs/data-plane.md).

What stays: the buffer is allocated once per connection, after its hello
passed (`server` reads the hello exactly, without it), and never grows: a
peer makes the receiver hold at most `READ_AHEAD_BYTES` it has not admitted
yet, as the kernel's socket buffer does anyway. A message's data reaches its
receive buffer only after admission, and data beyond what is buffered is
read by the kernel straight into its place (`read_into`).

Deadlines: waiting for a frame's first byte has none (a connection may idle
between messages); every later wait for the frame's bytes is bounded by
`timeout_s` (TimeoutError: the sender stalled mid-frame). The socket's
timeout mode is changed only when a frame does not arrive whole.
"""

from __future__ import annotations

import socket

from .wire import HEADER, PeerClosed

__all__ = ["FrameReader", "READ_AHEAD_BYTES"]

# Twice TcpSettings.coalesce_bytes' default: a message sent in one write
# fits with the next one's header.
READ_AHEAD_BYTES = 128 << 10
_UNKNOWN = -1.0  # the socket's timeout as set by someone else


class FrameReader:
    """Reads frames (`header`, then `take` or `read_into` for their bytes) from
    `sock` (see the module)."""

    __slots__ = ("sock", "_timeout_s", "_buffer", "_view", "_start", "_end", "_mode")

    def __init__(self, sock: socket.socket, timeout_s: float,
                 size: int = READ_AHEAD_BYTES) -> None:
        self.sock = sock
        self._timeout_s = timeout_s
        self._buffer = bytearray(size)
        self._view = memoryview(self._buffer)
        self._start = 0  # buffered bytes not taken yet: [_start, _end)
        self._end = 0
        self._mode: float | None = _UNKNOWN

    def header(self) -> tuple[int, int]:
        """The next frame's (kind, length); its first byte is waited for
        without a deadline, the rest within timeout_s."""
        if self._end - self._start < HEADER.size:
            self._fill(HEADER.size)
        start = self._start
        self._start = start + HEADER.size
        return HEADER.unpack_from(self._buffer, start)

    def take(self, size: int) -> memoryview:
        """The frame's next `size` bytes, a view valid until the next read (a
        buffer of their own when they do not fit the read-ahead buffer)."""
        if size > len(self._buffer):
            return memoryview(self.copy(size))
        if self._end - self._start < size:
            self._fill(size)
        start = self._start
        self._start = start + size
        return self._view[start:start + size]

    def copy(self, size: int) -> bytearray:
        """The frame's next `size` bytes, in a bytearray of their own."""
        if self._end - self._start >= size:
            start = self._start
            self._start = start + size
            return bytearray(self._view[start:start + size])
        out = bytearray(size)
        self.read_into(memoryview(out))
        return out

    def read_into(self, view: memoryview) -> None:
        """Fill `view` (flat bytes) with the frame's next bytes: those buffered,
        then the rest straight from the socket."""
        size = view.nbytes
        have = min(self._end - self._start, size)
        if have:
            view[:have] = self._view[self._start:self._start + have]
            self._start += have
        if have < size:
            self._set_mode(self._timeout_s)
            got = have
            while got < size:
                count = self.sock.recv_into(view[got:], size - got)
                if count == 0:
                    raise PeerClosed(f"the connection ended after {got} of {size} bytes")
                got += count

    def _fill(self, size: int) -> None:
        """Read until `size` bytes are buffered (at most the buffer's size)."""
        idle = self._start == self._end  # no byte of the frame is here yet
        if idle:
            self._start = self._end = 0
        elif len(self._buffer) - self._start < size:  # make room: the rest to the front
            count = self._end - self._start
            self._view[:count] = self._view[self._start:self._end]
            self._start, self._end = 0, count
        while self._end - self._start < size:
            self._set_mode(None if idle else self._timeout_s)
            count = self.sock.recv_into(self._view[self._end:])
            if count == 0:
                raise PeerClosed(f"the connection ended after {self._end - self._start} of "
                                 f"{size} bytes")
            self._end += count
            idle = False

    def _set_mode(self, timeout_s: float | None) -> None:
        if self._mode != timeout_s:
            self.sock.settimeout(timeout_s)
            self._mode = timeout_s
