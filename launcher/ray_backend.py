"""`splitrun launch --backend ray`: the job's processes as Ray actors.

One placement group holds a bundle per process (that role's resources); one
actor per (role, rank) sits in its bundle and runs the user's script as a
child process of its own (`ray_process.ProcessHost`), with the same
environment contract as the local launcher. The scheduler stays in this
process, the driver, as under `splitrun launch`. The driver relays each
process's output with its prefix ("[worker 1] ..."), and the first failure
(a script exiting with an error, a dead actor, the scheduler's report) stops
the others; the job exits non-zero naming the process. Every actor and the
placement group are removed when the job ends, however it ends. With
--log-dir the driver also writes each process's lines to a file of its own
(worker0.log, ...) and its console output to launcher.log, as `splitrun
launch` does: on the driver's machine, whichever node ran the process.

Ray is imported here only, when this backend runs: `pip install splitrun[ray]`.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import secrets
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from splitrun.runtime.cluster.env import ENV
from splitrun.runtime.cluster.scheduler import Scheduler, SchedulerSettings
from splitrun.runtime.rpc.tls import TlsFiles
from splitrun.runtime.transport.shm.job_files import new_job_prefix, remove_job_segments
from splitrun.splitter.labels import Label, Role

from .backend import watch
from .child_env import THREAD_VARIABLES
from .failures import (
    TERMINATE_GRACE_S,
    ErrorLine,
    FailureKind,
    FailureSign,
    Outcome,
    count_of,
    culprit_of,
    describe_exit,
    error_kind,
    failure_line,
    shell_code,
)
from .process_logs import Console, ProcessLogs
from .ray_cluster import RayBackendError, check_fits, connect, first_line
from .ray_process import Placement, Polled, ProcessHost

__all__ = ["launch_on_ray", "parse_resources", "DEFAULT_RESOURCES"]

logger = logging.getLogger(__name__)

# Each role's Ray resources unless --worker-resources / --server-resources say.
DEFAULT_RESOURCES = {"CPU": 1.0}
# The placement group must be placed, and every actor started, within this long.
PLACEMENT_TIMEOUT_S = 120.0
ACTOR_START_TIMEOUT_S = 120.0
# One poll of an actor waits this long for output before answering.
_POLL_WAIT_S = 0.5
# How long the driver's loop waits for any actor's answer per turn.
_TURN_S = 0.05
_WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "[::]"})

# The environment a process of the job gets: (scheduler address, label, shared-memory
# prefix) -> variables, as `splitrun launch` would give its child.
ProcessEnv = Callable[[str, Label, str], dict[str, str]]


def parse_resources(text: str | None, option: str) -> dict[str, float]:
    """A role's Ray resources from JSON: {"CPU": 2, "GPU": 1, "memory": 2e9,
    "my_resource": 1}; "memory" in bytes, the rest in units."""
    if text is None:
        return dict(DEFAULT_RESOURCES)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RayBackendError(f"{option} {text!r} is not JSON ({exc.msg}); expected an "
                              f"object such as '{{\"CPU\": 1, \"GPU\": 1}}'") from None
    if not isinstance(value, dict) or not value:
        raise RayBackendError(f"{option} {text!r}: expected a non-empty JSON object of "
                              f"resource amounts such as '{{\"CPU\": 1, \"GPU\": 1}}'")
    bad = {k: v for k, v in value.items()
           if isinstance(v, bool) or not isinstance(v, int | float) or v <= 0}
    if bad:
        raise RayBackendError(f"{option}: every amount must be a number > 0; got "
                              f"{json.dumps(bad)}")
    return {str(k): float(v) for k, v in value.items()}


def _actor_options(resources: dict[str, float]) -> dict:
    custom = {k: v for k, v in resources.items() if k not in ("CPU", "GPU", "memory")}
    options = {"num_cpus": resources.get("CPU", 0.0), "num_gpus": resources.get("GPU", 0.0),
               "resources": custom}
    if "memory" in resources:
        options["memory"] = int(resources["memory"])  # bytes
    return options


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


@dataclass
class _Member:
    """One process of the job: its actor, where it runs, what it said."""

    label: Label
    actor: object
    node_ip: str
    is_driver_node: bool             # on the launcher's node (its /dev/shm)
    placement: Placement | None = None
    poll: object | None = None       # the outstanding poll's ObjectRef
    exit_code: int | None = None
    is_dead: bool = False            # the actor died (or stopped answering)
    death: str | None = None         # Ray's word on how it died
    is_stopped: bool = False
    error: str | None = None         # the last error line it printed
    errors: ErrorLine = field(default_factory=ErrorLine)

    def describe(self) -> str:
        where = ""
        if self.placement is not None:
            where = f" (pid {self.placement.pid} on {self.placement.host} {self.node_ip})"
        return f"{self.label.describe()}{where}"

    @property
    def is_running(self) -> bool:
        return self.exit_code is None and not self.is_dead

    def feed(self, line: str) -> None:
        self.errors.feed(line)
        self.error = self.errors.line


def _import_ray():
    try:
        import ray
    except ImportError:
        raise RayBackendError("--backend ray needs Ray: pip install 'splitrun[ray]'") from None
    return ray


def launch_on_ray(args, tls: TlsFiles | None, token: str, process_env: ProcessEnv) -> int:
    """Run the job of `args` (splitrun launch's options) on a Ray cluster;
    returns the launcher's exit code."""
    try:
        worker_resources = parse_resources(args.worker_resources, "--worker-resources")
        server_resources = parse_resources(args.server_resources, "--server-resources")
        ray = _import_ray()
    except RayBackendError as exc:
        print(f"splitrun: {exc}", file=sys.stderr)
        return 2
    if args.max_restarts or args.checkpoint_every is not None:
        print("splitrun: --max-restarts and --checkpoint-every are not supported with "
              "--backend ray: a restart from the newest checkpoint needs the checkpoints where "
              "this driver and every Ray node can read them (a shared file system), and the "
              "Ray backend has no restart loop yet. Use the local backend on one machine "
              "(splitrun launch --max-restarts N --checkpoint-every K), or rerun the Ray job "
              "when it fails (it starts from step 0)", file=sys.stderr)
        return 2
    logs = ProcessLogs(args.log_dir) if args.log_dir is not None else None
    console = Console(logs, logging.getLevelName(args.log_level) <= logging.INFO)
    resources = {Role.WORKER: worker_resources, Role.SERVER: server_resources}
    bundles = ([worker_resources] * args.workers) + ([server_resources] * args.servers)
    existing = args.address or os.environ.get("RAY_ADDRESS")
    console.note(f"connecting to Ray ({existing or 'a new local cluster, sized to the job'})")
    started = time.monotonic()
    interrupted: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: interrupted.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with connect(ray, args.address, bundles,
                     logging.DEBUG if args.log_level == "DEBUG" else logging.WARNING):
            job = _RayJob(ray, args, tls, token, process_env, interrupted, resources, console)
            code = job.run(started)
    except RayBackendError as exc:
        console.say(str(exc))
        code = 1
    finally:
        console.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code


class _RayJob:
    """One run of the job on Ray: placement group, scheduler, actors; `run`
    supervises them and removes them all when the job ends. The Ray `Backend`."""

    def __init__(self, ray, args, tls, token, process_env: ProcessEnv,
                 interrupted: list[int], resources: dict[Role, dict[str, float]],
                 console: Console) -> None:
        self.ray = ray
        self.console = console
        self.args = args
        self.tls = tls
        self.token = token
        self.process_env = process_env
        self.interrupted = interrupted
        self.resources = resources
        self.labels = ([Label(r, Role.WORKER) for r in range(args.workers)]
                       + [Label(r, Role.SERVER) for r in range(args.servers)])
        self.members: list[_Member] = []
        self.scheduler: Scheduler | None = None
        # The placement group's name; its actors are named NAME-w0, NAME-s1, ...
        self.name = f"splitrun-{os.getpid()}-{secrets.token_hex(3)}"

    def run(self, started: float) -> int:
        from ray.util.placement_group import placement_group, remove_placement_group

        bundles = [self.resources[label.role] for label in self.labels]
        check_fits([node["Resources"] for node in self.ray.nodes() if node["Alive"]],
                   self.resources, {Role.WORKER: self.args.workers,
                                    Role.SERVER: self.args.servers})
        group = placement_group(bundles, strategy="PACK", name=self.name)
        scheduler = None
        shm_prefix = new_job_prefix()
        try:
            nodes = self._place(group, bundles)
            logger.info("same-host peers share memory under /dev/shm/%s*", shm_prefix)
            scheduler = Scheduler(SchedulerSettings(
                self.args.workers, self.args.servers, self.token,
                time.time_ns() & ((1 << 62) - 1),  # the incarnation, as launch's
                heartbeat_timeout_s=self.args.heartbeat_timeout,
                stall_timeout_s=self.args.stall_timeout))
            address = self._scheduler_address(scheduler.start(self.args.host, 0, self.tls))
            self.console.note(
                 f"scheduler at {address}; starting {count_of(self.args.workers, 'worker')} "
                 f"and {count_of(self.args.servers, 'server')} running {self.args.script} as "
                 f"Ray actors "
                 f"(placement group {self.name}, "
                 f"{time.monotonic() - started:.1f} s after start)")
            self._start_actors(group, nodes, address, shm_prefix)
            self.console.note(f"every actor started {time.monotonic() - started:.1f} s after start")
            self.scheduler = scheduler
            outcome = watch(self, len(self.members), lambda: scheduler.failure,
                            lambda: (signal.Signals(self.interrupted[0]) if self.interrupted
                                     else None))
            self.say(outcome.summary)
            logger.debug("job over %.1f s after start", time.monotonic() - started)
            return outcome.exit_code
        finally:
            cleanup = time.monotonic()
            self._remove_actors()
            remove_placement_group(group)
            if scheduler is not None:
                scheduler.stop()
            remove_job_segments(shm_prefix)
            logger.info("removed %d actors and the placement group in %.1f s",
                        len(self.members), time.monotonic() - cleanup)

    def _place(self, group, bundles) -> list[str]:
        """Wait for the placement group; the node id of each bundle."""
        from ray.util.placement_group import placement_group_table

        deadline = time.monotonic() + PLACEMENT_TIMEOUT_S
        ready: list = []
        while not ready and time.monotonic() < deadline:
            if self.interrupted:
                raise RayBackendError("interrupted while Ray placed the job")
            ready, _ = self.ray.wait([group.ready()], timeout=_POLL_WAIT_S)
        if not ready:
            raise RayBackendError(
                f"Ray could not place the job within {PLACEMENT_TIMEOUT_S:g} s: it needs "
                f"{json.dumps(bundles)} (one bundle per process, PACK); the cluster has "
                f"{json.dumps(self.ray.available_resources())} free. Start nodes with "
                f"those resources or ask for less (--worker-resources/--server-resources)")
        by_bundle = placement_group_table(group)["bundles_to_node_id"]
        nodes = [by_bundle[index] for index in range(len(bundles))]
        here = self.ray.get_runtime_context().get_node_id()
        if _is_loopback(self.args.host) and any(node != here for node in nodes):
            raise RayBackendError(
                f"Ray placed processes on {len(set(nodes))} nodes but --host is "
                f"{self.args.host}, which other nodes cannot reach; pass --host 0.0.0.0 "
                f"(with --tls-cert/--tls-key/--tls-ca, or --insecure on a network you trust)")
        return nodes

    def _scheduler_address(self, bound: str) -> str:
        """The scheduler's address as the actors dial it: this node's Ray
        address when the scheduler binds every interface."""
        host, _, port = bound.rpartition(":")
        if host in _WILDCARD_HOSTS:
            host = self.ray.util.get_node_ip_address()
        return f"{host}:{port}"

    def _start_actors(self, group, nodes: list[str], address: str, shm_prefix: str) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        node_ips = {node["NodeID"]: node["NodeManagerAddress"] for node in self.ray.nodes()}
        here = self.ray.get_runtime_context().get_node_id()
        remote_host = self.ray.remote(ProcessHost)
        for index, label in enumerate(self.labels):
            strategy = PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=index,
                placement_group_capture_child_tasks=False)
            actor = remote_host.options(
                name=f"{self.name}-{label}", max_concurrency=4, max_restarts=0,
                scheduling_strategy=strategy,
                **_actor_options(self.resources[label.role])).remote(str(label))
            self.members.append(_Member(label, actor, node_ips.get(nodes[index], "?"),
                                        nodes[index] == here))
        cwd = os.getcwd()
        starts = {}
        for member in self.members:
            env = self._contract(address, member.label, shm_prefix)
            starts[member.label] = member.actor.start.remote(
                self.args.script, list(self.args.script_args), env, cwd)
        deadline = time.monotonic() + ACTOR_START_TIMEOUT_S
        for member in self.members:
            try:
                member.placement = self.ray.get(starts[member.label],
                                                timeout=max(0.1, deadline - time.monotonic()))
            except self.ray.exceptions.GetTimeoutError:
                raise RayBackendError(f"the actor of {member.label.describe()} did not start "
                                      f"within {ACTOR_START_TIMEOUT_S:g} s") from None
            except self.ray.exceptions.RayError as exc:
                raise RayBackendError(f"the actor of {member.label.describe()} failed to "
                                      f"start: {first_line(exc)}") from None
            place = member.placement
            self.console.note(f"started {member.label.describe()} (pid {place.pid}, actor pid "
                 f"{place.actor_pid}) on host {place.host} node {member.node_ip}"
                 + (f" CUDA_VISIBLE_DEVICES={place.cuda_visible_devices}"
                    if place.cuda_visible_devices else ""))
            member.poll = member.actor.poll.remote(_POLL_WAIT_S)

    def _contract(self, address: str, label: Label, shm_prefix: str) -> dict[str, str]:
        """The variables a process gets on top of its actor's environment: what
        the local launcher sets (SPLITRUN_*, the thread budget, the ones it
        changes), not the driver's whole environment, which is another node's."""
        full = self.process_env(address, label, shm_prefix)
        env = {k: v for k, v in full.items()
               if k.startswith("SPLITRUN_") or k in THREAD_VARIABLES or os.environ.get(k) != v}
        if self.args.threads_per_process is None and "OMP_NUM_THREADS" not in os.environ:
            # The process's share is its actor's CPUs, not this machine's cores.
            threads = str(max(1, int(self.resources[label.role].get("CPU", 1.0))))
            env.update({ENV.THREADS: threads, "OMP_NUM_THREADS": threads,
                        "MKL_NUM_THREADS": threads})
        if not _is_loopback(self.args.host):
            # Each node's process binds its own interfaces and advertises its
            # address on the route to the scheduler (Job's rule for 0.0.0.0).
            env[ENV.HOST] = "0.0.0.0"
        return env

    def say(self, text: str) -> None:
        self.console.say(text)

    def note(self, text: str) -> None:
        self.console.note(text)

    def relay(self, label: Label, lines) -> None:
        self.console.relay(label, lines)

    def poll(self, now: float) -> tuple[list[FailureSign], int]:
        """The actors' answers within one turn: each relays its lines, and is a
        sign where its process failed."""
        polls = {m.poll: m for m in self.members if m.poll is not None}
        if polls:
            ready, _ = self.ray.wait(list(polls), num_returns=len(polls), timeout=_TURN_S)
        else:
            ready = []
            time.sleep(_TURN_S)
        now = time.monotonic()
        signs = []
        for ref in ready:
            sign = self._take(polls[ref], ref, now)
            if sign is not None:
                logger.debug("failure sign: %s", sign.what)
                signs.append(sign)
        running = sum(1 for m in self.members if m.is_running and not m.is_stopped)
        return signs, running

    def _take(self, member: _Member, ref, now: float) -> FailureSign | None:
        """One poll's answer: relay its lines; a sign if the process failed."""
        member.poll = None
        try:
            polled: Polled = self.ray.get(ref)
        except self.ray.exceptions.RayActorError as exc:
            member.is_dead, member.death = True, f"({type(exc).__name__}: {first_line(exc)})"
            return self._death_sign(member, now)
        self._relay(member, polled.lines)
        if polled.exit_code is None:
            member.poll = member.actor.poll.remote(_POLL_WAIT_S)
            if polled.is_stopped and not member.is_stopped:
                member.is_stopped = True
                return FailureSign(FailureKind.KILLED, now, member.label, 1,
                                   f"{member.describe()} was stopped by a signal", member)
            return None
        member.exit_code = polled.exit_code
        if polled.exit_code == 0:
            return None
        kind = FailureKind.KILLED if polled.exit_code < 0 else error_kind(member.error)
        return FailureSign(kind, now, member.label, shell_code(polled.exit_code),
                           f"{member.describe()} {describe_exit(polled.exit_code)}", member)

    @staticmethod
    def _death_sign(member: _Member, now: float) -> FailureSign:
        return FailureSign(FailureKind.KILLED, now, member.label, 1,
                           f"the Ray actor of {member.describe()} died {member.death}", member)

    def _relay(self, member: _Member, lines) -> None:
        for line in lines:
            member.feed(line)
        self.relay(member.label, lines)

    def blame(self, signs: list[FailureSign]) -> Outcome:
        running = [m for m in self.members if m.is_running]
        # The processes the failure stopped: all but those that finished on their own.
        stopped = [m for m in self.members if m.exit_code != 0]
        stopping = time.monotonic()
        self.stop_all()
        # Stopping reads every process's last lines (its error) too.
        logger.debug("stopped in %.1f s", time.monotonic() - stopping)
        # An actor Ray reported dead only while it was being stopped: its death
        # may have come first (Ray takes a while to tell on a busy machine).
        signed = {sign.label for sign in signs}
        signs = signs + [self._death_sign(m, min(s.seen for s in signs)) for m in running
                         if m.death is not None and m.label not in signed]
        culprit = culprit_of(signs)
        step = (self.scheduler.member_step(culprit.label)
                if culprit.label is not None and self.scheduler is not None else None)
        others = [m for m in stopped if culprit.process is None or m is not culprit.process]
        return Outcome(culprit.exit_code, failure_line(culprit, step, len(others)))

    def stop_all(self) -> None:
        """Stop every script still running (SIGTERM, then SIGKILL after the
        grace period, in its actor) and relay its last lines."""
        stops = {m.label: m.actor.stop.remote(TERMINATE_GRACE_S, not m.is_driver_node)
                 for m in self.members if not m.is_dead and m.placement is not None}
        if stops:  # all at once: an actor Ray has not yet found dead answers no one
            self.ray.wait(list(stops.values()), num_returns=len(stops),
                          timeout=TERMINATE_GRACE_S * 2)
        for member in self.members:
            if member.label not in stops:
                continue
            try:
                self.ray.get(stops[member.label], timeout=0.1)
                while True:  # what it printed last
                    polled = self.ray.get(member.actor.poll.remote(0.0),
                                          timeout=TERMINATE_GRACE_S)
                    self._relay(member, polled.lines)
                    if not polled.lines:
                        break
                if member.exit_code is None:
                    member.exit_code = polled.exit_code
            except self.ray.exceptions.RayActorError as exc:
                member.is_dead = True  # its script died with it (the bootstrap's parent pid)
                member.death = f"({type(exc).__name__}: {first_line(exc)})"
            except self.ray.exceptions.RayError:
                member.is_dead = True  # did not answer: ray.kill ends it and its script
            member.poll = None

    def _remove_actors(self) -> None:
        """End every actor (its script with it) whatever state the job is in."""
        alive = [m for m in self.members if not m.is_dead and m.placement is not None
                 and m.exit_code is None]
        if alive:
            self.stop_all()
        for member in self.members:
            try:
                self.ray.kill(member.actor, no_restart=True)
            except Exception as exc:  # noqa: BLE001 - already gone is fine
                logger.debug("ray.kill of %s: %s", member.label, exc)
