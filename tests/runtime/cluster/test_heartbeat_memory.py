"""Every heartbeat carries the process's memory (RSS, peak, its memory
cgroup's limit), so a process killed by the OOM killer, which leaves no words
of its own, is named by the scheduler with its last figures, and as likely
OOM-killed when its peak was near its cgroup's limit. A real scheduler on
127.0.0.1 and real gRPC calls."""

import re
import socket

import grpc
import pytest

from splitrun.runtime.cluster.membership import SchedulerClient
from splitrun.runtime.cluster.process_memory import own_memory
from splitrun.runtime.cluster.scheduler import NEAR_MEMORY_LIMIT, Scheduler, SchedulerSettings
from splitrun.runtime.rpc.service import TOKEN_METADATA_KEY
from splitrun.runtime.rpc.wire import splitrun_pb2 as pb
from splitrun.runtime.rpc.wire import splitrun_pb2_grpc as pb_grpc
from splitrun.splitter.labels import Label, Role

TOKEN = "secret-token"
CALL_S = 30
MIB = 1 << 20
# The scheduler declares a silent process lost after this long.
SILENT_S = 1.0


@pytest.fixture
def job():
    """A scheduler of one worker, registered; its stub."""
    scheduler = Scheduler(SchedulerSettings(1, 0, TOKEN, 7, heartbeat_timeout_s=SILENT_S,
                                            dial_back_timeout_s=None))
    scheduler.start("127.0.0.1", 0)
    channel = grpc.insecure_channel(scheduler.address)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        client = SchedulerClient(scheduler.address, TOKEN)
        client.register(Role.WORKER, 0, f"127.0.0.1:{sock.getsockname()[1]}")
        yield scheduler, pb_grpc.SchedulerStub(channel), client
    client.close()
    channel.close()
    scheduler.stop(0)


def lost(scheduler) -> str:
    """The reason the scheduler gives once the worker's heartbeats stop."""
    assert scheduler.wait_done(SILENT_S + 10), "the silent worker was never declared lost"
    label, reason = scheduler.failure
    assert label == "w0"
    return reason


def beat(stub, rss_mib: int, peak_mib: int, limit_mib: int) -> None:
    stub.Heartbeat(pb.HeartbeatRequest(label="w0", step=3, rss_bytes=rss_mib * MIB,
                                       peak_rss_bytes=peak_mib * MIB,
                                       memory_limit_bytes=limit_mib * MIB),
                   timeout=CALL_S, metadata=((TOKEN_METADATA_KEY, TOKEN),))


def test_a_process_gone_silent_near_its_memory_cap_is_named_as_likely_oom_killed(job):
    scheduler, stub, _ = job
    beat(stub, rss_mib=2500, peak_mib=2590, limit_mib=2600)
    reason = lost(scheduler)
    assert re.search(r"worker 0 \(pid \d+ on .*\) sent no heartbeat for [\d.]+ s \(last at "
                     r"step 3\); it died or hangs; its last heartbeat said RSS 2500.0 MiB "
                     r"\(peak 2590.0 MiB\) of its memory cgroup's limit 2600.0 MiB: likely "
                     r"killed by the OOM killer \(its cgroup's memory.events on .* counts "
                     r"it\); give it more memory, or spread the state over more servers$",
                     reason), reason


def test_far_below_its_cap_or_without_one_it_is_not_called_out_of_memory(job):
    scheduler, stub, _ = job
    below = int(2600 * NEAR_MEMORY_LIMIT) - 100
    beat(stub, rss_mib=below, peak_mib=below, limit_mib=2600)
    reason = lost(scheduler)
    assert f"RSS {below}.0 MiB (peak {below}.0 MiB) of its memory cgroup's limit 2600.0 MiB" \
        in reason
    assert "OOM" not in reason


def test_the_clients_heartbeat_carries_this_processs_own_memory(job):
    scheduler, _, client = job
    client.heartbeat(Label.worker(0), 2, CALL_S)
    rss, peak, limit = own_memory()
    assert rss > 0 and peak >= rss
    reason = lost(scheduler)
    said = re.search(r"its last heartbeat said RSS ([\d.]+) MiB \(peak ([\d.]+) MiB\)", reason)
    assert said is not None, reason
    assert abs(float(said.group(1)) - rss / MIB) < 200, (said.group(1), rss / MIB)
    assert (f"of its memory cgroup's limit {limit / MIB:.1f} MiB" in reason) == bool(limit)


def test_a_peer_that_saw_the_death_first_does_not_take_the_blame():
    """Peers see an OOM-killed process die (its end of a ring gone) before
    the scheduler misses its heartbeats: the scheduler names the dead one,
    with its memory, not the peer that reported it."""
    scheduler = Scheduler(SchedulerSettings(2, 0, TOKEN, 7, heartbeat_timeout_s=60,
                                            dial_back_timeout_s=None))
    scheduler.start("127.0.0.1", 0)
    channel = grpc.insecure_channel(scheduler.address)
    stub = pb_grpc.SchedulerStub(channel)
    clients = []
    try:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            for rank in range(2):
                clients.append(SchedulerClient(scheduler.address, TOKEN))
                clients[-1].register(Role.WORKER, rank, f"127.0.0.1:{sock.getsockname()[1]}")
        stub.Heartbeat(pb.HeartbeatRequest(label="w1", step=4, rss_bytes=900 * MIB,
                                           peak_rss_bytes=990 * MIB,
                                           memory_limit_bytes=1000 * MIB),
                       timeout=CALL_S, metadata=((TOKEN_METADATA_KEY, TOKEN),))
        clients[0].report_failure(Label.worker(0), "PeerDied: [worker 0] worker 1 died (its "
                                  "end of the shared-memory ring is gone)",
                                  dead_peer=Label.worker(1))
        label, reason = scheduler.failure
        assert label == "w1"
        assert re.search(r"^worker 1 \(pid \d+ on .*\) died \(last at step 4; worker 0 saw: "
                         r"PeerDied: \[worker 0\] worker 1 died .*\); its last heartbeat said "
                         r"RSS 900.0 MiB \(peak 990.0 MiB\) of its memory cgroup's limit "
                         r"1000.0 MiB: likely killed by the OOM killer", reason), reason
    finally:
        for client in clients:
            client.close()
        channel.close()
        scheduler.stop(0)
