"""The mapped segment of one ring and what its bytes hold: a 4 KiB header
page (magic, version, capacity; a closed flag), then `capacity` data bytes that
carry frames, wrapping around: a 16-byte prefix (magic, header length and the
padding after the header, payload length), the header, up to 63 padding bytes
so the payload starts on a 64-byte boundary, the payload. A skip frame (its
own magic) fills the ring's end when a large payload would not fit there
whole, so such payloads lie in one piece that the consumer may view in place.
And the byte copies in and out of the segment."""

from __future__ import annotations

import ctypes
import mmap
import os
import struct

import torch

from .job_files import HEADER_PAGE  # what a ring's file takes is said there, beside its name
from .ring_errors import RingError

__all__ = ["HEADER_PAGE", "SEGMENT_MAGIC", "VERSION", "SEGMENT_HEADER", "FRAME_MAGIC",
           "SKIP_MAGIC", "FRAME", "PAYLOAD_ALIGN", "LENDABLE_BYTES", "frame_header_field",
           "split_header_field", "payload_padding", "MAX_HEADER_BYTES", "GIL_FREE_COPY_BYTES",
           "POPULATE_AHEAD_BYTES", "Segment", "copy_bytes", "device_bytes", "host_bytes",
           "is_marked_closed"]

SEGMENT_MAGIC = 0x5350_4C49_5452_494E  # "SPLITRIN"
VERSION = 2
SEGMENT_HEADER = struct.Struct("<QIQ")   # magic, version, capacity
# The producer sets this word before it closes any socket, so a consumer whose
# attach fails can tell an orderly close from a producer that died.
CLOSED_FLAG_OFFSET = 64
CLOSED_FLAG = struct.Struct("<I")
FRAME_MAGIC = 0x5352_4E47              # "SRNG"
SKIP_MAGIC = 0x534B_4950               # "SKIP": the rest of the ring is unused
FRAME = struct.Struct("<IIQ")          # magic, header bytes | padding << 25, payload bytes
# Payloads start at multiples of this in the ring (so every dtype viewed in
# place is aligned, and vector loads start on a cache line).
PAYLOAD_ALIGN = 64
_PAD_SHIFT = 25  # the header's length takes the low 25 bits (MAX_HEADER_BYTES = 2**24)
# Payloads at least this large (and at most half the ring, with their frame)
# lie in one piece, never wrapping: the consumer may lend them out in place.
LENDABLE_BYTES = 1 << 20
# A header (the transport's envelope) larger than this is refused as corrupt.
MAX_HEADER_BYTES = 16 << 20


def frame_header_field(header_bytes: int, padding: int) -> int:
    """The prefix's second field: the header's length and the padding after it."""
    return header_bytes | padding << _PAD_SHIFT


def split_header_field(field: int) -> tuple[int, int]:
    """(header bytes, padding bytes) of a prefix's second field."""
    return field & ((1 << _PAD_SHIFT) - 1), field >> _PAD_SHIFT


def payload_padding(position: int) -> int:
    """Padding bytes that move a payload from ring offset `position` to the next
    `PAYLOAD_ALIGN` boundary (capacities are multiples of it)."""
    return -position % PAYLOAD_ALIGN


# Pieces at least this large are copied by `memmove` through ctypes, which
# lets go of the GIL while it copies (a memoryview assignment holds it): a
# server's readers of two workers' rings copy at once, and the main thread
# runs meanwhile.
GIL_FREE_COPY_BYTES = 256 << 10
# ctypes' memmove is the C library's, called without the GIL.
_memmove = ctypes.memmove
# The producer has the data pages filled at least this many bytes ahead of
# its writes (`populate_through`).
POPULATE_AHEAD_BYTES = 1 << 20
# madvise(2)'s MADV_POPULATE_READ and _WRITE (Linux 5.14), which Python
# 3.11's mmap does not name.
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


class Segment:
    """The mapped segment file: header page plus data."""

    def __init__(self, fd: int, capacity: int) -> None:
        self.capacity = capacity
        # Not populated at once: filling a 64 MiB ring's page tables (and
        # zeroing its pages) costs 25-30 ms of CPU per ring and mapping, 0.4 s
        # at the start of a job of 4 processes, for pages a job of small
        # messages never touches. The producer fills them ahead of its
        # writes instead (`populate_through`), and the whole ring at its first
        # large payload, when the consumer fills its own mapping too; before
        # that, the consumer's first read of a page is a cheap fault.
        self._map = mmap.mmap(fd, HEADER_PAGE + capacity, mmap.MAP_SHARED,
                              mmap.PROT_READ | mmap.PROT_WRITE)
        self._populated = 0  # data[:_populated] has its page tables filled
        self._view = memoryview(self._map)
        self.data = self._view[HEADER_PAGE:]
        anchor = ctypes.c_char.from_buffer(self._map, HEADER_PAGE)
        self.address = ctypes.addressof(anchor)
        del anchor  # no export of the map may outlive close()
        self._tensor: torch.Tensor | None = None
        self._is_pinned = False

    def populate_through(self, end: int, *, is_reader: bool = False) -> None:
        """Fill the page tables of data[:end] now, in one call for at least
        POPULATE_AHEAD_BYTES: the copies then run over mapped pages, not
        through a fault on each fresh page (measured: a 1 MiB message walking
        through fresh pages of a 64 MiB ring ran 4x slower). The producer's
        call allocates the pages; a reader's (`is_reader`) maps those. Where
        the kernel cannot (before 5.14), pages fault in on first use."""
        if end <= self._populated:
            return
        stop = max(end, self._populated + POPULATE_AHEAD_BYTES)
        stop = min(self.capacity, -(-stop // mmap.PAGESIZE) * mmap.PAGESIZE)
        advice = _MADV_POPULATE_READ if is_reader else _MADV_POPULATE_WRITE
        try:
            self._map.madvise(advice, HEADER_PAGE + self._populated, stop - self._populated)
        except (OSError, ValueError):
            stop = self.capacity  # not supported: first writes fault instead
        self._populated = stop

    def write_header(self) -> None:
        SEGMENT_HEADER.pack_into(self._map, 0, SEGMENT_MAGIC, VERSION, self.capacity)

    def mark_closed(self) -> None:
        CLOSED_FLAG.pack_into(self._map, CLOSED_FLAG_OFFSET, 1)

    def is_marked_closed(self) -> bool:
        return CLOSED_FLAG.unpack_from(self._map, CLOSED_FLAG_OFFSET)[0] == 1

    def tensor(self) -> torch.Tensor:
        """The data as a flat uint8 tensor over the same memory, pinned for
        CUDA copies (registered on first use)."""
        if self._tensor is None:
            raw = (ctypes.c_char * self.capacity).from_address(self.address)
            self._tensor = torch.frombuffer(raw, dtype=torch.uint8)
        self.pin()
        return self._tensor

    def pin(self) -> None:
        """Register the data as pinned host memory (once): copies between it
        and a GPU are then DMA, whichever tensor views it."""
        if self._is_pinned:
            return
        code = torch.cuda.cudart().cudaHostRegister(self.address, self.capacity, 0)
        if int(code) != 0:
            raise RingError(f"cudaHostRegister of a {self.capacity}-byte ring failed "
                            f"(cudaError {int(code)}); is the memlock limit too low?")
        self._is_pinned = True

    def close(self) -> None:
        if self._is_pinned:
            torch.cuda.cudart().cudaHostUnregister(self.address)
            self._is_pinned = False
        self._tensor = None
        self.data.release()
        self._view.release()
        self._map.close()


def is_marked_closed(fd: int) -> bool:
    """Whether the segment file open as `fd` was closed in order by its producer."""
    flag = os.pread(fd, CLOSED_FLAG.size, CLOSED_FLAG_OFFSET)
    return len(flag) == CLOSED_FLAG.size and CLOSED_FLAG.unpack(flag)[0] == 1


def copy_bytes(dst: memoryview, src: memoryview) -> None:
    """`dst[:] = src` (byte views of one size); large copies without the GIL,
    by the C library's `memmove` (which streams a copy past the caches once
    it is over glibc's non-temporal threshold: copy_tunables.py)."""
    if dst.nbytes != src.nbytes:
        raise ValueError(f"copy of {src.nbytes} bytes into {dst.nbytes}")
    if dst.nbytes >= GIL_FREE_COPY_BYTES and not (dst.readonly or src.readonly):
        target = torch.frombuffer(dst, dtype=torch.uint8)
        source = torch.frombuffer(src, dtype=torch.uint8)
        try:
            _memmove(target.data_ptr(), source.data_ptr(), dst.nbytes)
        finally:
            # No export of a segment's map may outlive the copy (close() needs
            # none), not even in an exception's traceback.
            del target, source
    else:
        dst[:] = src


def device_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor's data as a flat uint8 tensor (a copy only if it is not
    contiguous)."""
    return tensor.detach().contiguous().view(-1).view(torch.uint8)


def host_bytes(tensor: torch.Tensor) -> memoryview:
    """A CPU tensor's data as a flat byte view (a copy only if it is not
    contiguous); the view keeps the memory alive."""
    flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
    return memoryview(flat.numpy())
