"""Messages filled in place (`Transport.send_filled`) on every transport a job
uses: gRPC, the tcp data plane, and shared memory (where `fill` writes into
the ring's own memory). They arrive byte for byte as the same tensors sent
by `send` would; a fill that fails sends nothing and leaves the transport
usable, however often it happens; a message that cannot lie in one piece in
the ring takes the copying path.

Every wait is bounded; no sleep synchronises anything; timings decide nothing.
"""

import os

import pytest
import torch
from transport_pairs import (
    INCARNATION,
    RECV_TIMEOUT_S,
    SETTINGS,
    TOKEN,
    W0,
    W1,
    close_all,
    connect,
    key,
)

from splitrun.runtime.transport import ChannelContract
from splitrun.runtime.transport.dtypes import TensorSpec
from splitrun.runtime.transport.filled import specs_of
from splitrun.runtime.transport.grpc import GrpcTransport
from splitrun.runtime.transport.router import RoutedTransport, TransportChoice, TransportKind
from splitrun.runtime.transport.shm.ring import (
    SHM_DIR,
    RingReader,
    RingSettings,
    RingWriter,
    new_job_prefix,
    remove_job_segments,
)
from splitrun.runtime.transport.shm.transport import ShmSettings

RING_BYTES = 256 << 10
RING = ShmSettings(ring_bytes=RING_BYTES, attach_timeout_s=10.0, send_timeout_s=30.0,
                   message_timeout_s=60.0, poll_s=0.2)
CHOICES = {"grpc": TransportChoice.GRPC, "tcp": TransportChoice.TCP,
           "shm": TransportChoice.SHM}
KINDS = {"grpc": TransportKind.GRPC, "tcp": TransportKind.TCP, "shm": TransportKind.SHM}
CHANNEL = "@emb:test"


class Boom(Exception):
    pass


@pytest.fixture
def prefix():
    prefix = new_job_prefix()
    yield prefix
    left = sorted(name for name in os.listdir(SHM_DIR) if name.startswith(prefix))
    remove_job_segments(prefix)
    assert left == [], f"files of the job left in {SHM_DIR}: {left}"


def make(kind: str, label, prefix: str):
    grpc = GrpcTransport(label, token=TOKEN, incarnation=INCARNATION, settings=SETTINGS)
    transport = RoutedTransport(grpc, prefix=prefix, choice=CHOICES[kind], settings=RING)
    transport.register({CHANNEL: ChannelContract(W0 if label == W1 else W1, None)})
    transport.expect({})
    return transport


@pytest.fixture(params=sorted(CHOICES))
def pair(request, prefix):
    a, b = make(request.param, W0, prefix), make(request.param, W1, prefix)
    connect(a, b)
    assert a.kind_of(W1) is KINDS[request.param]
    yield a, b
    close_all(a, b)


def message(seed: int, num_rows: int) -> list[torch.Tensor]:
    """A reply-like message: a header, ids, float rows with every bit pattern
    (NaNs, -0.0, subnormals), bfloat16 rows, bytes."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randint(-2**31, 2**31 - 1, (num_rows, 33), generator=generator,
                         dtype=torch.int32).view(torch.float32)
    if num_rows:
        rows[0, :3] = torch.tensor([float("nan"), -0.0, 1e-45])
    return [torch.tensor([2, seed, num_rows]),
            torch.randint(0, 1 << 40, (num_rows,), generator=generator),
            rows,
            torch.randint(-2**15, 2**15 - 1, (num_rows, 5), generator=generator,
                          dtype=torch.int16).view(torch.bfloat16),
            torch.randint(0, 255, (num_rows % 7,), generator=generator, dtype=torch.uint8)]


def copy_in(tensors):
    def fill(outs):
        assert len(outs) == len(tensors)
        for out, tensor in zip(outs, tensors):
            assert out.dtype == tensor.dtype and out.shape == tensor.shape
            out.copy_(tensor)
    return fill


def bytes_of(tensors):
    return [bytes(t.contiguous().view(-1).view(torch.uint8).numpy()) for t in tensors]


def test_a_filled_message_arrives_byte_for_byte(pair):
    a, b = pair
    # Small ones, one that fills the ring's end (a skip frame follows), and
    # one over half the ring (filled into new tensors, then streamed).
    sizes = [0, 1, 3, 100, 700, 40, 900, 5, 2000]
    sent = [message(seed, rows) for seed, rows in enumerate(sizes)]
    for seed, tensors in enumerate(sent):
        a.send_filled(W1, key(seed, CHANNEL), specs_of(tensors), copy_in(tensors))
    for seed, tensors in enumerate(sent):
        got = b.recv(W0, key(seed, CHANNEL), RECV_TIMEOUT_S)
        assert [(t.dtype, t.shape) for t in got] == [(t.dtype, t.shape) for t in tensors]
        assert bytes_of(got) == bytes_of(tensors), f"message {seed} changed on the way"
        del got  # lent tensors go back to the ring


def test_a_failing_fill_sends_nothing_and_the_transport_goes_on(pair):
    a, b = pair
    tensors = message(1, 300)  # ~50 KiB: abandoned ~40 times, ~8 rings' worth
    for step in range(40):
        def fill(outs, step=step):
            outs[2].fill_(1.0)  # half written, then it fails
            raise Boom(f"fill {step}")
        with pytest.raises(Boom, match=f"fill {step}"):
            a.send_filled(W1, key(step, CHANNEL), specs_of(tensors), fill)
        a.send_filled(W1, key(1000 + step, CHANNEL), specs_of(tensors), copy_in(tensors))
    a.flush(RECV_TIMEOUT_S)
    assert [k.step for k in b.pending() if k.channel == CHANNEL] == list(range(1000, 1040))
    for step in range(40):
        assert bytes_of(b.recv(W0, key(1000 + step, CHANNEL), RECV_TIMEOUT_S)) == \
            bytes_of(tensors)
    b.send(W0, key(0, CHANNEL), [torch.arange(3)])  # the other way is unharmed too
    assert torch.equal(a.recv(W1, key(0, CHANNEL), RECV_TIMEOUT_S)[0], torch.arange(3))


@pytest.fixture
def ring(prefix):
    writer = RingWriter(prefix, "w0-s0", owner="worker 0", peer="server 0",
                        settings=RingSettings(capacity_bytes=64 << 10, attach_timeout_s=10.0))
    reader = RingReader.attach(prefix, "w0-s0", owner="server 0", peer="worker 0",
                               timeout_s=10.0)
    writer.wait_attached(10.0)
    yield writer, reader
    writer.close()
    reader.close()


def test_the_ring_lends_its_own_memory_to_fill(ring):
    writer, reader = ring
    addresses = []

    def fill(payload):
        addresses.append(payload.data_ptr())
        payload.copy_(torch.arange(1000, dtype=torch.uint8))
    assert writer.send_filled(b"h", 1000, fill, RECV_TIMEOUT_S)
    ring_start = writer._segment.address  # noqa: SLF001 - where the ring's memory is
    assert ring_start <= addresses[0] < ring_start + writer.capacity
    assert addresses[0] % 64 == 0
    header, payload = reader.recv(RECV_TIMEOUT_S)
    assert header == b"h" and bytes(payload) == bytes(torch.arange(1000, dtype=torch.uint8))


def test_abandoned_reservations_neither_leak_nor_wedge_the_ring(ring):
    writer, reader = ring
    # Each reservation a third of the ring, abandoned 12 times in a row (four
    # rings' worth, nothing read meanwhile), wrapping past the ring's end.
    for attempt in range(12):
        with pytest.raises(Boom):
            writer.send_filled(b"x", 20000, lambda payload: (_ for _ in ()).throw(Boom()),
                               RECV_TIMEOUT_S)
        assert writer.send_filled(b"ok%d" % attempt, 20000,
                                  lambda payload, a=attempt: payload.fill_(a), RECV_TIMEOUT_S)
        header, payload = reader.recv(RECV_TIMEOUT_S)
        assert header == b"ok%d" % attempt and payload == bytes([attempt]) * 20000


def test_a_message_over_half_the_ring_is_left_to_send(ring):
    writer, reader = ring
    called = []
    assert not writer.send_filled(b"big", 40000, called.append, RECV_TIMEOUT_S)
    assert called == []
    writer.send(b"small", [memoryview(b"abc")], RECV_TIMEOUT_S)
    assert reader.recv(RECV_TIMEOUT_S) == (b"small", bytearray(b"abc"))


def test_specs_of_describes_the_tensors():
    tensors = message(3, 4)
    assert specs_of(tensors) == tuple(TensorSpec(t.dtype, tuple(t.shape)) for t in tensors)
