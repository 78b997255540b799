"""A process's side of cluster membership: the scheduler client and the
heartbeat thread that tells this process when the job failed or finished."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from splitrun.splitter.labels import Cluster, Label, Role

from ..errors import ClusterError, PeerFailed
from ..rpc.service import TOKEN_METADATA_KEY
from ..rpc.tls import TlsFiles
from ..rpc.wire import splitrun_pb2 as pb
from ..rpc.wire import splitrun_pb2_grpc as pb_grpc
from .process_memory import own_memory
from .scheduler import SETTING_UP, SHM_PREFIX_KEY

__all__ = ["Registration", "SchedulerClient", "Heartbeat"]

logger = logging.getLogger(__name__)

# Bounds one ordinary scheduler call (registration, reports, kv puts).
CALL_TIMEOUT_S = 30.0
# How long a process keeps trying to reach a scheduler that is not up yet.
CONNECT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Registration:
    label: Label
    incarnation: int
    cluster: Cluster
    heartbeat_interval_s: float


class SchedulerClient:
    """Typed calls to the scheduler; gRPC errors become `ClusterError`s that
    carry the scheduler's explanation."""

    def __init__(self, address: str, token: str, tls: TlsFiles | None = None) -> None:
        self.address = address
        self._metadata = ((TOKEN_METADATA_KEY, token),)
        self._channel = (grpc.insecure_channel(address) if tls is None
                         else grpc.secure_channel(address, tls.channel_credentials()))
        self._stub = pb_grpc.SchedulerStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def _call(self, method: str, request, timeout_s: float = CALL_TIMEOUT_S, *,
              wait_for_ready: bool = False):
        try:
            return getattr(self._stub, method)(request, timeout=timeout_s,
                                               metadata=self._metadata,
                                               wait_for_ready=wait_for_ready)
        except grpc.RpcError as exc:
            if wait_for_ready and exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                raise ClusterError(
                    f"cannot reach the scheduler at {self.address} within {timeout_s:g} s; "
                    f"is it running, and is the address right?") from None
            if exc.code() is grpc.StatusCode.ABORTED:  # the job failed elsewhere: its reason
                raise PeerFailed(f"job failed: {exc.details()}") from None
            raise ClusterError(
                f"scheduler {self.address} {method}: {exc.code().name}: {exc.details()}"
            ) from None

    def register(self, role: Role, rank: int | None, address: str) -> Registration:
        # wait_for_ready, not channel_ready_future: the future's connectivity
        # polling thread can outlive it and fail on the closed channel at exit
        # ("Cannot invoke RPC: Channel closed!").
        reply = self._call("Register", pb.RegisterRequest(
            role=role.value, rank=-1 if rank is None else rank, address=address,
            host=socket.gethostname(), pid=os.getpid()), timeout_s=CONNECT_TIMEOUT_S,
            wait_for_ready=True)
        return Registration(Label(reply.rank, role), reply.incarnation,
                            Cluster(reply.num_workers, reply.num_servers),
                            reply.heartbeat_interval_s)

    def shm_prefix(self) -> str:
        """The job's shared-memory prefix (for a process no launcher gave one);
        asked before registering, so it waits for a scheduler not up yet."""
        return self._call("KvGet", pb.KvGetRequest(key=SHM_PREFIX_KEY, timeout_s=0),
                          timeout_s=CONNECT_TIMEOUT_S, wait_for_ready=True).value.decode()

    def wait_for_peers(self, label: Label, timeout_s: float) -> dict[Label, str]:
        table = self._call("WaitForPeers", pb.WaitForPeersRequest(
            label=str(label), timeout_s=timeout_s), timeout_s=timeout_s + CALL_TIMEOUT_S)
        return {Label.parse(p.label): p.address for p in table.peers}

    def submit_plan(self, label: Label, fingerprint: str, summary: str) -> None:
        self._call("SubmitPlan", pb.SubmitPlanRequest(label=str(label), fingerprint=fingerprint,
                                                      summary=summary))

    def heartbeat(self, label: Label, step: int, timeout_s: float,
                  waiting: tuple[Label, float] | None = None) -> pb.JobStatus:
        peer, waiting_s = waiting if waiting is not None else (None, 0.0)
        rss, peak, limit = own_memory()
        return self._call("Heartbeat", pb.HeartbeatRequest(
            label=str(label), step=step, waiting_on="" if peer is None else str(peer),
            waiting_s=waiting_s, rss_bytes=rss, peak_rss_bytes=peak,
            memory_limit_bytes=limit), timeout_s=timeout_s)

    def report_failure(self, label: Label, message: str, dead_peer: Label | None = None) -> None:
        self._call("ReportFailure", pb.FailureReport(
            label=str(label), message=message,
            dead_peer="" if dead_peer is None else str(dead_peer)))

    def report_finished(self, label: Label, num_steps: int) -> pb.JobStatus:
        return self._call("ReportFinished", pb.FinishedReport(label=str(label),
                                                              num_steps=num_steps))

    def report_done(self, label: Label) -> None:
        self._call("ReportDone", pb.DoneReport(label=str(label)))

    def kv_put(self, key: str, value: bytes) -> None:
        self._call("KvPut", pb.KvPutRequest(key=key, value=value))

    def kv_get(self, key: str, timeout_s: float) -> bytes:
        return self._call("KvGet", pb.KvGetRequest(key=key, timeout_s=timeout_s),
                          timeout_s=timeout_s + CALL_TIMEOUT_S).value

    def barrier(self, name: str, label: Label, timeout_s: float) -> None:
        self._call("Barrier", pb.BarrierRequest(name=name, label=str(label),
                                                timeout_s=timeout_s),
                   timeout_s=timeout_s + CALL_TIMEOUT_S)


class Heartbeat:
    """Tells the scheduler this process is alive (and at which step) and hears
    back the job's state: `on_failed(reason)` when the job failed or the
    scheduler is unreachable past the deadline, `on_finished(num_steps)` when
    the workers finished."""

    def __init__(self, client: SchedulerClient, label: Label, interval_s: float,
                 lost_after_s: float, on_failed: Callable[[str], None],
                 on_finished: Callable[[int], None]) -> None:
        self._client = client
        self._label = label
        self._interval_s = interval_s
        self._lost_after_s = lost_after_s
        self._on_failed = on_failed
        self._on_finished = on_finished
        self._step = SETTING_UP  # until the process reports where its steps start
        self._waiting: Callable[[], tuple[Label, float] | None] = lambda: None
        # (last answered heartbeat, the latest error) while heartbeats fail.
        self._failing: tuple[float, ClusterError] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"splitrun-heartbeat-{label}")

    def start(self) -> None:
        self._thread.start()

    def watch_waits(self, waiting: Callable[[], tuple[Label, float] | None]) -> None:
        """`waiting()`: the peer this process waits on inside a step and for how
        long (None when it waits on none); each heartbeat carries it."""
        self._waiting = waiting

    def report_step(self, step: int) -> None:
        """The steps this process has completed: the next heartbeat carries it
        (the scheduler names the step when this process fails or stalls)."""
        self._step = step

    def beat_now(self, waiting: tuple[Label, float] | None = None) -> None:
        """One heartbeat from the calling thread, with the step reported so far
        (a failing process tells its step before it reports the failure) and
        `waiting`, the peer its step waited on when it failed, for how long."""
        self._client.heartbeat(self._label, self._step, timeout_s=max(self._interval_s * 4, 2.0),
                               waiting=waiting)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self._interval_s + CALL_TIMEOUT_S)

    def scheduler_unreachable(self) -> str | None:
        """Why the scheduler has not answered the latest heartbeats (since
        when), or None while it answers: a peer's failure seen meanwhile is
        likely the scheduler's loss reaching that peer first."""
        failing = self._failing
        if failing is None:
            return None
        since, error = failing
        return f"lost the scheduler for {time.monotonic() - since:.1f} s: {error}"

    def _run(self) -> None:
        last_ok = time.monotonic()
        finished_told = False
        while not self._stop.wait(self._interval_s):
            try:
                status = self._client.heartbeat(self._label, self._step,
                                                timeout_s=max(self._interval_s * 4, 2.0),
                                                waiting=self._waiting())
            except ClusterError as exc:
                silent = time.monotonic() - last_ok
                self._failing = (last_ok, exc)
                if silent > self._lost_after_s:
                    self._on_failed(f"lost the scheduler for {silent:.1f} s: {exc}")
                    return
                continue
            self._failing = None
            last_ok = time.monotonic()
            if status.state == pb.JobStatus.FAILED:
                self._on_failed(status.reason)
                return
            if status.state == pb.JobStatus.FINISHED and not finished_told:
                finished_told = True
                self._on_finished(status.num_steps)
