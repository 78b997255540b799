"""The token is checked before any handler runs, and no failure sends a
traceback to the caller: a real scheduler and real tensor servers on
127.0.0.1, real gRPC calls."""

import sys

import grpc
import pytest
import torch
from stalled_calls import StalledCalls

from splitrun.runtime.cluster.membership import SchedulerClient
from splitrun.runtime.cluster.scheduler import Scheduler, SchedulerSettings
from splitrun.runtime.errors import ClusterError
from splitrun.runtime.rpc.service import TOKEN_METADATA_KEY
from splitrun.runtime.rpc.wire import splitrun_pb2 as pb
from splitrun.runtime.rpc.wire import splitrun_pb2_grpc as pb_grpc
from splitrun.runtime.transport import ChannelContract, MessageKey
from splitrun.runtime.transport.grpc import GrpcSettings, GrpcTransport
from splitrun.splitter.labels import Label, Role

TOKEN = "secret-token"


@pytest.fixture
def scheduler():
    scheduler = Scheduler(SchedulerSettings(2, 0, TOKEN, 7, heartbeat_timeout_s=30,
                                              dial_back_timeout_s=None))  # made-up addresses
    scheduler.start("127.0.0.1", 0)
    yield scheduler
    scheduler.stop(0)


def test_200_stalled_unauthenticated_calls_do_not_starve_the_job(scheduler):
    # 200 callers open Register and WaitForPeers (a blocking call) and never
    # send a body; the scheduler has 14 threads.
    stalled = [StalledCalls(scheduler.address, "/splitrun.Scheduler/WaitForPeers", 100),
               StalledCalls(scheduler.address, "/splitrun.Scheduler/Register", 100,
                            metadata=((TOKEN_METADATA_KEY, "wrong"),))]
    try:
        codes = stalled[0].codes() + stalled[1].codes()
        assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 200
        assert "no token" in stalled[0].details()[0]
        assert "a wrong token" in stalled[1].details()[0]
        # The job's own calls go through meanwhile: register both, wait, barrier.
        clients = [SchedulerClient(scheduler.address, TOKEN) for _ in range(2)]
        labels = [c.register(Role.WORKER, None, f"127.0.0.1:{9000 + i}").label
                  for i, c in enumerate(clients)]
        assert sorted(labels) == [Label.worker(0), Label.worker(1)]
        assert len(clients[0].wait_for_peers(labels[0], 10)) == 2
        status = clients[1].heartbeat(labels[1], 3, timeout_s=10)
        assert status.state == pb.JobStatus.RUNNING
        for client in clients:
            client.close()
    finally:
        for calls in stalled:
            calls.close()


def test_a_label_that_fails_to_parse_is_one_line_invalid_argument(scheduler):
    client = SchedulerClient(scheduler.address, TOKEN)
    client.register(Role.WORKER, 0, "127.0.0.1:9000")
    for label in ("w" + "9" * 5000, "x\ny", ""):
        with grpc.insecure_channel(scheduler.address) as channel:
            stub = pb_grpc.SchedulerStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                stub.Heartbeat(pb.HeartbeatRequest(label=label, step=0), timeout=10,
                               metadata=((TOKEN_METADATA_KEY, TOKEN),))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = info.value.details()
        assert "\n" not in details and "Traceback" not in details and len(details) < 400
    client.close()


def test_a_handler_that_raises_is_one_line_internal():
    scheduler = Scheduler(SchedulerSettings(1, 0, TOKEN, 7))

    def broken(request, context):
        raise RuntimeError("the kv store broke\nsecond line")
    scheduler.KvPut = broken
    scheduler.start("127.0.0.1", 0)
    try:
        client = SchedulerClient(scheduler.address, TOKEN)
        with pytest.raises(ClusterError) as info:
            client.kv_put("key", b"value")
        client.close()
    finally:
        scheduler.stop(0)
    message = str(info.value)
    assert "INTERNAL" in message and "RuntimeError: the kv store broke" in message
    assert "second line" not in message and "Traceback" not in message


# -- the tensor service ------------------------------------------------------------------

W0, W1 = Label.worker(0), Label.worker(1)
FLOAT_2x3 = ((torch.float32, (2, 3)),)


@pytest.fixture
def transports():
    contracts = {"w0->w1#0": ChannelContract(W0, FLOAT_2x3)}
    settings = GrpcSettings(connect_timeout_s=10.0, close_timeout_s=10.0, stream_idle_s=0.2)
    a = GrpcTransport(W0, token=TOKEN, incarnation=7, settings=settings)
    b = GrpcTransport(W1, token=TOKEN, incarnation=7, contracts=contracts, settings=settings)
    addresses = {W0: a.start(), W1: b.start()}
    a.set_peers({W1: addresses[W1]})
    b.set_peers({W0: addresses[W0]})
    yield a, b
    a.close()
    b.close()


def test_200_stalled_unauthenticated_calls_do_not_starve_a_tensor_server(transports):
    a, b = transports
    # More stalled callers than the server has threads and call slots (64).
    stalled = StalledCalls(b.address, "/splitrun.TensorService/DeliverStream", 200)
    try:
        for step in range(3):
            x = torch.randn(2, 3)
            a.send(W1, MessageKey(7, step, "w0->w1#0"), [x])
            (got,) = b.recv(W0, MessageKey(7, step, "w0->w1#0"), 30)
            assert torch.equal(got, x)
        assert stalled.codes() == [grpc.StatusCode.UNAUTHENTICATED] * 200
        assert "tensor server of [worker 1] refused a call with no token" in stalled.details()[0]
    finally:
        stalled.close()


def test_a_sender_label_of_5000_digits_is_one_line_invalid_argument(transports):
    _, b = transports
    envelope = pb.Envelope(incarnation=7, step=0, channel="w0->w1#0", src="w" + "9" * 5000,
                           total_bytes=24, little_endian=sys.byteorder == "little")
    envelope.tensors.add(dtype="float32", shape=(2, 3))
    request = pb.Chunk(envelope=envelope, data=bytes(24)).SerializeToString()
    with grpc.insecure_channel(b.address) as channel:
        call = channel.unary_unary("/splitrun.TensorService/Deliver")
        with pytest.raises(grpc.RpcError) as info:
            call(request, timeout=10, metadata=((TOKEN_METADATA_KEY, TOKEN),))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = info.value.details()
    assert "malformed label" in details
    assert "\n" not in details and "Traceback" not in details and len(details) < 400
