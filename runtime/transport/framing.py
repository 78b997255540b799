"""The `Chunk` framing on the wire, and envelopes.

Sending: `EnvelopeWriter` serializes a message's envelope (cached per channel:
only the step changes from step to step); `frame_message()` cuts envelope +
bytes into serialized `Chunk`s.

Receiving: `parse_chunk()` splits a request into envelope and data;
`split_step()` and `is_step_free()` recognise an envelope seen before by its
bytes; `specs_from_envelope()` checks an envelope from the network (known
dtype, sane shape, byte counts that add up, a size cap) before anything is
allocated. protobuf is the only deserializer used.

Speed matters on the small-message path (measured: every microsecond of
Python here is paid two to three times over on an idle 2-core machine), hence
the cache of serialized envelopes and the hand-written chunk parser.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence

from google.protobuf.message import DecodeError

from ..errors import MessageRejected
from ..rpc.wire import splitrun_pb2
from .buffers import EncodedTensors
from .dtypes import IS_LITTLE_ENDIAN, TensorSpec, dtype_from_name, dtype_name
from .keys import MessageKey

__all__ = [
    "CHUNK_OVERHEAD",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "EnvelopeWriter",
    "fill_envelope",
    "split_step",
    "is_step_free",
    "specs_from_envelope",
    "frame_message",
    "parse_chunk",
    "parse_envelope",
]

# Room for a Chunk's framing besides its data and envelope.
CHUNK_OVERHEAD = 64
# Default refusal threshold for one message's declared size. A hostile or
# corrupt envelope could otherwise make the receiver allocate anything.
DEFAULT_MAX_MESSAGE_BYTES = 8 << 30
# More dimensions than any real tensor has; bounds the work spent on a shape.
_MAX_DIMS = 64
# Bounds the serialized envelopes an EnvelopeWriter keeps (one per channel
# and tensor signature; a plan has a few hundred channels at most).
_MAX_CACHED_ENVELOPES = 4096

# Protobuf wire tags (field number << 3 | wire type). Chunk: 1 envelope and
# 2 data, length-delimited. Envelope: 2 step, varint. See proto/splitrun.proto.
_TAG_ENVELOPE = 0x0A
_TAG_DATA = 0x12
_TAG_STEP = 0x10
_EMPTY_VIEW = memoryview(b"")


def fill_envelope(envelope: splitrun_pb2.Envelope, specs: Sequence[TensorSpec]) -> None:
    """Write the tensors' metadata, total size and byte order into `envelope`."""
    del envelope.tensors[:]
    for spec in specs:
        envelope.tensors.add(dtype=dtype_name(spec.dtype), shape=spec.shape)
    envelope.total_bytes = sum(spec.nbytes for spec in specs)
    envelope.little_endian = IS_LITTLE_ENDIAN


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
        return self._serialize(key, tuple([(t.dtype, t.shape) for t in encoded.tensors]),
                               lambda: encoded.specs)

    def serialize_specs(self, key: MessageKey, specs: Sequence[TensorSpec]) -> bytes:
        """The envelope of a message of tensors `specs` (one filled in place)."""
        return self._serialize(key, tuple([(s.dtype, s.shape) for s in specs]), lambda: specs)

    def _serialize(self, key: MessageKey, tensors: tuple, specs) -> bytes:
        signature = (key.channel, key.incarnation, tensors)
        prefix = self._cache.get(signature)
        if prefix is None:
            envelope = splitrun_pb2.Envelope(incarnation=key.incarnation, channel=key.channel,
                                             src=self.src)
            fill_envelope(envelope, specs())
            prefix = envelope.SerializeToString()
            if len(self._cache) >= _MAX_CACHED_ENVELOPES:
                self._cache.clear()
            self._cache[signature] = prefix
        return _step_field(key.step) + prefix


def _step_field(step: int) -> bytes:
    """The envelope's step field alone (int64: a negative step takes 10 bytes)."""
    if 0 <= step < 0x80:  # the usual steps without the loop (every message pays it)
        return bytes((_TAG_STEP, step))
    if 0 <= step < 0x4000:
        return bytes((_TAG_STEP, (step & 0x7F) | 0x80, step >> 7))
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
    first = envelope[1]
    if first < 0x80:  # steps below 128 and 16384 without the loop (every message pays it)
        return first, envelope[2:]
    if len(envelope) > 2 and envelope[2] < 0x80:
        return (first & 0x7F) | (envelope[2] << 7), envelope[3:]
    try:
        value, pos = _read_varint(envelope, 1)
    except ValueError:
        return None
    return _signed64(value), envelope[pos:]



def specs_from_envelope(envelope: splitrun_pb2.Envelope, *,
                        max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> tuple[TensorSpec, ...]:
    """Check an envelope from the network and return its tensors' specs.

    Refuses (`MessageRejected`) an unknown dtype, a negative or absurd shape,
    sizes that do not add up to `total_bytes`, a message above `max_bytes`, and
    a byte order other than this machine's (nothing is byte-swapped).
    """
    if envelope.little_endian != IS_LITTLE_ENDIAN:
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
