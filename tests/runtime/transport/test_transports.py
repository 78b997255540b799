"""The transport contract, run against both transports: gRPC, and shared memory
between peers on one host (a `RoutedTransport`, which must choose shared
memory here). Messages arrive intact and in order, larger than the ring too (a
1 GiB one from another process: tests/e2e/test_transports_e2e.py), bad messages
are refused with the receiver's reason and never reach the mailbox, and a peer
that dies is named in the error. Nothing of a job is left under /dev/shm
afterwards.

Every wait is bounded; no sleep synchronises anything; timings decide nothing.
"""

import dataclasses
import logging
import os
import signal
import time

import pytest
import torch
from cluster import pid_alive
from transport_pairs import (
    INCARNATION,
    KINDS,
    RECV_TIMEOUT_S,
    SETTINGS,
    SMALL_RING,
    TOKEN,
    W0,
    W1,
    FLOAT_2x3,
    close_all,
    connect,
    job_files,
    key,
    make,
    start_peer,
)

from splitrun.runtime import MessageKey, TransportError
from splitrun.runtime.transport import ChannelContract
from splitrun.runtime.transport.grpc import GrpcTransport
from splitrun.runtime.transport.router import RoutedTransport, TransportChoice, TransportKind
from splitrun.runtime.transport.shm.ring import SHM_DIR, new_job_prefix, remove_job_segments


@pytest.fixture
def prefix():
    """A fresh job prefix; the test must leave nothing under it."""
    prefix = new_job_prefix()
    yield prefix
    left = job_files(prefix)
    remove_job_segments(prefix)
    assert left == [], f"files of the job left in {SHM_DIR}: {left}"


W1_CONTRACTS = {
    "w0->w1#0": ChannelContract(W0, FLOAT_2x3),
    "mixed": ChannelContract(W0, ((torch.bool, (5,)), (torch.bfloat16, ()),
                                  (torch.int64, (0, 4)), (torch.complex64, (3,)))),
    "big": ChannelContract(W0, ((torch.float32, (1 << 18,)), (torch.int8, (3,)),
                                (torch.float64, (1 << 15,)))),
    "open": ChannelContract(W0, None),
    "one-open": ChannelContract(W0, (None,)),
    "control": ChannelContract(W0, ()),
}
W0_CONTRACTS = {"w1->w0#0": ChannelContract(W1, FLOAT_2x3)}


@pytest.fixture(params=KINDS)
def pair(request, prefix):
    a = make(request.param, W0, prefix, W0_CONTRACTS)
    b = make(request.param, W1, prefix, W1_CONTRACTS)
    connect(a, b)
    yield a, b
    close_all(a, b)


def test_each_pair_uses_the_transport_it_was_given(pair):
    a, b = pair
    if isinstance(a, RoutedTransport):
        assert a.kind_of(W1) is TransportKind.SHM and b.kind_of(W0) is TransportKind.SHM


def test_messages_arrive_intact_and_in_order(pair):
    a, b = pair
    sent = []
    for step in range(40):
        x = torch.randn(2, 3)
        a.send(W1, key(step), [x])
        sent.append(x)
        if step % 10 == 0:  # a dynamic-shape message in between, of varying size
            a.send(W1, key(step, "open"), [torch.arange(step * 1000)])
    a.flush(RECV_TIMEOUT_S)
    pending = b.pending()
    assert [k for k in pending if k.channel == "w0->w1#0"] == [key(s) for s in range(40)]
    for step, x in enumerate(sent):
        (got,) = b.recv(W0, key(step), RECV_TIMEOUT_S)
        assert torch.equal(got, x) and got.device.type == "cpu"
        if step % 10 == 0:
            (got,) = b.recv(W0, key(step, "open"), RECV_TIMEOUT_S)
            assert torch.equal(got, torch.arange(step * 1000))
    b.send(W0, key(0, "w1->w0#0"), [sent[0] * 2])
    (back,) = a.recv(W1, key(0, "w1->w0#0"), RECV_TIMEOUT_S)
    assert torch.equal(back, sent[0] * 2)


def test_mixed_dtypes_zero_dim_and_empty_tensors_in_one_message(pair):
    a, b = pair
    tensors = [torch.tensor([True, False, True, True, False]),
               torch.tensor(2.5, dtype=torch.bfloat16),
               torch.zeros(0, 4, dtype=torch.int64), torch.randn(3, dtype=torch.complex64)]
    a.send(W1, key(0, "mixed"), tensors)
    got = b.recv(W0, key(0, "mixed"), RECV_TIMEOUT_S)
    assert [(t.dtype, t.shape) for t in got] == [(t.dtype, t.shape) for t in tensors]
    assert all(torch.equal(g, t) for g, t in zip(got, tensors))


def test_a_control_message_carries_no_tensors(pair):
    a, b = pair
    a.send(W1, key(4, "control"), [])
    assert b.recv(W0, key(4, "control"), RECV_TIMEOUT_S) == []


def test_a_channel_without_static_shapes_takes_any_tensor(pair):
    a, b = pair
    for step, tensor in enumerate([torch.arange(5), torch.ones(2, 2, dtype=torch.float16)]):
        a.send(W1, key(step, "one-open"), [tensor])
        (got,) = b.recv(W0, key(step, "one-open"), RECV_TIMEOUT_S)
        assert torch.equal(got, tensor)


def test_a_message_larger_than_the_ring_streams_through_it(pair):
    a, b = pair
    for step in range(3):  # 1.3 MiB each, 20x the 64 KiB ring; three tensors
        tensors = [torch.randn(1 << 18), torch.tensor([1, -2, 3], dtype=torch.int8),
                   torch.randn(1 << 15, dtype=torch.float64)]
        a.send(W1, key(step, "big"), tensors)
        got = b.recv(W0, key(step, "big"), RECV_TIMEOUT_S)
        assert all(torch.equal(g, t) for g, t in zip(got, tensors))


def test_flush_confirms_delivery_and_close_is_idempotent(pair):
    a, b = pair
    for step in range(5):
        a.send(W1, key(step), [torch.full((2, 3), float(step))])
    a.flush(RECV_TIMEOUT_S)
    assert b.pending() == [key(step) for step in range(5)], \
        "every message is delivered before flush returns"
    a.close()
    a.close()
    with pytest.raises(TransportError, match="the transport is closed"):
        a.send(W1, key(9), [torch.zeros(2, 3)])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_arrive_as_cpu_tensors(pair):
    a, b = pair
    tensors = [torch.randn(1 << 18, device="cuda"), torch.tensor([1, -2, 3], dtype=torch.int8,
                                                                 device="cuda"),
               torch.randn(1 << 15, dtype=torch.float64, device="cuda")]
    a.send(W1, key(0, "big"), tensors)
    got = b.recv(W0, key(0, "big"), RECV_TIMEOUT_S)
    assert all(g.device.type == "cpu" and torch.equal(g, t.cpu()) for g, t in zip(got, tensors))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("lent", [False, True], ids=["copied", "lent"])
def test_a_cuda_process_receives_into_pinned_memory(kind, lent, prefix):
    """With the settings a job on CUDA uses, large received tensors lie in
    pinned memory (a pooled buffer, or the registered ring they are lent
    from), so the executor's copy to the GPU is DMA."""
    ring = dataclasses.replace(SMALL_RING, ring_bytes=(16 << 20) if lent else 64 << 10,
                               pin_incoming=True)
    settings = dataclasses.replace(SETTINGS, pin_receive_buffers=True)
    bulk = ((torch.float32, (1 << 19,)), (torch.float64, (1 << 15,)))  # viewable in place
    a = make(kind, W0, prefix, W0_CONTRACTS, ring=ring, settings=settings)
    b = make(kind, W1, prefix, {"bulk": ChannelContract(W0, bulk, later_bytes=0)}, ring=ring,
             settings=settings)
    connect(a, b)
    try:
        tensors = [torch.randn(1 << 19, device="cuda"),
                   torch.randn(1 << 15, dtype=torch.float64, device="cuda")]
        a.send(W1, key(0, "bulk"), tensors)
        got = b.recv(W0, key(0, "bulk"), RECV_TIMEOUT_S)
        assert all(torch.equal(g, t.cpu()) for g, t in zip(got, tensors))
        assert all(g.is_pinned() for g in got)
        if kind == "shm":
            assert b.is_lent(got[0]) == lent
        del got
    finally:
        close_all(a, b)


# Each bad message, the receiver's reason, and the gRPC status that carries it.
# Each bad message, the receiver's reason, and the gRPC status that carries it
# back to a gRPC sender.
BAD_MESSAGES = {
    "wrong dtype": (key(0), [torch.zeros(2, 3, dtype=torch.float64)],
                    r"\[worker 1\] refused channel 'w0->w1#0' step 0 .*tensor 0 expected "
                    r"float32\[2, 3\], got float64\[2, 3\]", "INVALID_ARGUMENT"),
    "wrong shape": (key(0), [torch.zeros(3, 2)],
                    r"\[worker 1\] refused .*tensor 0 expected float32\[2, 3\], got "
                    r"float32\[3, 2\]", "INVALID_ARGUMENT"),
    "too many tensors": (key(0), [torch.zeros(2, 3), torch.zeros(1)],
                         r"\[worker 1\] refused .*expected 1 tensors, got 2", "INVALID_ARGUMENT"),
    "unknown channel": (key(0, "nowhere"), [torch.zeros(1)],
                        r"\[worker 1\] refused channel 'nowhere' step 0 .*no such channel",
                        "NOT_FOUND"),
    "another incarnation": (MessageKey(INCARNATION + 1, 0, "w0->w1#0"), [torch.zeros(2, 3)],
                            r"\[worker 1\] refused .*incarnation 8, but the job's "
                            r"incarnation is 7", "FAILED_PRECONDITION"),
}


@pytest.mark.parametrize("case", sorted(BAD_MESSAGES))
def test_a_refused_message_fails_the_sender_with_the_receivers_reason(pair, case):
    a, b = pair
    bad_key, tensors, reason, status = BAD_MESSAGES[case]
    if not isinstance(a, RoutedTransport):  # gRPC says which send failed, and its status
        reason = (rf"sending channel '{bad_key.channel}' step {bad_key.step} .* to worker 1 "
                  rf".*{status}: {reason}")
    a.send(W1, bad_key, tensors)
    with pytest.raises(TransportError, match=reason):
        a.flush(RECV_TIMEOUT_S)
    assert b.pending() == [], "the refused message never reached the mailbox"
    # The receiver is undisturbed: worker 1 still sends to worker 0, whose
    # receiving side still works though its sending failed.
    b.send(W0, key(0, "w1->w0#0"), [torch.ones(2, 3)])
    b.flush(RECV_TIMEOUT_S)
    assert a.pending() == [key(0, "w1->w0#0")]
    # The failure stays raised, on sends and receives alike.
    with pytest.raises(TransportError, match=reason):
        a.send(W1, key(1), [torch.zeros(2, 3)])
    with pytest.raises(TransportError, match=reason):
        a.recv(W1, key(0, "w1->w0#0"), RECV_TIMEOUT_S)
    a.close()  # already reported: close adds nothing


@pytest.mark.parametrize("kind", KINDS)
def test_a_peer_that_dies_is_named_in_the_error(kind, prefix):
    a = make(kind, W0, prefix, W0_CONTRACTS)
    address = a.start()
    peer = start_peer(kind, prefix, address, "hold")
    try:
        peer_address = peer.wait_for(r"^address (\S+)", 60).group(1)
        a.set_peers({W1: peer_address})
        peer.wait_for(r"^ready", 60)
        if kind == "shm":
            assert a.kind_of(W1) is TransportKind.SHM
        a.send(W1, key(0), [torch.zeros(2, 3)])
        a.flush(RECV_TIMEOUT_S)
        os.kill(peer.process.pid, signal.SIGKILL)
        peer.wait(30)
        assert not pid_alive(peer.process.pid)
        with pytest.raises(TransportError, match=r"\[worker 0\] .*worker 1"):
            for step in range(1, 1000):  # the first sends may still find room
                a.send(W1, key(step), [torch.zeros(2, 3)])
                a.flush(RECV_TIMEOUT_S)
        with pytest.raises(TransportError, match=r"worker 1"):
            a.recv(W1, key(0, "w1->w0#0"), RECV_TIMEOUT_S)
    finally:
        peer.kill()
        try:
            a.close()
        except TransportError:
            pass  # already raised above
        remove_job_segments(prefix)  # what the killed process left: the launcher's job


def test_a_peer_that_sets_up_late_is_waited_for_over_shared_memory(prefix):
    """A same-host peer creates its rings in its `set_peers`, once its model is
    captured and split: this process waits for them, slice by slice, and the
    messages then flow both ways."""
    a = make("shm", W0, prefix, W0_CONTRACTS)
    b = make("shm", W1, prefix, W1_CONTRACTS)
    try:
        addresses = {W0: a.start(), W1: b.start()}
        a.set_peers({W1: addresses[W1]})
        time.sleep(10 * SMALL_RING.poll_s)  # b still setting up: a waits in slices
        b.set_peers({W0: addresses[W0]})
        a.send(W1, key(0), [torch.ones(2, 3)])
        b.send(W0, key(0, "w1->w0#0"), [torch.full((2, 3), 2.0)])
        assert torch.equal(b.recv(W0, key(0), RECV_TIMEOUT_S)[0], torch.ones(2, 3))
        assert torch.equal(a.recv(W1, key(0, "w1->w0#0"), RECV_TIMEOUT_S)[0],
                           torch.full((2, 3), 2.0))
    finally:
        close_all(a, b)


@pytest.mark.parametrize("ending", ["close", "abort"])
def test_waiting_for_a_peer_that_never_sets_up_ends_with_the_transport(prefix, caplog, ending):
    """The wait for a peer's ring is long (a peer may set up for minutes), but
    a close or the job's failure ends it at once: no reader left behind, no
    failure of its own beside the job's."""
    patient = dataclasses.replace(SMALL_RING, attach_timeout_s=600.0)
    a = make("shm", W0, prefix, W0_CONTRACTS, ring=patient)
    never = make("shm", W1, prefix, W1_CONTRACTS, ring=patient)
    try:
        a.start()
        a.set_peers({W1: never.start()})
        # No event marks "waiting for the peer's ring": give the reader a few of
        # its slices, so the close or abort lands inside the wait, not before it.
        time.sleep(4 * SMALL_RING.poll_s)
        if ending == "abort":
            a.abort(TransportError("the job failed"))
        with caplog.at_level(logging.WARNING):
            close_all(a)
        assert "did not stop" not in caplog.text
        assert "did not create its ring" not in caplog.text
    finally:
        close_all(never)


def test_grpc_is_chosen_for_a_peer_that_cannot_share_memory(prefix):
    """A peer without the job's files (another host, another /dev/shm) stays on
    gRPC under `auto`, and `grpc` forces gRPC on the same host."""
    remote = GrpcTransport(W1, token=TOKEN, incarnation=INCARNATION, settings=SETTINGS,
                           contracts=W1_CONTRACTS)
    auto = RoutedTransport(GrpcTransport(W0, token=TOKEN, incarnation=INCARNATION,
                                         settings=SETTINGS), prefix=prefix)
    forced = make("shm", W1, prefix)
    grpc_only = RoutedTransport(GrpcTransport(W0, token=TOKEN, incarnation=INCARNATION,
                                              settings=SETTINGS),
                                prefix=prefix, choice=TransportChoice.GRPC)
    try:
        auto.start()
        auto.set_peers({W1: remote.start()})
        assert auto.kind_of(W1) is TransportKind.GRPC
        auto.send(W1, key(0), [torch.ones(2, 3)])
        auto.flush(RECV_TIMEOUT_S)
        assert remote.pending() == [key(0)]
        grpc_only.start()
        grpc_only.set_peers({W1: forced.start()})
        assert grpc_only.kind_of(W1) is TransportKind.GRPC
        with pytest.raises(TransportError, match=r"SPLITRUN_TRANSPORT=shm, but worker 0 .*"
                                                 r"cannot share memory"):
            forced.set_peers({W0: grpc_only.address})
    finally:
        close_all(remote, auto, forced, grpc_only)
