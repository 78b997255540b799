"""A message on its way out: `outgoing()` stages it to host memory, encodes
it and frames it at once when small; a `SendQueue` per peer holds it,
bounded in bytes, until its sender thread has handed it to gRPC.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from splitrun.splitter.labels import Label

from ...errors import TransportError
from ..buffers import EncodedTensors, encode
from ..framing import CHUNK_OVERHEAD, EnvelopeWriter, frame_message
from ..keys import MessageKey
from .settings import GrpcSettings

__all__ = ["Outgoing", "SendQueue", "outgoing"]

logger = logging.getLogger(__name__)

# CPU messages up to this size are framed (copied) in send() itself: cheaper
# than framing them later on gRPC's thread, and the caller's tensors are free
# again at once.
_FRAME_AT_SEND_BYTES = 64 << 10


@dataclass(eq=False, slots=True)
class Outgoing:
    """A queued message: either already framed (`chunk`, small CPU messages,
    copied at send time) or framed when its turn comes (`encoded` views)."""

    key: MessageKey
    nbytes: int
    chunk: bytes | None = None
    envelope: bytes = b""
    encoded: EncodedTensors | None = None
    ready: tuple = ()  # CUDA events to wait on before the bytes may be read


class SendQueue:
    """A FIFO bounded in bytes. `put` blocks while the queue is over its bound
    (a message larger than the bound goes when the queue is empty); the head
    stays queued until its last byte is handed to gRPC, then `pop` frees it.

    The consumer is woken through a `queue.SimpleQueue` of tokens, which
    measured several times cheaper than a `threading.Condition` on the
    small-message path; a condition serves only senders held back by the bound.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._items: deque[Outgoing] = deque()
        self._bytes = 0
        self._lock = threading.Lock()
        self._space = threading.Condition(self._lock)
        self._num_waiting = 0  # senders held back by the bound
        self._signal: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._is_closed = False
        self._error: BaseException | None = None

    def put(self, item: Outgoing, timeout_s: float) -> bool:
        """Queue `item`; False if the bound held it back for `timeout_s`."""
        with self._lock:
            if self._bytes and self._bytes + item.nbytes > self.max_bytes:
                deadline = time.monotonic() + timeout_s
                self._num_waiting += 1
                try:
                    while self._bytes and self._bytes + item.nbytes > self.max_bytes:
                        if self._error is not None:
                            raise self._error
                        remaining = deadline - time.monotonic()
                        if remaining <= 0:
                            return False
                        self._space.wait(remaining)
                finally:
                    self._num_waiting -= 1
            if self._error is not None:
                raise self._error
            if self._is_closed:
                raise TransportError("the transport is closed; nothing more is sent")
            self._items.append(item)
            self._bytes += item.nbytes
        self._signal.put(None)
        return True

    def peek(self, timeout_s: float, stop: Callable[[], bool] = lambda: False,
             end_when_empty: Callable[[], bool] = lambda: False) -> Outgoing | None:
        """The head, waiting up to `timeout_s`; None when failed or stopped, when
        closed (or `end_when_empty`) and empty, or when nothing came in time."""
        deadline = None
        while True:
            if self._error is not None or stop():
                return None
            items = self._items
            if items:
                return items[0]
            if self._is_closed or end_when_empty():
                return None
            if deadline is None:
                deadline = time.monotonic() + timeout_s
                remaining = timeout_s
            else:
                remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            try:
                self._signal.get(timeout=remaining)
            except queue.Empty:
                return None

    def pop(self, item: Outgoing) -> None:
        with self._lock:
            if self._items and self._items[0] is item:
                self._items.popleft()
                self._bytes -= item.nbytes
                if self._num_waiting:
                    self._space.notify_all()

    def close(self) -> None:
        self._is_closed = True
        self.wake()

    def wake(self) -> None:
        """Make a waiting `peek` look again (at its predicates, too)."""
        self._signal.put(None)

    def fail(self, error: BaseException) -> list[Outgoing]:
        """Refuse further puts with `error`; return the messages dropped."""
        with self._lock:
            self._error = error
            dropped = list(self._items)
            self._items.clear()
            self._bytes = 0
            self._space.notify_all()
        self._signal.put(None)
        return dropped

    @property
    def is_closed(self) -> bool:
        return self._is_closed

    def __len__(self) -> int:
        return len(self._items)

    @property
    def nbytes(self) -> int:
        return self._bytes


def outgoing(settings: GrpcSettings, tag: str, envelopes: EnvelopeWriter, dst: Label,
             key: MessageKey, tensors: Sequence[torch.Tensor]) -> Outgoing:
    """`tensors` as a queued message for `dst` (from the process `tag` names):
    staged to host memory, encoded, and framed at once when small."""
    staged, events = _stage(tensors)
    encoded = encode(staged)
    header = envelopes.serialize(key, encoded)
    room = settings.max_request_bytes - settings.chunk_bytes - CHUNK_OVERHEAD
    if len(header) > room:
        raise TransportError(
            f"{tag} send {key}: the envelope of {len(encoded.tensors)} tensors "
            f"takes {len(header)} bytes, more than the {room} that max_request_bytes "
            f"leaves beside a chunk; fuse fewer values per channel or raise it")
    nbytes = encoded.total_bytes + len(header)
    logger.debug("%s queued %s for %s (%d bytes)", tag, key, dst, encoded.total_bytes)
    if not events and encoded.total_bytes <= _FRAME_AT_SEND_BYTES:
        (chunk,) = frame_message(header, encoded.views, encoded.total_bytes,
                                 settings.chunk_bytes)
        return Outgoing(key, nbytes, chunk=chunk)
    return Outgoing(key, nbytes, envelope=header, encoded=encoded, ready=events)


def _stage(tensors: Sequence[torch.Tensor]) -> tuple[Sequence[torch.Tensor], tuple]:
    """CPU tensors for the wire, and the CUDA events to wait on before reading
    them: CUDA tensors are copied into pinned host memory without blocking (torch's
    caching host allocator recycles the pinned blocks); CPU ones pass as they are."""
    for tensor in tensors:
        if not tensor.is_cpu:
            break
    else:
        return tensors, ()
    staged = []
    devices = set()
    for tensor in tensors:
        if tensor.is_cpu:
            staged.append(tensor)
        elif tensor.is_cuda and torch.cuda.is_available():
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor.detach(), non_blocking=True)
            staged.append(host)
            devices.add(tensor.device)
        else:
            staged.append(tensor.detach().to("cpu"))
    events = []
    for device in sorted(devices, key=str):
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events.append(event)
    return staged, tuple(events)
