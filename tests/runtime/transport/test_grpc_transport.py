"""GrpcTransport over real sockets on 127.0.0.1, what the transport contract
(tests/runtime/transport/test_transports.py, run on gRPC and shared memory) does not cover:
chunking and the send queue's bound, a split program trained to the same
numbers as the unsplit step, bad requests from a raw client refused with the
right status and leaving the job alone, and waits and sends to a gone peer
that end with errors naming the peer.

Every wait is bounded; no sleep synchronises anything; timings decide nothing.
"""

import dataclasses
import logging
import re
import sys
import threading

import grpc
import pytest
import torch
from models import TiedBigramLM, lm_loss, markov_batches
from transport_pairs import (
    INCARNATION,
    RECV_TIMEOUT_S,
    SETTINGS,
    TOKEN,
    W0,
    W1,
    W2,
    FLOAT_2x3,
    close_all,
    connect,
    key,
)

from splitrun.runtime import Executor, Mailbox, RecvTimeout, TransportError
from splitrun.runtime.rpc.wire import splitrun_pb2
from splitrun.runtime.transport import ChannelContract, receive_contracts
from splitrun.runtime.transport.dtypes import TensorSpec
from splitrun.runtime.transport.grpc import GrpcSettings, GrpcTransport
from splitrun.runtime.transport.grpc.outgoing import SendQueue
from splitrun.splitter import Cluster, capture, optim, split, split_program
from splitrun.splitter.testing import random_batches, random_program

# Bounds each raw client call in the bad-input tests.
CALL_TIMEOUT_S = 10.0


@pytest.fixture
def pair():
    """Worker 0 and worker 1, each expecting what the tests below send it."""
    expected_w1 = {"w0->w1#0": ChannelContract(W0, FLOAT_2x3)}
    expected_w0 = {"w1->w0#0": ChannelContract(W1, FLOAT_2x3)}
    a = GrpcTransport(W0, token=TOKEN, incarnation=INCARNATION, contracts=expected_w0,
                      settings=SETTINGS)
    b = GrpcTransport(W1, token=TOKEN, incarnation=INCARNATION, contracts=expected_w1,
                      settings=SETTINGS)
    connect(a, b)
    yield a, b
    close_all(a, b)


# -- chunks and the send queue -------------------------------------------------------------


def test_a_message_larger_than_a_chunk_streams_in_pieces():
    settings = GrpcSettings(chunk_bytes=64 << 10, stream_idle_s=0.2, connect_timeout_s=2.0)
    a = GrpcTransport(W0, token=TOKEN, incarnation=INCARNATION, settings=settings)
    b = GrpcTransport(W1, token=TOKEN, incarnation=INCARNATION, settings=settings,
                      contracts={"big": ChannelContract(W0, ((torch.float32, (1 << 18,)),))})
    connect(a, b)
    try:
        for step in range(2):
            x = torch.randn(1 << 18)  # 1 MiB: 16 chunks
            a.send(W1, key(step, "big"), [x])
            (got,) = b.recv(W0, key(step, "big"), RECV_TIMEOUT_S)
            assert torch.equal(got, x)
    finally:
        close_all(a, b)


def test_a_full_queue_holds_the_sender_back_and_drops_nothing():
    settings = GrpcSettings(max_queued_bytes=256 << 10, chunk_bytes=64 << 10,
                            stream_idle_s=0.2, connect_timeout_s=2.0)
    a = GrpcTransport(W0, token=TOKEN, incarnation=INCARNATION, settings=settings)
    b = GrpcTransport(W1, token=TOKEN, incarnation=INCARNATION, settings=settings,
                      contracts={"big": ChannelContract(W0, ((torch.float32, (1 << 18,)),))})
    connect(a, b)
    try:
        sent = [torch.full((1 << 18,), float(step)) for step in range(12)]  # 12 MiB, 48x the bound
        for step, x in enumerate(sent):
            a.send(W1, key(step, "big"), [x])
        a.flush(RECV_TIMEOUT_S)
        for step, x in enumerate(sent):
            (got,) = b.recv(W0, key(step, "big"), RECV_TIMEOUT_S)
            assert torch.equal(got, x)
    finally:
        close_all(a, b)


def test_send_queue_blocks_at_its_bound_and_lets_an_oversized_message_go_alone():
    class Item:
        def __init__(self, nbytes):
            self.nbytes = nbytes
    queue = SendQueue(max_bytes=100)
    first, second = Item(60), Item(60)
    assert queue.put(first, timeout_s=1)
    assert not queue.put(second, timeout_s=0.05), "over the bound: held back"
    released = threading.Event()

    def put_second():
        queue.put(second, timeout_s=RECV_TIMEOUT_S)
        released.set()
    thread = threading.Thread(target=put_second)
    thread.start()
    assert queue.peek(1) is first
    queue.pop(first)
    assert released.wait(RECV_TIMEOUT_S)
    thread.join(RECV_TIMEOUT_S)
    queue.pop(second)
    assert queue.put(Item(1000), timeout_s=1), "an empty queue takes any message"


# -- a split program over two transports ------------------------------------------------


def run_over_grpc(plan, program, num_steps, feeds):
    """run_threaded's loop, with a GrpcTransport per process instead of loopback."""
    transports = {label: GrpcTransport(label, token=TOKEN, incarnation=INCARNATION,
                                       contracts=receive_contracts(plan, program, label),
                                       settings=SETTINGS)
                  for label in plan.labels}
    connect(*transports.values())
    executors = {label: Executor(plan, program, label, transports[label],
                                 incarnation=INCARNATION, recv_timeout_s=RECV_TIMEOUT_S)
                 for label in plan.labels}
    history = [{} for _ in range(num_steps)]
    failures = []
    lock = threading.Lock()

    def work(executor):
        try:
            executor.load_state(program.initial_state)
            for step in range(num_steps):
                outputs = executor.run_step(step, {**feeds(step), **program.hparams(step)})
                with lock:
                    history[step].update(outputs)
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)
            for transport in transports.values():
                transport.abort(exc)

    threads = [threading.Thread(target=work, args=(e,)) for e in executors.values()]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(num_steps * RECV_TIMEOUT_S + 30)
        assert not any(t.is_alive() for t in threads), "a step hangs"
        if failures:
            raise failures[0]
    finally:
        close_all(*transports.values())
    state = {}
    for executor in executors.values():
        state.update(executor.state)
    messages = sum(e.stats.messages_sent for e in executors.values())
    return history, state, messages


def assert_same_training(program, plan, num_steps, feeds, split_program=None):
    """`split_program`: the program the plan's names refer to, where it is not
    `program` (the split grouped the updates)."""
    expected_history, expected_state = program.train_unsplit(num_steps, feeds)
    history, state, messages = run_over_grpc(plan, split_program or program, num_steps, feeds)
    assert messages >= num_steps, "the processes must really talk"
    for step in range(num_steps):
        assert history[step].keys() == expected_history[step].keys()
        for name, value in expected_history[step].items():
            assert torch.equal(history[step][name], value), f"step {step}: {name} differs"
    assert state.keys() == expected_state.keys()
    for name, value in expected_state.items():
        assert torch.equal(state[name], value), f"state {name} differs"


def test_a_random_split_program_trains_like_the_unsplit_step():
    program = random_program(40, [W0, W1, W2], seed=5, run_length=3.0, shape=(3, 4))
    plan = split(program, Cluster(num_workers=3))
    batches = random_batches(program, 4, seed=1)
    assert_same_training(program, plan, 4, lambda step: batches[step])


def test_a_captured_model_trains_like_the_unsplit_step():
    torch.manual_seed(1)
    model = TiedBigramLM(num_workers=2)
    data = markov_batches(3, batch=8)
    program = capture(model, lm_loss, optim.Adam(lr=0.01), data[0])
    done = split_program(program, Cluster(num_workers=2))
    feeds = lambda step: {"batch.0": data[step][0], "batch.1": data[step][1]}  # noqa: E731
    assert_same_training(program, done.plan, 3, feeds, done.program)


def test_receive_contracts_come_from_the_plan_and_the_graph():
    program = random_program(30, [W0, W1], seed=3, run_length=3.0, shape=(2, 5))
    plan = split(program, Cluster(num_workers=2))
    expected = receive_contracts(plan, program, W1)
    assert set(expected) == {c.name for c in plan.recv_channels(W1)} and expected
    for channel in plan.recv_channels(W1):
        assert expected[channel.name].src == channel.src
        assert all(spec == TensorSpec(torch.float32, (2, 5))
                   for spec in expected[channel.name].tensors if spec is not None)


# -- waits that end with errors naming the peer -------------------------------------------


def test_a_receive_whose_peer_never_sends_names_channel_peer_and_step(pair):
    _, b = pair
    with pytest.raises(RecvTimeout, match=r"\[worker 1\] receive on channel 'w0->w1#0' step 3: "
                                          r"no message from worker 0 within 0.2 s"):
        b.recv(W0, key(3), timeout_s=0.2)


def test_a_send_to_a_peer_that_is_gone_fails_naming_the_peer():
    gone = GrpcTransport(W1, token=TOKEN, incarnation=INCARNATION, settings=SETTINGS)
    address = gone.start()
    gone.close()
    a = GrpcTransport(W0, token=TOKEN, incarnation=INCARNATION, settings=SETTINGS)
    a.start()
    a.set_peers({W1: address})
    try:
        a.send(W1, key(0), [torch.zeros(2, 3)])  # queued: sends do not wait
        pattern = (rf"\[worker 0\] cannot reach worker 1 at {address} to send "
                   rf"channel 'w0->w1#0' step 0")
        with pytest.raises(TransportError, match=pattern):
            a.recv(W1, key(0, "w1->w0#0"), timeout_s=RECV_TIMEOUT_S)
        with pytest.raises(TransportError, match=pattern):
            a.send(W1, key(1), [torch.zeros(2, 3)])
    finally:
        a.close()


def test_closing_after_a_job_raises_nothing_in_any_thread(monkeypatch):
    """A job's end: streams opened one after another, then close at once. gRPC's
    connectivity poller (started by `channel_ready_future`) used to outlive the
    connect wait and raise `ValueError: Cannot invoke RPC: Channel closed!` in its
    own thread on the closed channel, in every one of these rounds."""
    raised = []
    monkeypatch.setattr(threading, "excepthook", lambda args: raised.append(
        f"{args.thread.name if args.thread else '?'}: {args.exc_type.__name__}: "
        f"{args.exc_value}"))
    settings = dataclasses.replace(SETTINGS, stream_idle_s=0.01)
    contracts = {"w0->w1#0": ChannelContract(W0, FLOAT_2x3)}
    for _ in range(10):
        a = GrpcTransport(W0, token=TOKEN, incarnation=INCARNATION, settings=settings)
        b = GrpcTransport(W1, token=TOKEN, incarnation=INCARNATION, settings=settings,
                          contracts=contracts)
        connect(a, b)
        try:
            for step in range(5):
                a.send(W1, key(step), [torch.ones(2, 3)])
                a.flush(RECV_TIMEOUT_S)  # the stream ends: the next send opens another
        finally:
            close_all(a, b)
    # gRPC's threads that were still running at close end within their poll
    # period (0.2 s); join them, bounded, before looking.
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and thread.daemon:
            thread.join(timeout=1.0)
    assert raised == []


def test_a_process_takes_its_identity_after_its_server_is_up():
    provisional = GrpcTransport(W0, token=TOKEN, incarnation=0, settings=SETTINGS)
    peer = GrpcTransport(W0, token=TOKEN, incarnation=INCARNATION, settings=SETTINGS)
    connect_to = provisional.start()
    provisional.set_identity(W2, INCARNATION)
    provisional.expect({"w0->w2#0": ChannelContract(W0, FLOAT_2x3)})
    peer.start()
    peer.set_peers({W2: connect_to})
    try:
        assert peer.ping(W2) == "w2"
        peer.send(W2, key(0, "w0->w2#0"), [torch.ones(2, 3)])
        (got,) = provisional.recv(W0, key(0, "w0->w2#0"), RECV_TIMEOUT_S)
        assert torch.equal(got, torch.ones(2, 3))
    finally:
        close_all(provisional, peer)


# -- bad input from a raw client ------------------------------------------------------------


@pytest.fixture
def server():
    """Worker 1's transport alone, and a raw gRPC channel to it."""
    transport = GrpcTransport(W1, token=TOKEN, incarnation=INCARNATION, settings=SETTINGS,
                              contracts={"w0->w1#0": ChannelContract(W0, FLOAT_2x3),
                                        "open": ChannelContract(W0, (None,))})
    address = transport.start()
    channel = grpc.insecure_channel(address)
    grpc.channel_ready_future(channel).result(timeout=CALL_TIMEOUT_S)
    yield transport, channel
    channel.close()
    transport.close()


def chunk(step=0, channel="w0->w1#0", src="w0", incarnation=INCARNATION, dtype="float32",
          shape=(2, 3), data=None, total_bytes=None) -> bytes:
    data = bytes(24) if data is None else data
    envelope = splitrun_pb2.Envelope(incarnation=incarnation, step=step, channel=channel, src=src,
                                     total_bytes=len(data) if total_bytes is None else total_bytes,
                                     little_endian=sys.byteorder == "little")
    envelope.tensors.add(dtype=dtype, shape=shape)
    return splitrun_pb2.Chunk(envelope=envelope, data=data).SerializeToString()


def deliver(channel, request: bytes, token: str | None = TOKEN):
    call = channel.unary_unary("/splitrun.TensorService/Deliver")
    metadata = () if token is None else (("splitrun-token", token),)
    return call(request, timeout=CALL_TIMEOUT_S, metadata=metadata)


def deliver_stream(channel, requests):
    call = channel.stream_unary("/splitrun.TensorService/DeliverStream")
    return call(iter(requests), timeout=CALL_TIMEOUT_S, metadata=(("splitrun-token", TOKEN),))


BAD_REQUESTS = {
    "no-token": (dict(token=None), grpc.StatusCode.UNAUTHENTICATED,
                 r"tensor server of \[worker 1\] refused a call with no token"),
    "wrong-token": (dict(token="guess"), grpc.StatusCode.UNAUTHENTICATED,
                    r"refused a call with a wrong token"),
    "garbage": (dict(request=b"\xff\x00 not protobuf"), grpc.StatusCode.INVALID_ARGUMENT,
                r"\[worker 1\] refused a request from .*: the request is not a splitrun Chunk"),
    "short-data": (dict(request=chunk(data=bytes(20), total_bytes=24)),
                   grpc.StatusCode.INVALID_ARGUMENT,
                   r"Deliver carried 20 of the envelope's 24 bytes"),
    "long-data": (dict(request=chunk(data=bytes(28), total_bytes=24)),
                  grpc.StatusCode.INVALID_ARGUMENT,
                  r"data runs past the envelope's total_bytes 24"),
    "shape-vs-total": (dict(request=chunk(shape=(2, 4), total_bytes=24)),
                       grpc.StatusCode.INVALID_ARGUMENT,
                       r"tensors \(float32\[2, 4\]\) take 32 bytes but total_bytes says 24"),
    "unknown-channel": (dict(request=chunk(channel="w0->w1#99")), grpc.StatusCode.NOT_FOUND,
                        r"refused channel 'w0->w1#99' step 0 from 'w0' .*: no such channel into "
                        r"this process \(it receives open, w0->w1#0\)"),
    "stale-incarnation": (dict(request=chunk(incarnation=INCARNATION - 1)),
                          grpc.StatusCode.FAILED_PRECONDITION,
                          rf"incarnation {INCARNATION - 1}, but the job's incarnation is "
                          rf"{INCARNATION}; the sender belongs to a previous run"),
    "wrong-sender": (dict(request=chunk(src="w2")), grpc.StatusCode.PERMISSION_DENIED,
                     r"this channel comes from worker 0, the envelope says worker 2"),
    "bad-label": (dict(request=chunk(src="root")), grpc.StatusCode.INVALID_ARGUMENT,
                  r"malformed label 'root'"),
    "wrong-dtype": (dict(request=chunk(dtype="bfloat16", data=bytes(12))),
                    grpc.StatusCode.INVALID_ARGUMENT,
                    r"tensor 0 expected float32\[2, 3\], got bfloat16\[2, 3\]"),
    "unknown-dtype": (dict(request=chunk(dtype="object", data=bytes(0), total_bytes=0)),
                      grpc.StatusCode.INVALID_ARGUMENT, r"unknown dtype 'object'"),
    "huge-claim": (dict(request=chunk(channel="open", dtype="uint8", shape=(1 << 40,),
                                      data=b"", total_bytes=1 << 40)),
                   grpc.StatusCode.INVALID_ARGUMENT,
                   r"declares 1099511627776 bytes, above the limit"),
    "no-envelope": (dict(request=splitrun_pb2.Chunk(data=b"abc").SerializeToString()),
                    grpc.StatusCode.INVALID_ARGUMENT,
                    r"refused a request .*: a chunk without an envelope"),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_requests_are_refused_and_leave_the_job_alone(server, case, caplog):
    transport, channel = server
    kwargs, code, details = BAD_REQUESTS[case]
    request = kwargs.get("request", chunk())
    with caplog.at_level(logging.WARNING, logger="splitrun.runtime.transport.grpc"):
        with pytest.raises(grpc.RpcError) as raised:
            deliver(channel, request, token=kwargs.get("token", TOKEN))
    assert raised.value.code() == code, raised.value.details()
    assert re.search(details, raised.value.details()), raised.value.details()
    assert any("[worker 1] refused" in r.getMessage() and r.levelno == logging.WARNING
               for r in caplog.records), "every refusal is logged"
    assert transport.pending() == [], "a refused message never reaches the mailbox"
    # The process is undisturbed: a good message still goes through.
    deliver(channel, chunk(step=5, data=torch.arange(6.0).numpy().tobytes()))
    (got,) = transport.recv(W0, key(5), RECV_TIMEOUT_S)
    assert torch.equal(got, torch.arange(6.0).view(2, 3))


def test_a_duplicate_message_is_refused(server):
    transport, channel = server
    deliver(channel, chunk(step=1))
    with pytest.raises(grpc.RpcError) as raised:
        deliver(channel, chunk(step=1))
    assert raised.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert re.search(r"\[worker 1\] refused a second message for channel 'w0->w1#0' step 1 "
                     r"\(incarnation 7\) from worker 0", raised.value.details())
    assert len(transport.recv(W0, key(1), RECV_TIMEOUT_S)) == 1


def test_broken_streams_are_refused(server):
    transport, channel = server
    data_only = splitrun_pb2.Chunk(data=bytes(8)).SerializeToString()
    with pytest.raises(grpc.RpcError) as raised:
        deliver_stream(channel, [data_only])
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "a chunk without an envelope" in raised.value.details()
    with pytest.raises(grpc.RpcError) as raised:
        deliver_stream(channel, [chunk(step=2, data=bytes(16), total_bytes=24)])
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "the stream ended after 16 of the envelope's 24 bytes" in raised.value.details()
    # A refusal names how many messages of the stream were delivered before it.
    with pytest.raises(grpc.RpcError) as raised:
        deliver_stream(channel, [chunk(step=3), chunk(step=4, src="w2")])
    assert raised.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert dict(raised.value.trailing_metadata())["splitrun-delivered"] == "1"
    assert transport.pending() == [key(3)]


def test_a_failure_inside_the_server_reaches_the_sender_as_internal(server, monkeypatch):
    transport, channel = server

    def broken_put(*args):
        raise RuntimeError("disk on fire")
    monkeypatch.setattr(Mailbox, "put", broken_put)
    with pytest.raises(grpc.RpcError) as raised:
        deliver(channel, chunk(step=1))
    assert raised.value.code() == grpc.StatusCode.INTERNAL
    details = raised.value.details()
    assert re.search(r"\[worker 1\] failed on channel 'w0->w1#0' step 1 .*RuntimeError: disk on "
                     r"fire$", details)
    assert "\n" not in details and "Traceback" not in details  # the traceback stays here


def test_a_message_before_the_plan_waits_for_it_then_is_refused():
    settings = GrpcSettings(expect_timeout_s=0.2, stream_idle_s=0.2)
    transport = GrpcTransport(W1, token=TOKEN, incarnation=INCARNATION, settings=settings)
    channel = grpc.insecure_channel(transport.start())
    try:
        with pytest.raises(grpc.RpcError) as raised:
            deliver(channel, chunk())
        assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "this process has no plan yet (expect() not called within 0.2 s)" in \
            raised.value.details()
    finally:
        channel.close()
        transport.close()


def test_a_message_waiting_for_the_plan_is_refused_at_once_when_the_job_fails():
    """A peer may start its first step minutes before this process has its plan
    (the wait is long); a job failure meanwhile ends the wait with a refusal
    saying so, instead of holding the server thread for the rest of it."""
    settings = GrpcSettings(expect_timeout_s=600.0, stream_idle_s=0.2)
    transport = GrpcTransport(W1, token=TOKEN, incarnation=INCARNATION, settings=settings)
    channel = grpc.insecure_channel(transport.start())
    outcome = {}

    def deliver_one():
        try:
            deliver(channel, chunk())
        except grpc.RpcError as exc:
            outcome["error"] = exc
    sender = threading.Thread(target=deliver_one)
    try:
        sender.start()
        sender.join(1.0)
        assert sender.is_alive(), "the message must wait for the plan"
        transport.abort(TransportError("the job failed"))
        sender.join(CALL_TIMEOUT_S)
        assert not sender.is_alive()
        error = outcome["error"]
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "this process closed (or its job failed) before it took its plan" in \
            error.details()
    finally:
        channel.close()
        transport.close()


def test_ping_needs_the_token_and_names_the_process(server):
    transport, channel = server
    ping = channel.unary_unary("/splitrun.TensorService/Ping")
    reply = ping(b"", timeout=CALL_TIMEOUT_S, metadata=(("splitrun-token", TOKEN),))
    assert splitrun_pb2.PingReply.FromString(reply).label == "w1"
    with pytest.raises(grpc.RpcError) as raised:
        ping(b"", timeout=CALL_TIMEOUT_S)
    assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
