"""The scheduler: cluster membership for one job.

Registration and rank assignment per role, the address table, the plan
fingerprint every process must agree on, a small key-value store, barriers,
heartbeats and failure detection (a process silent past its deadline, or one
that reports a failure, fails the job and every process learns which one and
why), and orderly shutdown once every process is done. It holds no graph nodes.

It runs inside `splitrun launch` or alone (`splitrun scheduler`), on gRPC.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc

from splitrun.splitter.errors import LabelError
from splitrun.splitter.labels import Label, Role

from ..errors import ClusterError
from ..rpc.auth import TokenInterceptor, one_line
from ..rpc.service import TOKEN_METADATA_KEY
from ..rpc.tls import TlsFiles
from ..rpc.wire import splitrun_pb2 as pb
from ..rpc.wire import splitrun_pb2_grpc as pb_grpc
from ..transport.shm.job_files import new_job_prefix, remove_job_segments
from .process_memory import mib

__all__ = ["SchedulerSettings", "Scheduler", "SHM_PREFIX_KEY", "TOKEN_METADATA_KEY"]

# A process's step while it is still setting up (capturing its model, loading a
# checkpoint): no peer can be stalled by it yet, since it has no step to stall in.
SETTING_UP = -1

logger = logging.getLogger(__name__)

# How often the monitor looks for silent processes.
_MONITOR_PERIOD_S = 0.2
# A silent process whose last peak RSS was this share of its memory cgroup's
# limit or more is named as likely OOM-killed.
NEAR_MEMORY_LIMIT = 0.8
_TOKEN_HINT = ("processes of this job get the token from SPLITRUN_TOKEN (set by splitrun "
               "launch; for splitrun join, from the file splitrun scheduler wrote)")
# Upper bound on any single blocking call a client may ask for.
_MAX_WAIT_S = 3600.0
# At registration the scheduler dials the address a process advertises; a
# connection not made within this long means peers cannot reach it either.
DIAL_BACK_TIMEOUT_S = 10.0
# The key-value entry holding the job's shared-memory prefix, for processes no
# launcher gave one (`splitrun join`): same-host peers share memory under it.
SHM_PREFIX_KEY = "splitrun/shm-prefix"


@dataclass(frozen=True)
class SchedulerSettings:
    num_workers: int
    num_servers: int
    token: str
    incarnation: int
    # Each process sends a heartbeat this often...
    heartbeat_interval_s: float = 0.5
    # ...and is declared lost when none came for this long.
    heartbeat_timeout_s: float = 3.0
    # A process whose step has not advanced for this long while a peer has
    # waited on it inside a step for as long (and it waits on no one) is
    # stalled: a busy loop or a deadlock with its heartbeat thread alive.
    stall_timeout_s: float = 20.0
    # At registration the scheduler connects to the address each process
    # advertises, within this long, and refuses an address it cannot reach
    # (None: it does not check; for tests that register made-up addresses).
    dial_back_timeout_s: float | None = DIAL_BACK_TIMEOUT_S
    # The job's shared-memory prefix for processes no launcher gave one; files
    # under it on the scheduler's host are removed when it stops.
    shm_prefix: str = field(default_factory=new_job_prefix)

    @property
    def num_processes(self) -> int:
        return self.num_workers + self.num_servers


@dataclass
class _Member:
    label: Label
    address: str
    host: str
    pid: int
    last_seen: float
    step: int = SETTING_UP      # steps completed, or SETTING_UP before the first one
    step_since: float = 0.0     # when `step` last changed (time.monotonic())
    waiting_on: str = ""        # the peer it waits on inside a step, "" for none
    waiting_s: float = 0.0      # ...for this long, as of `last_seen`
    finished_steps: int | None = None
    done: bool = False
    # Its memory as its last heartbeat said (bytes; 0: not known, no limit).
    rss_bytes: int = 0
    peak_rss_bytes: int = 0
    memory_limit_bytes: int = 0


@dataclass
class _State:
    members: dict[Label, _Member] = field(default_factory=dict)
    plan: tuple[str, Label, str] | None = None  # fingerprint, first submitter, summary
    status: int = pb.JobStatus.RUNNING
    reason: str = ""
    failed_label: str = ""
    num_steps: int = 0
    kv: dict[str, bytes] = field(default_factory=dict)
    barriers: dict[str, set[Label]] = field(default_factory=dict)
    failed_at: float = 0.0      # time.monotonic() of the failure


class Scheduler(pb_grpc.SchedulerServicer):
    """One job's membership service. `start()` binds; `wait_done()` returns
    when every process reported done or the job failed."""

    def __init__(self, settings: SchedulerSettings) -> None:
        self.settings = settings
        self._state = _State()
        self._state.kv[SHM_PREFIX_KEY] = settings.shm_prefix.encode()
        self._cond = threading.Condition()
        self._server: grpc.Server | None = None
        self._stopped = threading.Event()
        self._monitor: threading.Thread | None = None
        self.address = ""

    # -- lifecycle --

    def start(self, host: str = "127.0.0.1", port: int = 0, tls: TlsFiles | None = None) -> str:
        """Listen on host:port (0: a free port), with TLS when `tls` is given."""
        # Blocking calls (WaitForPeers, KvGet, Barrier) hold a thread each.
        workers = 8 + 3 * self.settings.num_processes
        # The token is checked before any handler runs (TokenInterceptor): a
        # caller without it never holds one of these threads.
        auth = TokenInterceptor(self.settings.token, "scheduler", _TOKEN_HINT)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers,
                                                              thread_name_prefix="scheduler"),
                                   interceptors=(auth,))
        pb_grpc.add_SchedulerServicer_to_server(self, self._server)
        try:
            if tls is None:
                bound = self._server.add_insecure_port(f"{host}:{port}")
            else:
                bound = self._server.add_secure_port(f"{host}:{port}", tls.server_credentials())
        except RuntimeError:  # grpcio raises where older versions returned 0
            bound = 0
        if bound == 0:
            raise ClusterError(f"the scheduler cannot listen on {host}:{port}; is the port "
                               f"taken? (port 0 picks a free one)")
        self._server.start()
        self.address = f"{host}:{bound}"
        self._monitor = threading.Thread(target=self._watch_heartbeats, daemon=True,
                                         name="scheduler-monitor")
        self._monitor.start()
        workers, servers = self.settings.num_workers, self.settings.num_servers
        logger.info("scheduler listening on %s for %d worker%s and %d server%s", self.address,
                    workers, "" if workers == 1 else "s", servers, "" if servers == 1 else "s")
        return self.address

    def stop(self, grace_s: float = 1.0) -> None:
        self._stopped.set()
        with self._cond:
            self._cond.notify_all()
        if self._server is not None:
            self._server.stop(grace_s).wait(grace_s + 1.0)
        # What joined processes on this host left (a SIGKILLed one's marker).
        remove_job_segments(self.settings.shm_prefix)

    def wait_done(self, timeout_s: float | None = None) -> bool:
        """True once every process is done or the job failed."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while not self._all_done() and self._state.status != pb.JobStatus.FAILED:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining if remaining is not None else 1.0)
            return True

    @property
    def failure(self) -> tuple[str, str] | None:
        """(failed label, reason) once the job failed, else None."""
        with self._cond:
            if self._state.status == pb.JobStatus.FAILED:
                return self._state.failed_label, self._state.reason
            return None

    def fail(self, label: str, reason: str) -> None:
        """Fail the job from outside (the launcher saw a process exit)."""
        with self._cond:
            self._fail(label, reason)

    def wait_failure_told(self, timeout_s: float) -> bool:
        """After a failure: True once every other live process has sent a
        heartbeat since (its reply told it the job failed), False after
        `timeout_s`. A scheduler hosted by a process that is about to exit
        waits here, so its peers hear why instead of finding it gone."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                state = self._state
                untold = [m for m in state.members.values()
                          if str(m.label) != state.failed_label and not m.done
                          and m.last_seen < state.failed_at]
                remaining = deadline - time.monotonic()
                if not untold or remaining <= 0:
                    return not untold
                self._cond.wait(min(remaining, _MONITOR_PERIOD_S))

    def member_step(self, label: Label) -> int | None:
        with self._cond:
            member = self._state.members.get(label)
            return None if member is None or member.step == SETTING_UP else member.step

    # -- helpers (call with the lock held) --

    def _all_done(self) -> bool:
        members = self._state.members
        return (len(members) == self.settings.num_processes
                and all(m.done for m in members.values()))

    def _fail(self, label: str, reason: str) -> None:
        if self._state.status == pb.JobStatus.FAILED:
            return
        self._state.status = pb.JobStatus.FAILED
        self._state.failed_at = time.monotonic()
        self._state.reason = reason
        self._state.failed_label = label
        logger.debug("job failed: %s", reason)  # the launcher (or `splitrun scheduler`) says it
        self._cond.notify_all()

    def _status(self) -> pb.JobStatus:
        s = self._state
        return pb.JobStatus(state=s.status, reason=s.reason, failed_label=s.failed_label,
                            num_steps=s.num_steps)

    def _label(self, text: str, context: grpc.ServicerContext) -> Label:
        try:
            label = Label.parse(text)
        except Exception as exc:  # noqa: BLE001 - reported to the caller
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"bad label {one_line(repr(text), 40)}: {one_line(str(exc), 200)}")
        with self._cond:
            if label not in self._state.members:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"{label.describe()} is not registered with this job")
        return label

    @staticmethod
    def _wait_s(requested: float) -> float:
        return min(max(requested, 0.0), _MAX_WAIT_S)

    # -- RPCs --

    def Register(self, request, context):
        # Everything about the request is checked before anything happens: a
        # surplus or mistyped join is refused with a status of its own, and
        # the job it tried to join goes on untouched.
        with self._cond:
            role, rank = self._admit(request, context)
        timeout_s = self.settings.dial_back_timeout_s
        unreachable = None if timeout_s is None else dial_back(request.address, timeout_s)
        if unreachable is not None:  # refuses this caller only
            who = f"{role.value} {rank}" if rank is not None else role.value
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"{who} (pid {request.pid} on {one_line(request.host, 80)}) advertises "
                          f"{one_line(request.address, 80)}, but the scheduler cannot connect "
                          f"to it ({unreachable}); its peers could not either. Pass "
                          f"--advertise with an address of that machine the others can reach "
                          f"(or bind --host 0.0.0.0 without --advertise)")
        with self._cond:
            role, rank = self._admit(request, context)  # again: another may have come meanwhile
            label = Label(rank, role)
            now = time.monotonic()
            self._state.members[label] = _Member(label, request.address, request.host,
                                                 request.pid, now, step_since=now)
            self._cond.notify_all()
        logger.info("registered %s at %s (pid %d on %s)", label.describe(), request.address,
                    request.pid, request.host)
        return pb.RegisterReply(rank=rank, incarnation=self.settings.incarnation,
                                num_workers=self.settings.num_workers,
                                num_servers=self.settings.num_servers,
                                heartbeat_interval_s=self.settings.heartbeat_interval_s)

    def _admit(self, request, context) -> tuple[Role, int]:
        """The role and rank a Register may take (call with the lock held), or
        an abort saying why not and what to do instead."""
        try:
            role = Role.parse(request.role)
        except Exception:  # noqa: BLE001 - refused below, with the roles that exist
            role = None
        if role not in (Role.WORKER, Role.SERVER):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"a process cannot register as {one_line(repr(request.role), 40)}: "
                          f"it joins as a worker or a server (the scheduler is this service); "
                          f"pass --role worker or --role server")
        state = self._state
        if state.status == pb.JobStatus.FAILED:  # ABORTED: the caller stops as a consequence
            context.abort(grpc.StatusCode.ABORTED, state.reason)
        if state.status == pb.JobStatus.FINISHED:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"the job already finished after {state.num_steps} steps; start a "
                          f"new scheduler for a new job")
        size = {Role.WORKER: self.settings.num_workers,
                Role.SERVER: self.settings.num_servers}[role]
        name = role.value
        if size == 0:
            other = "server" if role is Role.WORKER else "worker"
            asked = f" rank {request.rank}" if request.rank != -1 else ""
            context.abort(grpc.StatusCode.OUT_OF_RANGE,
                          f"{name}{asked} cannot join: this job has no {name}s; join as a "
                          f"{other} (--role {other}), or start a job with --{name}s N")
        has = f"this job has {size} {name}{'s' if size > 1 else ''} (ranks 0 to {size - 1})"
        taken = {m.label.rank: m for m in state.members.values() if m.label.role is role}
        free = [r for r in range(size) if r not in taken]
        if request.rank < -1 or request.rank >= size:
            context.abort(grpc.StatusCode.OUT_OF_RANGE,
                          f"{name} rank {request.rank} is out of range: {has}; ask for "
                          f"--rank 0 to {size - 1}, or for none (the next free one)")
        if request.rank == -1 and not free or request.rank in taken:
            rank = request.rank if request.rank >= 0 else None
            if rank is not None:
                other = taken[rank]
                what = (f"{name} {rank} is already registered (pid {other.pid} on "
                        f"{one_line(other.host, 80)})")
            else:
                what = f"every {name} rank is taken: {has}, all registered"
            fix = (f"ask for a free one (--rank {free[0]}) or for none" if free else
                   "this process is one too many; to run more, start a job with more "
                   f"{name}s (--{name}s N)")
            context.abort(grpc.StatusCode.ALREADY_EXISTS, f"{what}; {fix}")
        return role, (request.rank if request.rank >= 0 else free[0])

    def WaitForPeers(self, request, context):
        deadline = time.monotonic() + self._wait_s(request.timeout_s)
        with self._cond:
            while len(self._state.members) < self.settings.num_processes:
                if self._state.status == pb.JobStatus.FAILED:
                    context.abort(grpc.StatusCode.ABORTED, self._state.reason)
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._stopped.is_set():
                    registered = set(self._state.members)
                    missing = [str(label) for label in self._expected_labels()
                               if label not in registered]
                    context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                  f"still waiting for {', '.join(missing)} to register after "
                                  f"{request.timeout_s:g} s; did they start, and with this "
                                  f"scheduler's address and token?")
                self._cond.wait(remaining)
            peers = [pb.Peer(label=str(m.label), address=m.address, host=m.host, pid=m.pid)
                     for m in sorted(self._state.members.values(),
                                     key=lambda m: m.label.sort_key())]
        return pb.PeerTable(peers=peers)

    def _expected_labels(self) -> list[Label]:
        return ([Label.worker(r) for r in range(self.settings.num_workers)]
                + [Label.server(r) for r in range(self.settings.num_servers)])

    def SubmitPlan(self, request, context):
        label = self._label(request.label, context)
        with self._cond:
            if self._state.plan is None:
                self._state.plan = (request.fingerprint, label, request.summary)
            elif self._state.plan[0] != request.fingerprint:
                first_fp, first, summary = self._state.plan
                reason = (f"plan mismatch: {label.describe()} computed plan "
                          f"{request.fingerprint} ({request.summary}) but {first.describe()} "
                          f"computed {first_fp} ({summary}); every process must run the same "
                          f"script with the same model, arguments and cluster size")
                self._fail(str(label), reason)
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, reason)
        return pb.SubmitPlanReply()

    def Heartbeat(self, request, context):
        label = self._label(request.label, context)
        with self._cond:
            member = self._state.members[label]
            member.last_seen = time.monotonic()
            if request.step != member.step or not member.step_since:
                member.step, member.step_since = request.step, member.last_seen
            member.waiting_on, member.waiting_s = request.waiting_on, request.waiting_s
            member.rss_bytes, member.peak_rss_bytes = request.rss_bytes, request.peak_rss_bytes
            member.memory_limit_bytes = request.memory_limit_bytes
            return self._status()

    def ReportFailure(self, request, context):
        label = self._label(request.label, context)
        with self._cond:
            member = self._state.members[label]
            stalled = self._stalled_peer_of(member, time.monotonic())
            if stalled is not None:  # its receive timed out on a peer known to be stalled
                self._fail(str(stalled.label), self._stall_verdict(
                    stalled, member, member.waiting_s, time.monotonic(),
                    f" (its receive timed out: {one_line(request.message, 200)})"))
            elif (dead := self._dead_near_its_cap(request.dead_peer)) is not None:
                # Killed near its memory cap: it leaves no words, its peers' are a symptom.
                seen = one_line(request.message, 200)
                self._fail(str(dead.label), f"{dead.label.describe()} (pid {dead.pid} on "
                                            f"{dead.host}) died ({_at_step(dead.step, 'last')}; "
                                            f"{label.describe()} saw: {seen})"
                                            f"{_memory_said(dead)}")
            else:
                self._fail(str(label), f"{label.describe()} failed {_at_step(member.step)}: "
                                       f"{one_line(request.message)}")
            return self._status()

    def _dead_near_its_cap(self, dead_peer: str) -> _Member | None:
        """The member a failure report says died, if its last heartbeat was
        near its memory cgroup's limit."""
        if not dead_peer:
            return None
        try:
            dead = self._state.members.get(Label.parse(dead_peer))
        except LabelError:
            return None
        return dead if dead is not None and _near_memory_limit(dead) else None

    def ReportFinished(self, request, context):
        label = self._label(request.label, context)
        with self._cond:
            members = self._state.members
            members[label].finished_steps = request.num_steps
            workers = [m for m in members.values() if m.label.role is Role.WORKER]
            counts = {m.finished_steps for m in workers}
            if (len(workers) == self.settings.num_workers and None not in counts
                    and self._state.status == pb.JobStatus.RUNNING):
                if len(counts) > 1:
                    detail = ", ".join(f"{m.label.describe()} {m.finished_steps}"
                                       for m in sorted(workers, key=lambda m: m.label.sort_key()))
                    self._fail(str(label), f"workers ran different numbers of steps ({detail}); "
                                           f"every worker must run the same number of steps")
                else:
                    self._state.status = pb.JobStatus.FINISHED
                    self._state.num_steps = counts.pop()
                    logger.info("workers finished after %d steps", self._state.num_steps)
                    self._cond.notify_all()
            return self._status()

    def ReportDone(self, request, context):
        label = self._label(request.label, context)
        with self._cond:
            self._state.members[label].done = True
            self._cond.notify_all()
        return pb.DoneReply()

    def KvPut(self, request, context):
        with self._cond:
            self._state.kv[request.key] = request.value
            self._cond.notify_all()
        return pb.KvPutReply()

    def KvGet(self, request, context):
        deadline = time.monotonic() + self._wait_s(request.timeout_s)
        with self._cond:
            while request.key not in self._state.kv:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._stopped.is_set():
                    context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                  f"key {request.key!r} not set within {request.timeout_s:g} s")
                self._cond.wait(remaining)
            return pb.KvGetReply(value=self._state.kv[request.key])

    def Barrier(self, request, context):
        label = self._label(request.label, context)
        deadline = time.monotonic() + self._wait_s(request.timeout_s)
        with self._cond:
            arrived = self._state.barriers.setdefault(request.name, set())
            arrived.add(label)
            self._cond.notify_all()
            while len(arrived) < self.settings.num_processes:
                if self._state.status == pb.JobStatus.FAILED:
                    context.abort(grpc.StatusCode.ABORTED, self._state.reason)
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._stopped.is_set():
                    missing = [str(label) for label in self._expected_labels()
                               if label not in arrived]
                    context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                  f"barrier {request.name!r}: {', '.join(missing)} did not "
                                  f"arrive within {request.timeout_s:g} s")
                self._cond.wait(remaining)
        return pb.BarrierReply()

    # -- failure detection --

    def _watch_heartbeats(self) -> None:
        timeout = self.settings.heartbeat_timeout_s
        while not self._stopped.wait(_MONITOR_PERIOD_S):
            now = time.monotonic()
            with self._cond:
                if self._state.status == pb.JobStatus.FAILED:
                    continue
                for member in self._state.members.values():
                    silent = now - member.last_seen
                    if not member.done and silent > timeout:
                        self._fail(str(member.label),
                                   f"{member.label.describe()} (pid {member.pid} on "
                                   f"{member.host}) sent no heartbeat for {silent:.1f} s "
                                   f"({_at_step(member.step, 'last')}); it died or hangs"
                                   f"{_memory_said(member)}")
                        break
                else:
                    self._find_stalled(now)

    def _find_stalled(self, now: float) -> None:
        """Fail the job naming a process that is alive (heartbeats come) but
        stalled: its step has not advanced for `stall_timeout_s`, it waits on
        no peer, and a peer has waited on it inside a step that long."""
        limit = self.settings.stall_timeout_s
        members = self._state.members
        for member in members.values():
            if member.done or member.waiting_on or member.step == SETTING_UP or \
                    now - member.step_since <= limit:
                continue
            name = str(member.label)
            waiters = [(p, p.waiting_s + now - p.last_seen) for p in members.values()
                       if p.waiting_on == name]
            waiters = [(p, waited) for p, waited in waiters if waited > limit]
            if not waiters:
                continue
            peer, waited = max(waiters, key=lambda w: w[1])
            self._fail(name, self._stall_verdict(member, peer, waited, now))
            return

    def _stalled_peer_of(self, waiter: _Member, now: float) -> _Member | None:
        """The peer `waiter` waited on when it failed, if the scheduler knows
        that peer stalled: alive (heartbeats come), waiting on no one, its step
        not advanced for the stall timeout while `waiter` waited as long. The
        bound allows for the heartbeats' delay: a receive timeout equal to the
        stall timeout ends the wait when the stall is due, not after."""
        if not waiter.waiting_on:
            return None
        peer = next((m for m in self._state.members.values()
                     if str(m.label) == waiter.waiting_on), None)
        limit = (self.settings.stall_timeout_s - self.settings.heartbeat_interval_s
                 - _MONITOR_PERIOD_S)
        if peer is None or peer.done or peer.waiting_on or peer.step == SETTING_UP:
            return None
        if now - peer.last_seen > self.settings.heartbeat_timeout_s:
            return None  # not known alive: the heartbeat monitor names it
        if now - peer.step_since < limit or waiter.waiting_s < limit:
            return None
        return peer

    @staticmethod
    def _stall_verdict(member: _Member, waiter: _Member, waited: float, now: float,
                       note: str = "") -> str:
        return (f"{member.label.describe()} (pid {member.pid} on {member.host}) is stalled at "
                f"step {member.step}: alive, but its step has not advanced for "
                f"{now - member.step_since:.1f} s while {waiter.label.describe()} has waited "
                f"on it for {waited:.1f} s{note}; is it stuck in a loop or waiting on "
                f"something else?")


def _at_step(step: int, qualifier: str = "") -> str:
    if step == SETTING_UP:
        return "before its first step"
    return f"{qualifier} at step {step}".strip()


def dial_back(address: str, timeout_s: float) -> str | None:
    """Why a TCP connection to `address` (HOST:PORT, the host maybe in
    brackets) fails within `timeout_s`, or None when it succeeds. Only the
    connection is made (no TLS, no call): it proves the address is reachable."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return None
    except ValueError:
        return f"{address!r} is not HOST:PORT"
    except TimeoutError:
        return f"no answer within {timeout_s:g} s"
    except OSError as exc:
        return exc.strerror or str(exc)


def _memory_said(member: _Member) -> str:
    """What the silent process's last heartbeat said of its memory. A process
    killed by the OOM killer (its cgroup's or the machine's) leaves no words
    of its own, and its cgroup can be read only on its host: a peak near its
    cgroup's limit is named as the likely cause."""
    if not member.rss_bytes:
        return ""
    said = (f"; its last heartbeat said RSS {mib(member.rss_bytes)} (peak "
            f"{mib(member.peak_rss_bytes)})")
    if not member.memory_limit_bytes:
        return said
    said += f" of its memory cgroup's limit {mib(member.memory_limit_bytes)}"
    if _near_memory_limit(member):
        said += (f": likely killed by the OOM killer (its cgroup's memory.events on "
                 f"{member.host} counts it); give it more memory, or spread the state over "
                 f"more servers")
    return said


def _near_memory_limit(member: _Member) -> bool:
    limit = member.memory_limit_bytes
    return bool(limit) and max(member.rss_bytes, member.peak_rss_bytes) >= NEAR_MEMORY_LIMIT * limit
