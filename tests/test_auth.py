"""The token is checked before any handler runs, and no failure sends a
traceback to the caller: a real scheduler on 127.0.0.1, real gRPC calls."""

import grpc
import pytest
from stalled_calls import StalledCalls

from splitrun.runtime.cluster.membership import SchedulerClient
from splitrun.runtime.cluster.scheduler import Scheduler, SchedulerSettings
from splitrun.runtime.errors import ClusterError
from splitrun.runtime.transport.grpc.service import TOKEN_METADATA_KEY
from splitrun.runtime.transport.wire import splitrun_pb2 as pb
from splitrun.runtime.transport.wire import splitrun_pb2_grpc as pb_grpc
from splitrun.splitter.labels import Label, Role

TOKEN = "secret-token"


@pytest.fixture
def scheduler():
    scheduler = Scheduler(SchedulerSettings(2, 0, TOKEN, 7, heartbeat_timeout_s=30))
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
