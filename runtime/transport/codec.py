"""Tensors <-> envelope metadata and raw bytes, and the `Chunk` framing on the wire.

Sending: `encode()` gives flat byte views of the tensors' own memory (a copy
only for non-contiguous tensors); `EnvelopeWriter` serializes the envelope;
`frame_message()` cuts envelope + bytes into serialized `Chunk`s.

Receiving: `parse_chunk()` splits a request into envelope and data;
`specs_from_envelope()` checks an envelope from the network (known dtype,
sane shape, byte counts that add up, a size cap) before anything is allocated;
`MessageBuffer` fills one preallocated buffer chunk by chunk and hands out
tensors that view it. `BufferPool` recycles those buffers once nobody holds a
tensor of them: a fresh multi-MiB allocation per message (page faults on first
touch) measured 4x slower than writing into a reused one.

Dtypes travel by name through a fixed table: a name from the network is
looked up, never evaluated; protobuf is the only deserializer used.

Speed matters on the small-message path (measured: every microsecond of
Python here is paid two to three times over on an idle 2-core machine), hence
the caches of serialized envelopes and message layouts.
"""

from __future__ import annotations

import ctypes
import math
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import torch
from google.protobuf.message import DecodeError

from ..errors import MessageRejected, TransportError
from .protocol import MessageKey
from .wire import splitrun_pb2

__all__ = [
    "DTYPES",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "TensorSpec",
    "EncodedTensors",
    "dtype_name",
    "dtype_from_name",
    "byte_view",
    "encode",
    "decode",
    "fill_envelope",
    "EnvelopeWriter",
    "split_step",
    "is_step_free",
    "specs_from_envelope",
    "MessageLayout",
    "MessageBuffer",
    "BufferPool",
    "frame_message",
    "parse_chunk",
    "parse_envelope",
]

# The wire's dtype table. Adding a dtype here is a protocol change: every
# process of a job must run the same table.
DTYPES: MappingProxyType[str, torch.dtype] = MappingProxyType({
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
})
_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}

# Default refusal threshold for one message's declared size. A hostile or
# corrupt envelope could otherwise make the receiver allocate anything.
DEFAULT_MAX_MESSAGE_BYTES = 8 << 30
# More dimensions than any real tensor has; bounds the work spent on a shape.
_MAX_DIMS = 64
# Tensors inside a receive buffer start at multiples of this, so every dtype
# view is aligned (and vector loads start on a cache line).
_ALIGN = 64
_IS_LITTLE_ENDIAN = sys.byteorder == "little"
# Bounds the serialized envelopes an EnvelopeWriter keeps (one per channel
# and tensor signature; a plan has a few hundred channels at most).
_MAX_CACHED_ENVELOPES = 4096

# Protobuf wire tags (field number << 3 | wire type). Chunk: 1 envelope and
# 2 data, length-delimited. Envelope: 2 step, varint. See proto/splitrun.proto.
_TAG_ENVELOPE = 0x0A
_TAG_DATA = 0x12
_TAG_STEP = 0x10


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of `dtype`; `TransportError` for one the wire cannot carry."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise TransportError(
            f"dtype {dtype} cannot be sent; the wire carries "
            f"{', '.join(DTYPES)}. Cast the tensor before it crosses processes") from None


def dtype_from_name(name: str) -> torch.dtype:
    """The dtype a wire name stands for; `MessageRejected` for an unknown name."""
    dtype = DTYPES.get(name)
    if dtype is None:
        raise MessageRejected(
            f"unknown dtype {name[:40]!r}; the wire carries {', '.join(DTYPES)} "
            f"(is the sender running another splitrun version?)")
    return dtype


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A tensor's dtype and shape: what an envelope says about it."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def __str__(self) -> str:
        return f"{_NAMES.get(self.dtype, str(self.dtype))}{list(self.shape)}"

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorSpec:
        return cls(tensor.dtype, tuple(tensor.shape))


# -- sending ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EncodedTensors:
    """Tensors ready for the wire: contiguous CPU tensors and flat byte views of
    their memory. The views do not own that memory: keep this object alive
    while they are read, and do not modify the tensors meanwhile."""

    tensors: tuple[torch.Tensor, ...]
    views: tuple[memoryview, ...]
    total_bytes: int

    @property
    def specs(self) -> tuple[TensorSpec, ...]:
        return tuple(TensorSpec.of(tensor) for tensor in self.tensors)


def _check_sendable(tensor: torch.Tensor) -> None:
    dtype_name(tensor.dtype)
    if tensor.layout is not torch.strided:
        raise TransportError(
            f"{tensor.layout} tensors cannot be sent; send their indices and values "
            f"as dense tensors")
    if tensor.device.type != "cpu":
        raise TransportError(
            f"encoding needs CPU tensors, got one on {tensor.device}; stage it to "
            f"host memory first")


def _wire_ready(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` if its memory can go to the wire as it is, else a copy that can."""
    if (tensor.is_cpu and tensor.dtype in _NAMES and tensor.layout is torch.strided
            and tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg()):
        return tensor
    _check_sendable(tensor)
    return tensor.detach().resolve_conj().resolve_neg().contiguous()


_EMPTY_VIEW = memoryview(b"")


def _raw_view(tensor: torch.Tensor) -> memoryview:
    """A byte view of a contiguous CPU tensor's memory, from its data pointer
    (a third of the cost of going through numpy). It does not keep the tensor
    alive: the caller must."""
    nbytes = tensor.nbytes
    if nbytes == 0:
        return _EMPTY_VIEW
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A flat byte view of a CPU tensor's data, zero-copy when it is contiguous;
    the view keeps the tensor alive. Works for every wire dtype, 0-dim and
    empty tensors."""
    _check_sendable(tensor)
    flat = tensor.detach().resolve_conj().resolve_neg().contiguous().view(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def encode(tensors: Sequence[torch.Tensor]) -> EncodedTensors:
    """Byte views of CPU `tensors`, in order; copies only non-contiguous ones."""
    ready = tuple(_wire_ready(tensor) for tensor in tensors)
    views = tuple(_raw_view(tensor) for tensor in ready)
    return EncodedTensors(ready, views, sum(view.nbytes for view in views))


def fill_envelope(envelope: splitrun_pb2.Envelope, specs: Sequence[TensorSpec]) -> None:
    """Write the tensors' metadata, total size and byte order into `envelope`."""
    del envelope.tensors[:]
    for spec in specs:
        envelope.tensors.add(dtype=dtype_name(spec.dtype), shape=spec.shape)
    envelope.total_bytes = sum(spec.nbytes for spec in specs)
    envelope.little_endian = _IS_LITTLE_ENDIAN


class EnvelopeWriter:
    """Serialized envelopes of one sender's messages.

    From step to step a channel's envelope changes only in its step, so the
    rest is serialized once per (channel, incarnation, dtypes and shapes) and
    the step written in front as its own field: protobuf parses concatenated
    encodings as one merged message. The receiver uses the same split
    (`split_step`) to recognise an envelope it has checked before.
    """

    def __init__(self, src: str) -> None:
        self.src = src
        self._cache: dict[tuple, bytes] = {}

    def serialize(self, key: MessageKey, encoded: EncodedTensors) -> bytes:
        signature = (key.channel, key.incarnation,
                     tuple([(t.dtype, t.shape) for t in encoded.tensors]))
        prefix = self._cache.get(signature)
        if prefix is None:
            envelope = splitrun_pb2.Envelope(incarnation=key.incarnation, channel=key.channel,
                                             src=self.src)
            fill_envelope(envelope, encoded.specs)
            prefix = envelope.SerializeToString()
            if len(self._cache) >= _MAX_CACHED_ENVELOPES:
                self._cache.clear()
            self._cache[signature] = prefix
        return _step_field(key.step) + prefix


def _step_field(step: int) -> bytes:
    """The envelope's step field alone (int64: a negative step takes 10 bytes)."""
    return bytes((_TAG_STEP,)) + _varint(step & 0xFFFF_FFFF_FFFF_FFFF)


def is_step_free(rest: memoryview) -> bool:
    """True if the serialized envelope fields `rest` hold no step field (then
    the step in front of them is the envelope's step), False if they do or do
    not parse as protobuf fields."""
    pos, end = 0, len(rest)
    try:
        while pos < end:
            tag, pos = _read_varint(rest, pos)
            if tag >> 3 == 2:
                return False
            wire_type = tag & 7
            if wire_type == 0:
                _, pos = _read_varint(rest, pos)
            elif wire_type == 2:
                length, pos = _read_varint(rest, pos)
                pos += length
            elif wire_type in (1, 5):
                pos += 8 if wire_type == 1 else 4
            else:
                return False
    except ValueError:
        return False
    return pos == end


def _signed64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def split_step(envelope: memoryview) -> tuple[int, memoryview] | None:
    """`(step, rest)` of a serialized envelope that starts with its step field
    (as `EnvelopeWriter` writes them), else None. Two envelopes with equal
    `rest` differ in their step only, if `rest` itself holds no step."""
    if len(envelope) < 2 or envelope[0] != _TAG_STEP:
        return None
    try:
        value, pos = _read_varint(envelope, 1)
    except ValueError:
        return None
    return _signed64(value), envelope[pos:]


# -- receiving ----------------------------------------------------------------------


def specs_from_envelope(envelope: splitrun_pb2.Envelope, *,
                        max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> tuple[TensorSpec, ...]:
    """Check an envelope from the network and return its tensors' specs.

    Refuses (`MessageRejected`) an unknown dtype, a negative or absurd shape,
    sizes that do not add up to `total_bytes`, a message above `max_bytes`, and
    a byte order other than this machine's (nothing is byte-swapped).
    """
    if envelope.little_endian != _IS_LITTLE_ENDIAN:
        raise MessageRejected(
            f"data is {'little' if envelope.little_endian else 'big'}-endian, this "
            f"machine is {sys.byteorder}-endian; mixed byte orders are not supported")
    specs = []
    for index, meta in enumerate(envelope.tensors):
        dtype = dtype_from_name(meta.dtype)
        shape = tuple(meta.shape)
        if len(shape) > _MAX_DIMS or any(dim < 0 for dim in shape):
            shown = list(shape[:8]) + (["..."] if len(shape) > 8 else [])
            raise MessageRejected(
                f"tensor {index} has shape {shown}: dimensions must be >= 0 and at "
                f"most {_MAX_DIMS} of them")
        specs.append(TensorSpec(dtype, shape))
    declared = sum(spec.nbytes for spec in specs)
    if declared != envelope.total_bytes:
        raise MessageRejected(
            f"the envelope's tensors ({', '.join(map(str, specs)) or 'none'}) take "
            f"{declared} bytes but total_bytes says {envelope.total_bytes}")
    if declared > max_bytes:
        raise MessageRejected(
            f"the message declares {declared} bytes, above the limit of {max_bytes} "
            f"(max_message_bytes); raise the limit if the plan really sends that much")
    return tuple(specs)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    step = 1
    for dim in reversed(shape):
        strides.append(step)
        step *= max(dim, 1)
    return tuple(reversed(strides))


class MessageLayout:
    """Where a message's tensors lie: on the wire back to back, in the receive
    buffer each at an aligned offset. Computed once per channel and reused."""

    __slots__ = ("specs", "total_bytes", "buffer_bytes", "offsets", "wire_ends", "strides",
                 "single")

    def __init__(self, specs: Sequence[TensorSpec]) -> None:
        self.specs = tuple(specs)
        self.offsets: list[int] = []
        self.wire_ends: list[int] = []
        self.strides = [_contiguous_strides(spec.shape) for spec in self.specs]
        end = wire = 0
        for spec in self.specs:
            start = -(-end // _ALIGN) * _ALIGN
            self.offsets.append(start)
            end = start + spec.nbytes
            wire += spec.nbytes
            self.wire_ends.append(wire)
        self.total_bytes = wire
        # A multiple of every itemsize, so the buffer views as any dtype.
        self.buffer_bytes = -(-end // _ALIGN) * _ALIGN
        # One small tensor: the buffer is allocated as that tensor itself.
        self.single = self.specs[0] if len(self.specs) == 1 else None


class BufferPool:
    """Receive buffers reused once no tensor views them any more.

    A buffer is free when its storage has no owner but the pool (the storage's
    use count, which every tensor, view and numpy array of it raises). Buffers
    under `min_bytes` are not pooled (malloc serves them well); the pool holds at
    most `max_bytes`, and a request is served by a free buffer at most twice its
    size.
    """

    def __init__(self, max_bytes: int = 1 << 30, min_bytes: int = 1 << 20) -> None:
        self.max_bytes = max_bytes
        self.min_bytes = min_bytes
        self._buffers: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self.num_reused = 0
        self.num_allocated = 0

    @staticmethod
    def _is_free(buffer: torch.Tensor) -> bool:
        use_count = getattr(torch._C, "_storage_Use_Count", None)
        if use_count is None:  # private API gone: never reuse, stay safe
            return False
        # One reference from `buffer`, one from the temporary storage object.
        return use_count(buffer.untyped_storage()._cdata) <= 2

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of exactly `nbytes`, recycled when a free buffer fits."""
        if nbytes < self.min_bytes:
            return torch.empty(nbytes, dtype=torch.uint8)
        with self._lock:
            best = None
            for buffer in self._buffers:
                size = buffer.numel()
                if nbytes <= size <= 2 * nbytes and (best is None or size < best.numel()) \
                        and self._is_free(buffer):
                    best = buffer
            if best is not None:
                self.num_reused += 1
                return best[:nbytes]
            buffer = torch.empty(nbytes, dtype=torch.uint8)
            self.num_allocated += 1
            self._make_room(nbytes)
            if self._pooled_bytes() + nbytes <= self.max_bytes:
                self._buffers.append(buffer)
            return buffer[:nbytes]

    def _pooled_bytes(self) -> int:
        return sum(buffer.numel() for buffer in self._buffers)

    def _make_room(self, nbytes: int) -> None:
        """Drop free buffers, largest first, until `nbytes` more fits."""
        for buffer in sorted(self._buffers, key=lambda b: -b.numel()):
            if self._pooled_bytes() + nbytes <= self.max_bytes:
                return
            if self._is_free(buffer):
                self._buffers = [b for b in self._buffers if b is not buffer]

    def clear(self) -> None:
        with self._lock:
            self._buffers.clear()


class MessageBuffer:
    """One message's data, filled from the wire into one preallocated buffer;
    `tensors()` returns views of that buffer (no more copies)."""

    __slots__ = ("layout", "received", "_buffer", "_dest", "_index", "_single")

    def __init__(self, layout: MessageLayout | Sequence[TensorSpec],
                 pool: BufferPool | None = None) -> None:
        if not isinstance(layout, MessageLayout):
            layout = MessageLayout(layout)
        self.layout = layout
        self.received = 0
        self._index = 0  # the tensor the next wire byte belongs to
        size = layout.buffer_bytes
        single = layout.single
        if single is not None and (pool is None or size < pool.min_bytes):
            self._single = torch.empty(single.shape, dtype=single.dtype)
            self._buffer = None
            self._dest = _raw_view(self._single)
            return
        self._single = None
        self._buffer = (pool.take(size) if pool is not None
                        else torch.empty(size, dtype=torch.uint8))
        self._dest: memoryview | None = _raw_view(self._buffer) if size else None

    @property
    def total_bytes(self) -> int:
        return self.layout.total_bytes

    @property
    def is_complete(self) -> bool:
        return self.received == self.layout.total_bytes

    def write(self, data: memoryview | bytes) -> None:
        """Append the next bytes of the message; refuses more than it declared."""
        count = len(data) if isinstance(data, bytes) else data.nbytes
        layout = self.layout
        if count > layout.total_bytes - self.received:
            raise MessageRejected(
                f"the data runs past the envelope's total_bytes {layout.total_bytes}: "
                f"{self.received} received, then {count} more")
        if count == 0:
            return
        if not isinstance(data, memoryview) or data.format != "B":
            data = memoryview(data).cast("B")
        if self._single is not None:
            self._dest[self.received:self.received + count] = data
            self.received += count
            return
        wire_ends, offsets, specs = layout.wire_ends, layout.offsets, layout.specs
        taken = 0
        while taken < count:
            while wire_ends[self._index] <= self.received:
                self._index += 1
            index = self._index
            wire_start = wire_ends[index] - specs[index].nbytes
            piece = min(count - taken, wire_ends[index] - self.received)
            start = offsets[index] + (self.received - wire_start)
            self._dest[start:start + piece] = data[taken:taken + piece]
            taken += piece
            self.received += piece

    def tensors(self) -> list[torch.Tensor]:
        """The message's tensors, viewing the buffer; refuses a short message."""
        layout = self.layout
        if self.received != layout.total_bytes:
            raise MessageRejected(
                f"the message ended after {self.received} of its {layout.total_bytes} bytes")
        self._dest = None
        if self._single is not None:
            return [self._single]
        typed: dict[torch.dtype, torch.Tensor] = {}
        out = []
        for spec, offset, strides in zip(layout.specs, layout.offsets, layout.strides):
            base = typed.get(spec.dtype)
            if base is None:
                base = typed[spec.dtype] = self._buffer.view(spec.dtype)
            out.append(base.as_strided(spec.shape, strides, offset // spec.dtype.itemsize))
        return out


def decode(specs: Sequence[TensorSpec], data: memoryview | bytes, *,
           pool: BufferPool | None = None) -> list[torch.Tensor]:
    """Tensors from a whole message's bytes, in one buffer."""
    buffer = MessageBuffer(specs, pool)
    buffer.write(data)
    return buffer.tensors()


# -- Chunk framing --------------------------------------------------------------------


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(data: memoryview, pos: int) -> tuple[int, int]:
    """Decode a varint at `pos`; `(value, next position)`, or ValueError."""
    value = 0
    for shift in range(0, 70, 7):
        if pos >= len(data):
            raise ValueError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
    raise ValueError("varint longer than 10 bytes")


def _slices(views: Sequence[memoryview], start: int, count: int) -> list[memoryview]:
    """The bytes [start, start + count) of the views laid end to end."""
    out = []
    for view in views:
        size = view.nbytes
        if start >= size:
            start -= size
            continue
        piece = min(size - start, count)
        out.append(view[start:start + piece])
        count -= piece
        start = 0
        if count == 0:
            break
    return out


_ENVELOPE_TAG = bytes((_TAG_ENVELOPE,))
_DATA_TAG = bytes((_TAG_DATA,))


def frame_message(envelope: bytes, views: Sequence[memoryview], total_bytes: int,
                  chunk_bytes: int) -> Iterator[bytes]:
    """Serialized `Chunk`s of one message: the first carries the envelope and the
    first `chunk_bytes` of data, the rest carry data only.

    Equal, byte for byte, to `Chunk(...).SerializeToString()`, but each chunk
    costs one copy of its data (protobuf would take two).
    """
    first = min(total_bytes, chunk_bytes)
    parts: list[bytes | memoryview] = [_ENVELOPE_TAG, _varint(len(envelope)), envelope]
    if first:
        parts += [_DATA_TAG, _varint(first)]
        parts += _slices(views, 0, first)
    yield b"".join(parts)
    sent = first
    while sent < total_bytes:
        count = min(total_bytes - sent, chunk_bytes)
        yield b"".join([_DATA_TAG, _varint(count), *_slices(views, sent, count)])
        sent += count


def parse_chunk(raw: bytes) -> tuple[memoryview | None, memoryview]:
    """Split a serialized `Chunk` into its serialized envelope (None if absent)
    and its data, both zero-copy views of `raw`; `MessageRejected` for bytes
    that are no Chunk.

    Reads the two fields directly when the chunk is laid out the usual way, and
    falls back to protobuf for anything else. The envelope is not parsed here
    (see `parse_envelope`): a receiver may recognise it without parsing.
    """
    view = memoryview(raw)
    envelope: memoryview | None = None
    data: memoryview | None = None
    pos = 0
    end = len(view)
    try:
        while pos < end:
            tag = view[pos]
            if tag != _TAG_ENVELOPE and tag != _TAG_DATA:
                return _parse_chunk_slow(raw)
            length, pos = _read_varint(view, pos + 1)
            if pos + length > end:
                raise ValueError("a field runs past the end")
            field = view[pos:pos + length]
            pos += length
            if tag == _TAG_ENVELOPE:
                if envelope is not None:
                    return _parse_chunk_slow(raw)
                envelope = field
            else:
                if data is not None:
                    return _parse_chunk_slow(raw)
                data = field
    except ValueError as exc:
        raise MessageRejected(
            f"the request is not a splitrun Chunk ({len(raw)} bytes): {exc}") from None
    return envelope, data if data is not None else _EMPTY_VIEW


def _parse_chunk_slow(raw: bytes) -> tuple[memoryview | None, memoryview]:
    try:
        chunk = splitrun_pb2.Chunk.FromString(raw)
    except DecodeError as exc:
        raise MessageRejected(
            f"the request is not a splitrun Chunk ({len(raw)} bytes): {exc}") from None
    envelope = None
    if chunk.HasField("envelope"):
        envelope = memoryview(chunk.envelope.SerializeToString())
    return envelope, memoryview(chunk.data)


def parse_envelope(raw: memoryview | bytes) -> splitrun_pb2.Envelope:
    """A serialized envelope, parsed; `MessageRejected` for bytes that are none."""
    try:
        return splitrun_pb2.Envelope.FromString(raw)
    except DecodeError as exc:
        raise MessageRejected(f"the envelope ({len(raw)} bytes) does not parse: {exc}") from None
