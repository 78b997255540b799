"""Large messages striped over several connections to one peer.

Why: one TCP connection is one sending thread and one receiving thread; a
large message split over `TcpSettings.stripes` connections is written and
read by that many threads at once, each straight between the tensor's
memory and its place in the receive buffer (measured in docs/data-plane.md).

The message's bytes (its tensors' bytes, concatenated in wire order) are
cut into `parts` contiguous ranges (`bounds`). Part 0 follows the envelope
on the main connection (frame SPLIT); part k travels on stripe connection
k, after a PART frame naming the message's index on the main connection.

Sending: one `StripeSender` thread per stripe connection writes its part
while the caller writes part 0. Receiving: a `StripeGroup` per main
connection, where the main connection's thread posts the places of the
parts once the message is admitted (no stripe reads a byte of a message
before that), and waits until every stripe thread has read its part.
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence

from . import wire

__all__ = ["bounds", "views_between", "StripeSender", "StripeGroup", "StripeFailed"]


def bounds(total: int, parts: int) -> list[tuple[int, int]]:
    """`parts` contiguous byte ranges covering `total` bytes, as even as can be."""
    return [(total * k // parts, total * (k + 1) // parts) for k in range(parts)]


def views_between(views: Sequence[memoryview], start: int, end: int) -> list[memoryview]:
    """The pieces of `views` (flat byte views, concatenated) between byte
    offsets `start` and `end`."""
    out = []
    offset = 0
    for view in views:
        size = view.nbytes
        low, high = max(start - offset, 0), min(end - offset, size)
        if low < high:
            out.append(view[low:high])
        offset += size
        if offset >= end:
            break
    return out


class StripeFailed(ConnectionError):
    """A stripe connection failed, or its main connection ended."""


class StripeSender:
    """Writes parts on one stripe connection, on its own thread. A failed
    write calls `on_fail(self, error)` at once (from that thread), so the
    other connections can stop writing a message that cannot arrive."""

    def __init__(self, sock: socket.socket, index: int, name: str,
                 on_fail: Callable[[StripeSender, BaseException], None]) -> None:
        self.sock = sock
        self.index = index
        self._on_fail = on_fail
        self._cond = threading.Condition()
        self._job: tuple[int, list[memoryview]] | None = None
        self._busy = False
        self._error: BaseException | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)
        self._thread.start()

    def start(self, seq: int, views: list[memoryview]) -> None:
        with self._cond:
            self._job, self._busy, self._error = (seq, views), True, None
            self._cond.notify_all()

    def wait(self, timeout_s: float) -> BaseException | None:
        """Wait for the part started last; its error, if any (a part not
        written within `timeout_s` is a TimeoutError)."""
        with self._cond:
            if not self._cond.wait_for(lambda: not self._busy, timeout_s):
                return TimeoutError(f"stripe {self.index}: its part was not written in "
                                    f"{timeout_s:g} s")
            return self._error

    def abort(self) -> None:
        """Make a write in flight fail now (the link is broken)."""
        try:
            socket.socket.shutdown(self.sock, socket.SHUT_RDWR)
        except (OSError, ssl.SSLError):
            pass

    def stop(self, timeout_s: float) -> None:
        """End the thread (after the part in flight, bounded by the socket's timeout)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._job is not None or self._stopping)
                if self._job is None:
                    return
                (seq, views), self._job = self._job, None
            error = None
            try:
                self.sock.sendall(wire.part(seq))
                for view in views:
                    self.sock.sendall(view)
            except BaseException as exc:  # noqa: BLE001 - handed to the sending thread
                error = exc
                self._on_fail(self, exc)
            with self._cond:
                self._busy, self._error = False, error
                self._cond.notify_all()


class StripeGroup:
    """The receiving side's meeting point of one main connection and its
    stripe connections (see the module)."""

    def __init__(self, link_id: bytes) -> None:
        self.link_id = link_id
        self._cond = threading.Condition()
        self._stripes: dict[int, socket.socket] = {}
        # seq -> part index -> the views its bytes go to; removed when read.
        self._posted: dict[int, dict[int, list[memoryview]]] = {}
        self._progress = 0  # bumped whenever a part starts or ends
        self._failure: str | None = None

    def join(self, index: int, sock: socket.socket) -> bool:
        """Stripe connection `index` joins; False if taken, out of range or ended."""
        with self._cond:
            if self._failure is not None or index in self._stripes or \
                    not 0 < index < wire.MAX_STRIPES:
                return False
            self._stripes[index] = sock
            return True

    def post(self, seq: int, parts: dict[int, list[memoryview]]) -> None:
        """The main connection admitted message `seq`: where each part goes."""
        with self._cond:
            missing = [index for index in parts if index not in self._stripes]
            if missing:
                raise StripeFailed(f"a message in {len(parts) + 1} parts, but stripe "
                                   f"connection {missing[0]} did not join")
            self._posted[seq] = dict(parts)
            self._cond.notify_all()

    def take(self, seq: int, index: int, timeout_s: float) -> list[memoryview]:
        """Stripe `index` read the PART of message `seq`: wait (at most
        `timeout_s`) until the main connection admitted it; where its bytes go."""
        with self._cond:
            ready = self._cond.wait_for(
                lambda: self._failure is not None or index in self._posted.get(seq, {}),
                timeout_s)
            if self._failure is not None:
                raise StripeFailed(self._failure)
            if not ready:
                raise TimeoutError(f"part {index} of message {seq} came, but not its "
                                   f"envelope on the main connection")
            self._progress += 1
            return self._posted[seq][index]

    def done(self, seq: int, index: int) -> None:
        with self._cond:
            posted = self._posted.get(seq)
            if posted is not None:
                posted.pop(index, None)
            self._progress += 1
            self._cond.notify_all()

    def wait(self, seq: int, stall_s: float) -> None:
        """The main connection waits until every part of `seq` was read;
        TimeoutError if no part starts or ends for `stall_s`."""
        with self._cond:
            deadline = time.monotonic() + stall_s
            progress = self._progress
            while self._posted.get(seq):
                if self._failure is not None:
                    raise StripeFailed(self._failure)
                if self._progress != progress:
                    progress, deadline = self._progress, time.monotonic() + stall_s
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"the stripes of message {seq} stalled")
                self._cond.wait(remaining)
            self._posted.pop(seq, None)
            if self._failure is not None:
                raise StripeFailed(self._failure)

    def fail(self, why: str) -> None:
        """Wake every waiter with `why`; end every stripe connection (their
        threads stop reading; their senders' writes fail)."""
        with self._cond:
            if self._failure is None:
                self._failure = why
            stripes = list(self._stripes.values())
            self._cond.notify_all()
        for sock in stripes:
            try:
                # socket's own shutdown: an SSLSocket's would drop its TLS state
                # under the thread reading it.
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
            except (OSError, ssl.SSLError):
                pass
