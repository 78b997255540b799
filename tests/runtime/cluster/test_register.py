"""A Register with the job's token but the wrong rank, role or address is
refused before it changes anything: its own status and one line naming the
rank and the fix, and the job it tried to join goes on untouched. A real
scheduler on 127.0.0.1 and real gRPC calls; the end-to-end form (a real
`splitrun join` too many, mistyped) is in test_register_e2e.py."""

import re
import socket

import grpc
import pytest

from splitrun.runtime.cluster.membership import SchedulerClient
from splitrun.runtime.cluster.scheduler import Scheduler, SchedulerSettings
from splitrun.runtime.rpc.service import TOKEN_METADATA_KEY
from splitrun.runtime.rpc.wire import splitrun_pb2 as pb
from splitrun.runtime.rpc.wire import splitrun_pb2_grpc as pb_grpc
from splitrun.splitter.labels import Label, Role

TOKEN = "secret-token"
# Bounds one Register (a dial-back to a closed port is refused at once).
CALL_S = 30


@pytest.fixture
def listener():
    """An address something listens on, for the dial-back."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield f"127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture
def closed_address():
    """An address nothing listens on: a port bound, never listened on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture
def scheduler():
    scheduler = Scheduler(SchedulerSettings(2, 0, TOKEN, 7, heartbeat_timeout_s=30))
    scheduler.start("127.0.0.1", 0)
    channel = grpc.insecure_channel(scheduler.address)
    yield scheduler, pb_grpc.SchedulerStub(channel)
    channel.close()
    scheduler.stop(0)


def register(stub, role: str, rank: int, address: str) -> grpc.RpcError | pb.RegisterReply:
    try:
        return stub.Register(pb.RegisterRequest(role=role, rank=rank, address=address,
                                                host="test", pid=4711),
                             timeout=CALL_S, metadata=((TOKEN_METADATA_KEY, TOKEN),))
    except grpc.RpcError as error:
        return error


@pytest.mark.parametrize("role, rank, code, details", [
    ("worker", 0, grpc.StatusCode.ALREADY_EXISTS,
     r"^worker 0 is already registered \(pid 4711 on test\); ask for a free one \(--rank 1\)"),
    ("worker", 2, grpc.StatusCode.OUT_OF_RANGE,
     r"^worker rank 2 is out of range: this job has 2 workers \(ranks 0 to 1\); ask for "
     r"--rank 0 to 1"),
    ("worker", -5, grpc.StatusCode.OUT_OF_RANGE, r"^worker rank -5 is out of range"),
    ("server", 0, grpc.StatusCode.OUT_OF_RANGE,
     r"^server rank 0 cannot join: this job has no servers; join as a worker \(--role "
     r"worker\), or start a job with --servers N"),
    ("scheduler", 0, grpc.StatusCode.INVALID_ARGUMENT,
     r"^a process cannot register as 'scheduler': it joins as a worker or a server .*"
     r"pass --role worker or --role server"),
    ("chief", 1, grpc.StatusCode.INVALID_ARGUMENT, r"cannot register as 'chief'"),
])
def test_a_wrong_register_is_refused_and_the_job_goes_on(scheduler, listener, role, rank,
                                                          code, details):
    scheduler, stub = scheduler
    assert isinstance(register(stub, "worker", 0, listener), pb.RegisterReply)
    refused = register(stub, role, rank, listener)
    assert isinstance(refused, grpc.RpcError)
    assert refused.code() is code
    assert "\n" not in refused.details()
    assert re.search(details, refused.details()), refused.details()
    assert scheduler.failure is None
    # The job is whole: worker 0 still beats, worker 1's rank is still free.
    client = SchedulerClient(scheduler.address, TOKEN)
    assert client.heartbeat(Label.worker(0), 0, CALL_S).state == pb.JobStatus.RUNNING
    assert client.register(Role.WORKER, None, listener).label == Label.worker(1)
    client.close()


def test_a_process_too_many_is_told_the_job_is_full(scheduler, listener):
    scheduler, stub = scheduler
    for _ in range(2):
        assert isinstance(register(stub, "worker", -1, listener), pb.RegisterReply)
    refused = register(stub, "worker", -1, listener)
    assert refused.code() is grpc.StatusCode.ALREADY_EXISTS
    assert refused.details() == (
        "every worker rank is taken: this job has 2 workers (ranks 0 to 1), all registered; "
        "this process is one too many; to run more, start a job with more workers "
        "(--workers N)")
    assert scheduler.failure is None


def test_an_unreachable_address_refuses_that_caller_only(scheduler, listener, closed_address):
    scheduler, stub = scheduler
    assert isinstance(register(stub, "worker", 0, listener), pb.RegisterReply)
    refused = register(stub, "worker", 1, closed_address)
    assert refused.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert refused.details().startswith(f"worker 1 (pid 4711 on test) advertises "
                                        f"{closed_address}, but the scheduler cannot connect")
    assert "--advertise" in refused.details()
    assert scheduler.failure is None
    # The rank stays free: the same process, fixed, joins.
    assert register(stub, "worker", 1, listener).rank == 1
    assert scheduler.failure is None


def test_a_wrong_rank_is_refused_before_the_dial_back(scheduler, listener, closed_address):
    # Nothing listens at the address, but the rank is the first thing wrong.
    scheduler, stub = scheduler
    assert isinstance(register(stub, "worker", 0, listener), pb.RegisterReply)
    refused = register(stub, "worker", 0, closed_address)
    assert refused.code() is grpc.StatusCode.ALREADY_EXISTS
    assert scheduler.failure is None


def test_after_the_job_failed_a_late_process_stops_as_a_consequence(scheduler, listener):
    # Its Register (and any blocking call) is ABORTED with the job's reason; the
    # process stops with PeerFailed, which the launcher never blames over the
    # failure itself.
    from splitrun.runtime.errors import PeerFailed

    scheduler, stub = scheduler
    scheduler.fail("w1", "worker 1 failed at step 3: ValueError: boom")
    refused = register(stub, "worker", 0, listener)
    assert refused.code() is grpc.StatusCode.ABORTED
    assert refused.details() == "worker 1 failed at step 3: ValueError: boom"
    client = SchedulerClient(scheduler.address, TOKEN)
    with pytest.raises(PeerFailed, match=r"^job failed: worker 1 failed at step 3: "
                                         r"ValueError: boom$"):
        client.register(Role.WORKER, 0, listener)
    client.close()
