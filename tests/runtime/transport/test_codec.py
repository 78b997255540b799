"""The codec (dtypes, buffers, framing): tensors to envelope + bytes and back, bit for bit; hostile
envelopes refused before anything is allocated; Chunk framing equal to
protobuf's own; receive buffers recycled only when nobody holds them."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from splitrun.runtime.errors import MessageRejected, TransportError
from splitrun.runtime.rpc.wire import splitrun_pb2
from splitrun.runtime.transport.buffers import (
    BufferPool,
    MessageBuffer,
    decode,
    encode,
)
from splitrun.runtime.transport.dtypes import DTYPES, TensorSpec
from splitrun.runtime.transport.framing import (
    EnvelopeWriter,
    frame_message,
    is_step_free,
    parse_chunk,
    parse_envelope,
    specs_from_envelope,
    split_step,
)
from splitrun.runtime.transport.protocol import MessageKey

SHAPES = [(), (0,), (7,), (3, 5), (2, 0, 3)]


def sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Values that use the dtype's whole bit pattern where it matters."""
    generator = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        return torch.rand(shape, generator=generator) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=generator)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=generator) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, dtype=dtype, generator=generator)


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bits of a CPU tensor's data, flat (every wire dtype, 0-dim, empty)."""
    flat = tensor.detach().resolve_conj().resolve_neg().contiguous().view(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and byte_view(a).tobytes() == byte_view(b).tobytes())


def wire_round_trip(tensors, chunk_bytes=1 << 20, pool=None):
    """Encode, frame, parse and decode as the transport does, without sockets."""
    encoded = encode(tensors)
    header = EnvelopeWriter("w0").serialize(MessageKey(3, 11, "w0->w1#0"), encoded)
    chunks = list(frame_message(header, encoded.views, encoded.total_bytes, chunk_bytes))
    raw_envelope, data = parse_chunk(chunks[0])
    envelope = parse_envelope(raw_envelope)
    assert (envelope.step, envelope.channel, envelope.src, envelope.incarnation) == \
        (11, "w0->w1#0", "w0", 3)
    buffer = MessageBuffer(specs_from_envelope(envelope), pool)
    buffer.write(data)
    for chunk in chunks[1:]:
        raw_envelope, data = parse_chunk(chunk)
        assert raw_envelope is None
        buffer.write(data)
    return buffer.tensors(), len(chunks)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", sorted(DTYPES))
def test_every_wire_dtype_round_trips_bit_for_bit(name, shape):
    tensor = sample(DTYPES[name], shape)
    (out,), _ = wire_round_trip([tensor])
    assert same_bits(out, tensor)


@pytest.mark.parametrize("name", ["float32", "bfloat16", "complex64", "bool", "int64"])
def test_non_contiguous_and_offset_tensors_round_trip(name):
    base = sample(DTYPES[name], (6, 8), seed=1)
    cases = {"transposed": base.t(), "strided": base[::2, 1::3], "offset": base[3:, 2:]}
    for what, tensor in cases.items():
        assert not tensor.is_contiguous() or tensor.storage_offset(), what
        (out,), _ = wire_round_trip([tensor])
        assert same_bits(out, tensor.contiguous()), what


def test_conjugate_and_negative_views_are_resolved_before_sending():
    z = torch.randn(4, dtype=torch.complex64)
    (conj,), _ = wire_round_trip([z.conj()])
    assert torch.equal(conj, z.conj().resolve_conj())
    (neg,), _ = wire_round_trip([torch._neg_view(z)])
    assert torch.equal(neg, -z)


def test_a_tensor_that_requires_grad_is_sent_by_value():
    weight = torch.randn(3, 3, requires_grad=True)
    (out,), _ = wire_round_trip([weight])
    assert not out.requires_grad and torch.equal(out, weight.detach())


def test_mixed_tensors_split_across_chunks_land_aligned():
    tensors = [sample(torch.bool, (5,)), sample(torch.float64, (3, 4), 2),
               sample(torch.int16, (7,), 3), sample(torch.bfloat16, ()),
               sample(torch.float32, (0,))]
    out, num_chunks = wire_round_trip(tensors, chunk_bytes=7)
    assert num_chunks > 10, "chunk boundaries must fall inside tensors"
    for got, want in zip(out, tensors):
        assert same_bits(got, want)
        assert got.data_ptr() % got.element_size() == 0
    storages = {t.untyped_storage().data_ptr() for t in out if t.numel()}
    assert len(storages) == 1, "a message decodes into one buffer"


def test_the_decoded_tensors_can_be_written():
    (out,), _ = wire_round_trip([torch.arange(6.0)])
    out.add_(1)  # the receiver owns its buffer
    assert torch.equal(out, torch.arange(6.0) + 1)


@settings(max_examples=60, deadline=None)
@given(total=st.integers(0, 300), chunk_bytes=st.integers(1, 64),
       step=st.integers(-(2 ** 63), 2 ** 63 - 1))
def test_framing_equals_protobuf_serialization(total, chunk_bytes, step):
    tensor = torch.arange(total, dtype=torch.uint8)
    encoded = encode([tensor])
    header = EnvelopeWriter("s1").serialize(MessageKey(2, step, "s1->w0#4"), encoded)
    envelope = splitrun_pb2.Envelope(incarnation=2, step=step, channel="s1->w0#4", src="s1",
                                     total_bytes=total, little_endian=True)
    envelope.tensors.add(dtype="uint8", shape=[total])
    assert parse_envelope(header) == envelope
    data = byte_view(tensor).tobytes()
    chunks = list(frame_message(header, encoded.views, total, chunk_bytes))
    expected = [splitrun_pb2.Chunk(envelope=envelope, data=data[:chunk_bytes])]
    expected += [splitrun_pb2.Chunk(data=data[i:i + chunk_bytes])
                 for i in range(chunk_bytes, total, chunk_bytes)]
    assert [splitrun_pb2.Chunk.FromString(c) for c in chunks] == expected
    assert chunks[1:] == [c.SerializeToString() for c in expected[1:]]


@pytest.mark.parametrize("step", [0, 1, 127, 128, 2 ** 40, -1, -(2 ** 63)])
def test_the_step_is_split_off_a_known_envelope(step):
    encoded = encode([torch.zeros(2)])
    writer = EnvelopeWriter("w1")
    header = writer.serialize(MessageKey(1, step, "c"), encoded)
    other = writer.serialize(MessageKey(1, step + 1 if step < 2 ** 40 else 5, "c"), encoded)
    found, rest = split_step(memoryview(header))
    assert found == step == parse_envelope(header).step
    assert is_step_free(rest)
    assert split_step(memoryview(other))[1] == rest, "only the step differs"
    # An envelope whose other fields carry a step too is not "step free".
    with_step = splitrun_pb2.Envelope(step=3, channel="c").SerializeToString()
    assert not is_step_free(memoryview(with_step))


def test_parse_chunk_reads_unusual_layouts_through_protobuf():
    envelope = splitrun_pb2.Envelope(channel="c", total_bytes=3, little_endian=True)
    envelope.tensors.add(dtype="uint8", shape=[3])
    body = envelope.SerializeToString()
    # Data before the envelope, then an unknown field: still one valid Chunk.
    raw = (b"\x12\x03abc" + b"\x0a" + bytes([len(body)]) + body + b"\x48\x01")
    parsed, data = parse_chunk(raw)
    assert parse_envelope(parsed) == envelope and bytes(data) == b"abc"


@pytest.mark.parametrize("raw", [b"\xff\xff\xff", b"\x0a\x50abc", b"\x12", b"\x0a\x02\xff\xff"],
                         ids=["bad-tag", "runs-past-end", "truncated-varint", "bad-envelope"])
def test_garbage_is_not_a_chunk(raw):
    with pytest.raises(MessageRejected, match="not a splitrun Chunk|does not parse"):
        envelope, _ = parse_chunk(raw)
        if envelope is not None:
            parse_envelope(envelope)


def envelope_with(*metas, total_bytes=None, little_endian=True):
    envelope = splitrun_pb2.Envelope(little_endian=little_endian)
    declared = 0
    for dtype, shape in metas:
        envelope.tensors.add(dtype=dtype, shape=shape)
        if dtype in DTYPES and all(d >= 0 for d in shape):
            declared += TensorSpec(DTYPES[dtype], tuple(shape)).nbytes
    envelope.total_bytes = declared if total_bytes is None else total_bytes
    return envelope


@pytest.mark.parametrize("envelope, match", [
    (envelope_with(("float128", [2])), r"unknown dtype 'float128'; the wire carries float32"),
    (envelope_with(("__import__('os')", [2])), r"unknown dtype"),
    (envelope_with(("float32", [2, -3]), total_bytes=0),
     r"shape \[2, -3\]: dimensions must be >= 0"),
    (envelope_with(("int8", [1] * 65)), r"at most 64 of them"),
    (envelope_with(("float32", [2, 3]), total_bytes=20),
     r"float32\[2, 3\]\) take 24 bytes but total_bytes says 20"),
    (envelope_with(("float32", [4]), little_endian=False), r"data is big-endian"),
    (envelope_with(("uint8", [1 << 40])), r"declares 1099511627776 bytes, above the limit"),
], ids=["unknown-dtype", "code-as-dtype", "negative-dim", "too-many-dims", "total-mismatch",
        "byte-order", "over-the-cap"])
def test_hostile_envelopes_are_refused_before_allocation(envelope, match):
    with pytest.raises(MessageRejected, match=match):
        specs_from_envelope(envelope, max_bytes=1 << 30)


def test_data_must_match_the_declared_size():
    specs = [TensorSpec(torch.float32, (2, 3))]
    with pytest.raises(MessageRejected, match="runs past the envelope's total_bytes 24"):
        decode(specs, bytes(28))
    buffer = MessageBuffer(specs)
    buffer.write(bytes(20))
    with pytest.raises(MessageRejected, match="ended after 20 of its 24 bytes"):
        buffer.tensors()


@pytest.mark.parametrize("tensor, match", [
    (torch.zeros(2, dtype=torch.uint16), r"dtype torch.uint16 cannot be sent"),
    (torch.zeros(2, device="meta"), r"needs CPU tensors, got one on meta"),
    (torch.zeros(3, 3).to_sparse(), r"torch.sparse_coo tensors cannot be sent"),
])
def test_what_the_wire_cannot_carry_is_refused_at_the_sender(tensor, match):
    with pytest.raises(TransportError, match=match):
        encode([tensor])


def test_the_pool_reuses_a_buffer_only_once_it_is_free():
    pool = BufferPool(max_bytes=64 << 20, min_bytes=1 << 20)
    specs = [TensorSpec(torch.float32, (1 << 19,))]  # 2 MiB
    (first,) = decode(specs, bytes(2 << 20), pool=pool)
    address = first.data_ptr()
    (second,) = decode(specs, bytes(2 << 20), pool=pool)
    assert second.data_ptr() != address, "a buffer still viewed must not be reused"
    del first
    (third,) = decode(specs, bytes(2 << 20), pool=pool)
    assert third.data_ptr() == address
    assert (pool.num_allocated, pool.num_reused) == (2, 1)


def test_the_pool_stays_within_its_bound():
    pool = BufferPool(max_bytes=4 << 20, min_bytes=1 << 20)
    held = [pool.take(3 << 20), pool.take(3 << 20)]  # the second does not fit: not pooled
    assert pool.pooled_bytes <= 4 << 20
    del held
    pool.take(3 << 20)
    assert pool.num_reused == 1


def test_encode_is_zero_copy_for_contiguous_tensors():
    tensor = torch.arange(10, dtype=torch.int32)
    view = encode([tensor]).views[0]
    tensor[0] = 7
    assert view.nbytes == 40
    assert view.tobytes() == byte_view(tensor).tobytes()  # the write shows through
