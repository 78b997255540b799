"""The user-facing job API: join the cluster, split, train, finish.

    job = Job.from_env()                      # set up by `splitrun launch` or `join`
    program = capture(model, loss_fn, optimizer, example_batch)
    trainer = job.start(program)              # split, agree on the plan, connect
    for batch in batches:                     # workers run the loop
        trainer.step(batch)
    final_state = trainer.finish()            # servers serve here until the workers finish

Every process runs the same script. A worker's `step` runs its subgraph once;
a server has no loop of its own: `finish()` serves steps until the workers
report that they finished.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from splitrun.splitter.graph_splitter import SplitProgram, split_program
from splitrun.splitter.labels import Cluster, Label, Role
from splitrun.splitter.modes import Mode
from splitrun.splitter.plan import ModeKind, SplitPlan
from splitrun.splitter.program import Program

from . import checkpoint, sharded_checkpoint
from .cluster.hosted import HostedScheduler
from .cluster.membership import Heartbeat, SchedulerClient
from .cluster.rendezvous import SchedulerRendezvous
from .data import shard_batches
from .embedding.store import ShardSnapshot
from .env import ENV, ProcessEnvironment
from .errors import ClusterError, JobFinished, PeerFailed, SplitrunError, TransportError
from .metrics import StepMetrics
from .process import ProcessRuntime
from .progress import Progress
from .transport.contract import ChannelContract, receive_contracts
from .transport.grpc import GrpcTransport
from .transport.grpc.tls import is_loopback
from .transport.protocol import MessageKey
from .transport.shm_transport import ShmTransport, TransportChoice

__all__ = ["Job", "Trainer", "JobSettings", "ENV", "PlanWritten", "report_uncaught"]

logger = logging.getLogger(__name__)

# The job this process joined (Job.from_env), for `report_uncaught`.
_joined: Job | None = None


def report_uncaught(error: BaseException) -> None:
    """The launcher's bootstrap, when the script ends with `error`: tell the
    scheduler (the step this process reached, and the error) before the
    process's slow teardown, so the failure is blamed here and at that step.
    The job is over: its shared-memory files go too (a SIGKILLed peer's among
    them; the process exits without closing its transport)."""
    if _joined is not None:
        _joined.report_failure(error)
        if isinstance(_joined.transport, ShmTransport):
            _joined.transport.remove_job_files()


# Hosts that bind every interface: a peer cannot connect to them.
_WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "[::]"})


def _advertised_host(env: ProcessEnvironment) -> str:
    """The name peers reach this process by: --advertise, else --host, unless
    that binds every interface (0.0.0.0); then this machine's address on the
    route to the scheduler, which peers on the scheduler's network can reach."""
    if env.advertise not in _WILDCARD_HOSTS:
        return env.advertise
    host, _, port = env.scheduler.rpartition(":")
    host = host.strip("[]")
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((host, int(port)))  # picks the route; sends nothing
            address = probe.getsockname()[0]
    except (OSError, ValueError) as exc:
        raise ClusterError(
            f"this process's tensor server binds {env.host}, which peers cannot connect "
            f"to, and no route to the scheduler {env.scheduler} gave an address to "
            f"advertise instead ({exc}); pass --advertise NAME (splitrun join) or "
            f"{ENV.ADVERTISE}") from None
    logger.info("binding %s; advertising %s (this host's address towards the scheduler)",
                env.host, address)
    return f"[{address}]" if ":" in address else address


@dataclass(frozen=True)
class JobSettings:
    # A receive inside a step waits this long for its message.
    recv_timeout_s: float = 120.0
    # A server's first receive of a step waits this long: workers may spend a
    # while between steps (evaluation, checkpoints). Liveness comes from
    # heartbeats meanwhile.
    idle_timeout_s: float = 3600.0
    # Peers must all register within this long.
    register_timeout_s: float = 120.0
    # The scheduler unreachable this long fails this process.
    heartbeat_timeout_s: float = 3.0
    # Flushing sends and the final barrier are bounded by this.
    finish_timeout_s: float = 120.0
    # `splitrun launch --checkpoint-every K`: the workers save the job every K
    # steps into `checkpoint_dir`; a restarted job resumes from `restart_from`.
    checkpoint_every: int | None = None
    checkpoint_dir: str | None = None
    restart_from: str | None = None
    # `splitrun --metrics-dir DIR`: TensorBoard scalars of each step in DIR/<process>/.
    metrics_dir: str | None = None

    @classmethod
    def from_environment(cls, env: ProcessEnvironment) -> JobSettings:
        def given(value: float | None, default: float) -> float:
            return default if value is None else value
        return cls(recv_timeout_s=given(env.recv_timeout_s, cls.recv_timeout_s),
                   idle_timeout_s=given(env.idle_timeout_s, cls.idle_timeout_s),
                   heartbeat_timeout_s=given(env.heartbeat_timeout_s, cls.heartbeat_timeout_s),
                   checkpoint_every=env.checkpoint_every, checkpoint_dir=env.checkpoint_dir,
                   restart_from=env.restart_from, metrics_dir=env.metrics_dir)


class PlanWritten(BaseException):  # noqa: N818 - a signal, named for what happened
    """Not an error: under `splitrun plan`, `Job.start()` wrote the plan and the
    script has nothing more to do. Like `SystemExit` it is not an `Exception`
    (a script's `except Exception` does not catch it); the launcher's bootstrap
    ends the process with status 0 on it."""


def pick_device(text: str, local_rank: int = 0) -> torch.device:
    """The device of a process whose local rank (its index among the job's
    processes on this machine) is `local_rank`. `auto`: CUDA where there is a
    device, else the CPU. CUDA without an index means the GPU of the local
    rank, `cuda:(local_rank % visible devices)`, so the processes on one machine
    spread over its GPUs instead of all sharing `cuda:0`. Under `srun` or
    `torchrun` each process sees every GPU of its node and picks its own this
    way; a launcher that gives each process one GPU (`CUDA_VISIBLE_DEVICES`)
    leaves one to pick."""
    if text in ("", "auto"):
        text = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(text)
    except RuntimeError:
        raise ClusterError(f"{ENV.DEVICE}={text!r} is not a device; use cpu, cuda, "
                           f"cuda:N or auto") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ClusterError(f"{ENV.DEVICE}={text} but this machine has no CUDA device; "
                           f"launch with --device cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
    return device


class Job:
    """This process's membership in a running job."""

    def __init__(self, label: Label, cluster: Cluster, device: torch.device,
                 settings: JobSettings, *, client: SchedulerClient | None = None,
                 transport: GrpcTransport | ShmTransport | None = None, incarnation: int = 0,
                 heartbeat_interval_s: float = 0.5, plan_out: str | None = None,
                 host: str = "127.0.0.1",
                 hosted_scheduler: HostedScheduler | None = None,
                 plan_modules_out: str | None = None) -> None:
        self.label = label
        self.host = host  # the address peers reach this process by
        self.cluster = cluster
        self.device = device
        self.settings = settings
        self.incarnation = incarnation
        self.client = client
        self.transport = transport
        self.plan_out = plan_out
        self.plan_modules_out = plan_modules_out
        self._heartbeat: Heartbeat | None = None
        self._failure_reported = False
        # Task 0 of a Slurm or torchrun job hosts the job's scheduler.
        self._hosted_scheduler = hosted_scheduler
        if client is not None:
            self._heartbeat = Heartbeat(
                client, label, heartbeat_interval_s, settings.heartbeat_timeout_s,
                on_failed=self._job_failed, on_finished=self._workers_finished)
            self._heartbeat.start()

    # -- joining --

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Job:
        """Join the job `splitrun launch` or `splitrun join` started this process in."""
        env = ProcessEnvironment.parse(os.environ if environ is None else environ)
        if env.threads is not None:
            torch.set_num_threads(env.threads)
        settings = JobSettings.from_environment(env)
        device = pick_device(env.device, env.local_rank)
        if env.plan_out is not None:
            return cls(Label.worker(0), env.plan_cluster, device, settings,
                       plan_out=env.plan_out, plan_modules_out=env.plan_modules_out)
        hosted = _host_scheduler(env, settings)
        client = SchedulerClient(env.scheduler, env.token, env.tls)
        # The tensor server starts before registering: its address is part of
        # the registration. Its label is provisional until the scheduler assigns
        # the rank.
        provisional = Label(env.rank or 0, env.role)
        # Shared memory to peers on this host, gRPC to the others (and for control).
        # The prefix is the launcher's, or (`splitrun join`) the scheduler's.
        choice = TransportChoice.parse(env.transport, ENV.TRANSPORT)
        shm_prefix = env.shm_prefix
        if shm_prefix is None and choice is not TransportChoice.GRPC:
            shm_prefix = client.shm_prefix()
            logger.info("same-host peers share memory under /dev/shm/%s* (the scheduler's "
                        "prefix)", shm_prefix)
        transport = ShmTransport(
            GrpcTransport(provisional, token=env.token, incarnation=0, host=env.host, port=0,
                          tls=env.tls),
            prefix=shm_prefix, choice=choice)
        bound = transport.start()
        port = bound.rsplit(":", 1)[1]
        host = _advertised_host(env)
        registration = client.register(env.role, env.rank, f"{host}:{port}")
        transport.set_identity(registration.label, registration.incarnation)
        logger.info("joined as %s of %s (incarnation %d, device %s, %d threads)",
                    registration.label.describe(), registration.cluster,
                    registration.incarnation, device, torch.get_num_threads())
        job = cls(registration.label, registration.cluster, device, settings,
                  client=client, transport=transport, incarnation=registration.incarnation,
                  heartbeat_interval_s=registration.heartbeat_interval_s, host=host,
                  hosted_scheduler=hosted)
        global _joined
        _joined = job
        return job

    @property
    def rank(self) -> int:
        return self.label.rank

    @property
    def role(self) -> Role:
        return self.label.role

    @property
    def is_worker(self) -> bool:
        return self.label.role is Role.WORKER

    @property
    def is_server(self) -> bool:
        return self.label.role is Role.SERVER

    @property
    def is_driver(self) -> bool:
        """Worker 0: shows progress, receives the loss and the gathered state."""
        return self.label == Label.worker(0)

    # -- job state from the heartbeat thread --

    def _job_failed(self, reason: str) -> None:
        # The PeerFailed this raises in the step carries the reason.
        logger.debug("[%s] stopping: %s", self.label.describe(), reason)
        if self.transport is not None:
            self.transport.abort(PeerFailed(f"job failed: {reason}"))

    def _workers_finished(self, num_steps: int) -> None:
        if self.transport is not None:
            self.transport.finish_at(num_steps)

    def scheduler_unreachable(self) -> str | None:
        """Why the scheduler does not answer this process's heartbeats, or None."""
        return None if self._heartbeat is None else self._heartbeat.scheduler_unreachable()

    def report_progress(self, steps_done: int) -> None:
        """Tell the scheduler (with the next heartbeat) how far this process got."""
        if self._heartbeat is not None:
            self._heartbeat.report_step(steps_done)

    # -- running --

    def start(self, program: Program, mode: Mode | None = None, *,
              gather_state: bool = True, num_steps: int | None = None,
              resume: str | os.PathLike | None = None) -> Trainer:
        """Split `program` for this job's cluster, agree on the plan with every
        other process, connect to the peers and return the trainer.

        `gather_state`: at `finish()`, worker 0 receives every process's final
        state. `num_steps` (optional) sizes the progress bar. `resume`: a
        checkpoint written by `Trainer.save` (any number of servers) to start
        from, a file or a sharded directory (each process reads only its own
        part); training continues at its step.
        """
        split = split_program(program, self.cluster, mode)
        split.lint()
        if self.plan_out is not None:
            with open(self.plan_out, "w") as out:
                out.write(split.plan.to_text())
            if self.plan_modules_out is not None:  # names the picture's blocks by module
                _write_module_map(split.program, self.plan_modules_out)
            logger.info("plan written to %s\n%s", self.plan_out, split.plan.summary())
            raise PlanWritten()
        plan = split.plan
        summary = plan.summary().splitlines()[0]
        self.client.submit_plan(self.label, plan.fingerprint, summary)
        peers = self.client.wait_for_peers(self.label, self.settings.register_timeout_s)
        self.transport.set_peers({label: address for label, address in peers.items()
                                  if label != self.label})
        self.transport.register(_control_channels(plan, split.program, self.label))
        state, first_step = program.initial_state, 0
        if self.settings.restart_from is not None:  # a restart: the launcher's checkpoint wins
            resume = self.settings.restart_from
        if resume is not None and os.path.isdir(resume):
            state, first_step = sharded_checkpoint.load_for(program, split, self.label, resume)
            logger.info("[%s] resuming from %s at step %d", self.label.describe(), resume,
                        first_step)
        elif resume is not None:
            state, first_step = checkpoint.load_checkpoint(program, resume)
            logger.info("[%s] resuming from %s at step %d", self.label.describe(), resume,
                        first_step)
        if split.artifacts is not None:  # parallel mode keeps state in pieces
            state = split.artifacts.split_state(state)
        # Parallel mode's torch.distributed groups meet through the scheduler.
        rendezvous = None if self.client is None else SchedulerRendezvous(
            self.client, self.incarnation, self.host, self.settings.register_timeout_s)
        process = ProcessRuntime(split, self.label, self.transport,
                                 incarnation=self.incarnation, device=self.device, state=state,
                                 first_step=first_step,
                                 recv_timeout_s=self.settings.recv_timeout_s,
                                 rendezvous=rendezvous)
        if self._heartbeat is not None:  # the scheduler names a peer this one waits on
            self._heartbeat.watch_waits(lambda: _waiting(process))
        # The plan's messages are let in only now that the process is assembled.
        self.transport.expect(receive_contracts(plan, split.program, self.label))
        logger.info("[%s] plan %s: %s", self.label.describe(), plan.fingerprint, summary)
        return Trainer(self, split, process, gather_state=gather_state, num_steps=num_steps,
                       first_step=first_step, source=program)

    def report_failure(self, error: BaseException) -> None:
        """Tell the scheduler this process failed with `error` (once), after a
        heartbeat with the step it reached. A peer's failure is not reported.
        A process hosting the scheduler then keeps it up until every peer has
        heard of the failure (bounded), since it is about to exit."""
        try:
            self._report_failure(error)
        finally:
            if self._hosted_scheduler is not None and not isinstance(error, JobFinished):
                self._hosted_scheduler.linger_after_failure(
                    2 * self.settings.heartbeat_timeout_s)

    def _report_failure(self, error: BaseException) -> None:
        if (self.client is None or isinstance(error, (PeerFailed, JobFinished))
                or self._failure_reported):
            return
        self._failure_reported = True
        first_line = (str(error).strip().splitlines() or [""])[0]
        try:
            if self._heartbeat is not None:
                self._heartbeat.beat_now()
            self.client.report_failure(self.label, f"{type(error).__name__}: {first_line}")
        except ClusterError:
            logger.warning("[%s] could not report the failure to the scheduler",
                           self.label.describe())

    def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
        if self.transport is not None:
            self.transport.close()
        if self.client is not None:
            self.client.close()
        if self._hosted_scheduler is not None:
            self._hosted_scheduler.close(self.settings.finish_timeout_s)


def _host_scheduler(env: ProcessEnvironment, settings: JobSettings) -> HostedScheduler | None:
    """Task 0 of a job started by srun or torchrun (no scheduler named): start
    the job's scheduler in this process, where every task will look for it."""
    identity = env.identity
    if identity is None:
        return None
    # No splitrun launcher checked this process's bind (`splitrun join` did, and
    # passes --insecure on): off loopback, TLS or an explicit opt-out.
    if env.tls is None and not env.is_insecure and not is_loopback(env.host):
        raise ClusterError(
            f"{identity.describe()} would listen on {env.host} ({ENV.HOST}) without TLS: "
            f"tensors and the job's token would cross the network unencrypted; give "
            f"{ENV.TLS_CERT}, {ENV.TLS_KEY} and {ENV.TLS_CA} (splitrun join --tls-cert, "
            f"--tls-key, --tls-ca), or set {ENV.INSECURE}=1 (--insecure) on a network "
            f"you trust")
    if not identity.hosts_scheduler:
        return None
    if not env.token:
        raise ClusterError(
            f"{identity.describe()} hosts the job's scheduler, which needs the job's token: "
            f"set {ENV.TOKEN} to the same secret in every task (export "
            f"{ENV.TOKEN}=$(openssl rand -hex 16) before srun or torchrun), or pass "
            f"--token-file to splitrun join")
    hosted = HostedScheduler(identity.cluster, env.token,
                             heartbeat_timeout_s=settings.heartbeat_timeout_s)
    try:
        hosted.start(env.host, identity.scheduler_port, env.tls)
    except ClusterError as exc:
        raise ClusterError(f"{identity.describe()}: {exc} (every task derives the port from "
                           f"{ENV.SCHEDULER_PORT}, MASTER_PORT + 1 or SLURM_JOB_ID; set "
                           f"{ENV.SCHEDULER_PORT} to a free one)") from None
    # A failure keeps it up until the peers heard (Job.report_failure); a clean
    # exit closes it in Job.close. Any other exit stops it here, at once.
    atexit.register(hosted.close, 0.0)
    logger.info("%s: hosting the scheduler at %s", identity.describe(), env.scheduler)
    return hosted


class Trainer:
    """Runs this process's share of the split step."""

    def __init__(self, job: Job, split: SplitProgram, process: ProcessRuntime, *,
                 gather_state: bool, num_steps: int | None, first_step: int = 0,
                 source: Program | None = None) -> None:
        self.job = job
        self.split = split
        self.source = source or split.program  # the captured program: checkpoints' keys
        self.process = process
        self.gather_state = gather_state
        self.steps_done = first_step
        self.final_state: dict[str, torch.Tensor] | None = None
        self._progress = Progress(num_steps, enabled=job.is_driver)
        self._metrics = (StepMetrics(job.settings.metrics_dir, job.label)
                         if job.settings.metrics_dir else None)
        self._finished = False
        self._num_sharded_saves = 0
        if job.is_server:
            process.set_row_writer(self._write_rows)

    @property
    def plan(self) -> SplitPlan:
        return self.split.plan

    @property
    def program(self) -> Program:
        """The program this process runs (the mode's rewrite of the captured one)."""
        return self.split.program

    @property
    def stats(self):
        return self.process.stats

    @property
    def cache_counters(self) -> dict[str, dict]:
        """Embedding-cache mode: per table, lookups, unique ids, hits, misses,
        evictions and bytes pulled and pushed (totals and the last step's)."""
        return self.process.cache_counters

    def run(self, batches):
        """Step through `batches`, yielding each step's outputs; each step also
        gets the next batch, so an embedding cache prefetches its rows."""
        iterator = iter(batches)
        current = next(iterator, None)
        while current is not None:
            following = next(iterator, None)
            yield self.step(current, next_batch=following)
            current = following

    def step(self, batch, next_batch=None) -> dict[str, torch.Tensor]:
        """Run one training step on this worker; returns the outputs delivered
        here (the loss, on worker 0). `next_batch` (optional) lets an embedding
        cache fetch the next step's missing rows while this one computes."""
        if not self.job.is_worker:
            raise SplitrunError(
                f"[{self.job.label.describe()}] servers do not run the training loop; "
                f"call trainer.finish() on servers (it serves steps until the workers "
                f"finish), or loop over trainer.shard(batches), which is empty on servers")
        if self._finished:
            raise SplitrunError("step() after finish()")
        try:
            outputs = self.process.run_step(
                self.steps_done, _feeds_of(batch),
                None if next_batch is None else _feeds_of(next_batch))
        except TransportError as exc:
            lost = self.job.scheduler_unreachable()
            if lost is None:
                self.job.report_failure(exc)
                raise
            # The scheduler's loss ended a peer first: that is the cause.
            raise PeerFailed(f"job failed: {lost} (then: {exc})") from exc
        except BaseException as exc:
            self.job.report_failure(exc)
            raise
        self.steps_done += 1
        self.job.report_progress(self.steps_done)
        self._checkpoint_periodically()
        loss = outputs.get("loss")
        loss_value = None if loss is None else loss.item()
        hit_rate = self.process.cache_hit_rate()
        extra = "" if hit_rate is None else f"hit rate {hit_rate:.3f}"
        self._progress.update(self.steps_done - 1, loss_value, extra)
        self._record_metrics(loss_value)
        return outputs

    def _record_metrics(self, loss: float | None) -> None:
        if self._metrics is not None:
            self._metrics.record(self.steps_done - 1, loss=loss, stats=self.process.stats,
                                 cache_counters=self.cache_counters)

    def _checkpoint_periodically(self) -> None:
        """Under `splitrun launch --checkpoint-every K`: save every K steps (every
        worker reaches the same step, so they save together) and keep the
        newest few; a restarted job resumes from the last good one."""
        settings = self.job.settings
        every, directory = settings.checkpoint_every, settings.checkpoint_dir
        if not every or not directory or self.steps_done % every:
            return
        self.save(checkpoint.periodic_path(directory, self.steps_done))
        if self.job.is_driver:
            checkpoint.prune_periodic(directory)

    def shard(self, batches):
        """The batches this process trains on: in parameter-server mode worker
        r of W gets rows [r*B/W, (r+1)*B/W) of every global batch; in general
        mode every worker gets whole batches; servers get none."""
        if not self.job.is_worker:
            return iter(())
        if self.plan.mode in (ModeKind.GENERAL, ModeKind.PARALLEL):
            return iter(batches)
        return shard_batches(batches, self.job.rank, self.job.cluster.num_workers)

    def save(self, path: str | os.PathLike) -> None:
        """Write a checkpoint of the whole job's state after the steps done so
        far. Every worker calls it at the same point of its loop; servers answer
        between steps. (Servers, which have no loop, must not call it.)

        `path` ending in .pt or .pth: one plain file, gathered on worker 0.
        Any other path: a sharded `torch.distributed.checkpoint` directory in
        which every process writes what it owns, on its own machine
        (`sharded_checkpoint.py`)."""
        if not self.job.is_worker:
            raise SplitrunError("save() is called by the workers; servers answer it between "
                                "steps (guard it with `if job.is_worker:`)")
        if sharded_checkpoint.is_directory_path(path):
            self._save_sharded(os.fspath(path))
            return
        job, step = self.job, self.steps_done
        if not job.is_driver:
            self._send_state(checkpoint.save_channel(job.label), step)
            return
        command = [torch.tensor(checkpoint.SAVE, dtype=torch.int64)]
        for proc in self.plan.processes:
            if proc.label.role is Role.SERVER and proc.state:
                job.transport.send(proc.label, MessageKey(job.incarnation, step,
                                                          checkpoint.CONTROL_CHANNEL), command)
        state = self._collect_state(checkpoint.save_channel, step)
        state.update(self.process.dump_tables(step))  # dirty rows go back, then the tables
        info = {"cluster": str(job.cluster), "plan": self.plan.fingerprint}
        checkpoint.write_checkpoint(
            checkpoint.to_checkpoint(self.source, self._full(state), step, info), path)
        logger.info("[%s] checkpoint of step %d written to %s", job.label.describe(), step,
                    path)

    # -- sharded checkpoints --

    def _save_sharded(self, directory: str) -> None:
        """Every process that owns state writes it into `directory` and reports
        what it wrote through the scheduler's key-value store; worker 0 writes
        the metadata once every report is in."""
        job, step = self.job, self.steps_done
        key = checkpoint.sharded_save_key(job.incarnation, self._num_sharded_saves)
        self._num_sharded_saves += 1
        if not job.is_driver:
            if self.process.state_keys:
                job.client.kv_put(f"{key}/{job.label}", self._write_own(directory))
            return
        sharded_checkpoint.start_checkpoint(directory)
        job.client.kv_put(f"{key}/dir", directory.encode())
        command = [torch.tensor(checkpoint.SAVE_SHARDED, dtype=torch.int64)]
        owners = [proc.label for proc in self.plan.processes
                  if proc.state and proc.label != job.label]
        for label in owners:
            if label.role is Role.SERVER:
                job.transport.send(label, MessageKey(job.incarnation, step,
                                                     checkpoint.CONTROL_CHANNEL), command)
        reports = {f"{server}-rows": report
                   for server, report in self.process.save_rows(directory, step).items()}
        info = {"cluster": str(job.cluster), "plan": self.plan.fingerprint}
        objects, counts = sharded_checkpoint.driver_objects(self.source, step, info)
        reports[str(job.label)] = self._write_own(directory, counts, objects)
        for label in owners:
            reports[str(label)] = job.client.kv_get(f"{key}/{label}",
                                                    job.settings.finish_timeout_s)
        sharded_checkpoint.finish_checkpoint(directory, reports)
        logger.info("[%s] sharded checkpoint of step %d written to %s (%d processes wrote)",
                    job.label.describe(), step, directory, len(reports))

    def _write_own(self, directory: str, extra=(), objects=None) -> bytes:
        pieces = sharded_checkpoint.owned_pieces(self.source, self.split.artifacts,
                                                 self.process.state)
        return sharded_checkpoint.write_pieces(directory, str(self.job.label),
                                               [*extra, *pieces], objects)

    def _write_rows(self, directory: str, step: int, shards: list[ShardSnapshot]) -> bytes:
        """A server's rows of the cached tables (its embedding store calls this
        when worker 0 asks)."""
        return sharded_checkpoint.write_pieces(directory, f"{self.job.label}-rows",
                                               sharded_checkpoint.row_pieces(self.source, shards))

    def _full(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        artifacts = self.split.artifacts
        return state if artifacts is None else artifacts.full_state(state)

    def _send_state(self, channel: str, step: int) -> None:
        keys = self.process.state_keys
        if keys:
            tensors = [self.process.state[k].detach().cpu() for k in keys]
            self.job.transport.send(Label.worker(0), MessageKey(self.job.incarnation, step,
                                                               channel), tensors)

    def _collect_state(self, channel_of, step: int) -> dict[str, torch.Tensor]:
        """Worker 0: its own state and every other owner's, sent on `channel_of(owner)`."""
        state = {k: v.detach().cpu() for k, v in self.process.state.items()}
        for proc in self.plan.processes:
            if proc.label == self.job.label or not proc.state:
                continue
            key = MessageKey(self.job.incarnation, step, channel_of(proc.label))
            tensors = self.job.transport.recv(proc.label, key, self.job.settings.finish_timeout_s)
            state.update(zip(proc.state, tensors))
        return state

    def _on_control(self, sender: Label, tensors: list[torch.Tensor]) -> None:
        """A serving process, between steps: worker 0 asks for a checkpoint."""
        command = int(tensors[0]) if tensors else None
        if command == checkpoint.SAVE_SHARDED:
            job = self.job
            key = checkpoint.sharded_save_key(job.incarnation, self._num_sharded_saves)
            self._num_sharded_saves += 1
            directory = job.client.kv_get(f"{key}/dir", job.settings.finish_timeout_s).decode()
            job.client.kv_put(f"{key}/{job.label}", self._write_own(directory))
            return
        if command != checkpoint.SAVE:
            raise SplitrunError(f"unknown control command {command} from {sender.describe()}")
        self._send_state(checkpoint.save_channel(self.job.label), self.steps_done)

    def _serve(self) -> None:
        """A server's loop: run steps as their messages come, until the workers
        finish (a receive for a step they never ran ends with JobFinished)."""
        if self.plan.process(self.job.label).is_idle:
            return
        settings = self.job.settings
        while True:
            try:
                self.process.serve_step(self.steps_done,
                                        first_recv_timeout_s=settings.idle_timeout_s,
                                        control=(checkpoint.CONTROL_CHANNEL, self._on_control))
            except JobFinished:
                return
            except BaseException as exc:
                self.job.report_failure(exc)
                raise
            self.steps_done += 1
            self.job.report_progress(self.steps_done)
            self._record_metrics(None)

    def finish(self) -> dict[str, torch.Tensor] | None:
        """End training on this process and leave the job.

        Workers report how many steps they ran; servers serve until then. With
        `gather_state`, worker 0 then receives every process's final state and
        returns it (a dict like `program.initial_state`); other processes return
        None. Every process waits at a final barrier before closing, so no
        message is sent to a process that is gone.
        """
        if self._finished:
            return self.final_state
        self._finished = True
        job, transport, timeout = self.job, self.job.transport, self.job.settings.finish_timeout_s
        try:
            if job.is_worker:
                transport.flush(timeout)
                job.client.report_finished(job.label, self.steps_done)
            else:
                self._serve()
            if self.gather_state:
                self._gather_state()
            transport.flush(timeout)
            job.client.barrier("finish", job.label, timeout)
            job.client.report_done(job.label)
        except BaseException as exc:
            job.report_failure(exc)
            raise
        finally:
            elapsed = self._progress.close()
            stats = self.process.stats
            logger.info("[%s] %d steps in %.2f s; sent %d B in %d messages, received %d B; "
                        "waited %.2f s in receives", job.label.describe(), self.steps_done,
                        elapsed, stats.bytes_sent, stats.messages_sent, stats.bytes_received,
                        stats.recv_wait_s)
            for table, counters in self.cache_counters.items():
                logger.info("[%s] cache %s: %s", job.label.describe(), table,
                            {k: v for k, v in counters.items() if k != "last_step"})
            if self._metrics is not None:
                self._metrics.close()
            self.process.close()
            job.close()
        return self.final_state

    def _gather_state(self) -> None:
        if self.job.is_driver:
            state = self._collect_state(checkpoint.final_state_channel, self.steps_done)
            state.update(self.process.dump_tables(self.steps_done))
            self.final_state = self._full(state)
        else:
            self._send_state(checkpoint.final_state_channel(self.job.label), self.steps_done)
            self.process.drain_prefetch()


def _write_module_map(program: Program, path: str) -> None:
    """Each op's module path (as the capture annotated it), as JSON."""
    modules = {}
    for node in program.graph.nodes:
        module = program.module_of(node)
        if module is not None:
            modules[node.name] = module
    with open(path, "w") as out:
        json.dump(modules, out, sort_keys=True)


def _waiting(process: ProcessRuntime) -> tuple[Label, float] | None:
    waiting = process.executor.waiting_on
    return None if waiting is None else (waiting.peer, time.monotonic() - waiting.since)


def _feeds_of(batch) -> dict[str, torch.Tensor]:
    """A batch as feeds: a dict as given, a tensor as `batch.0`, a sequence as
    `batch.0`, `batch.1`, ... (the names capture gives the batch inputs)."""
    if isinstance(batch, Mapping):
        return dict(batch)
    if isinstance(batch, torch.Tensor):
        return {"batch.0": batch}
    if isinstance(batch, Sequence):
        return {f"batch.{i}": t for i, t in enumerate(batch)}
    raise SplitrunError(
        f"step() takes the batch as a tensor, a sequence of tensors or a dict "
        f"of feeds, got {type(batch).__name__}")


def _control_channels(plan: SplitPlan, program: Program, me: Label
                      ) -> dict[str, ChannelContract]:
    """Channels outside the step's plan: worker 0 receives every owner's state
    (for saves and at finish); serving processes receive worker 0's commands."""
    channels: dict[str, ChannelContract] = {}
    if me == Label.worker(0):
        for proc in plan.processes:
            if proc.label == me or not proc.state:
                continue
            contract = ChannelContract.of_values(
                proc.label, program, [program.input_for_key(key).node for key in proc.state])
            for channel in (checkpoint.save_channel, checkpoint.final_state_channel):
                channels[channel(proc.label)] = contract
    elif me.role is Role.SERVER:
        channels[checkpoint.CONTROL_CHANNEL] = ChannelContract(
            Label.worker(0), ((torch.int64, ()),))
    return channels


