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

import ctypes
import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from splitrun.splitter.graph_splitter import split
from splitrun.splitter.labels import Cluster, Label, Role
from splitrun.splitter.modes import Mode
from splitrun.splitter.plan import ModeKind, SplitPlan
from splitrun.splitter.program import Program

from . import checkpoint
from .embedding import protocol as embedding_protocol
from .embedding.attach import CacheParts, attach_cache
from .data import shard_batches
from .errors import ClusterError, JobFinished, PeerFailed, SplitrunError
from .executor import Executor
from .transport.grpc.transport import ExpectedChannel, GrpcTransport, expected_channels
from .cluster.membership import Heartbeat, SchedulerClient
from .progress import Progress
from .transport.protocol import MessageKey

__all__ = ["Job", "Trainer", "JobSettings", "ENV"]

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


class ENV:
    """Environment variables `splitrun launch` and `splitrun join` set."""

    SCHEDULER = "SPLITRUN_SCHEDULER"      # host:port of the scheduler
    TOKEN = "SPLITRUN_TOKEN"              # the job's secret; every call carries it
    ROLE = "SPLITRUN_ROLE"                # worker | server
    RANK = "SPLITRUN_RANK"                # optional: the rank to ask for
    DEVICE = "SPLITRUN_DEVICE"            # cpu | cuda | auto
    HOST = "SPLITRUN_HOST"                # interface this process's tensor server binds
    ADVERTISE = "SPLITRUN_ADVERTISE"      # name peers use to reach it (default: HOST)
    RECV_TIMEOUT_S = "SPLITRUN_RECV_TIMEOUT_S"
    IDLE_TIMEOUT_S = "SPLITRUN_IDLE_TIMEOUT_S"
    HEARTBEAT_TIMEOUT_S = "SPLITRUN_HEARTBEAT_TIMEOUT_S"
    LOG_LEVEL = "SPLITRUN_LOG_LEVEL"
    PLAN_OUT = "SPLITRUN_PLAN_OUT"        # `splitrun plan`: write the plan here and exit
    NUM_WORKERS = "SPLITRUN_NUM_WORKERS"  # cluster size for `splitrun plan`
    NUM_SERVERS = "SPLITRUN_NUM_SERVERS"
    LAUNCHER_PID = "SPLITRUN_LAUNCHER_PID"  # die with this process (set by launch)


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
    heartbeat_timeout_s: float = 10.0
    # Flushing sends and the final barrier are bounded by this.
    finish_timeout_s: float = 120.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> JobSettings:
        def number(key: str, default: float) -> float:
            text = environ.get(key)
            try:
                return default if text is None else float(text)
            except ValueError:
                raise ClusterError(f"{key}={text!r} is not a number of seconds") from None
        return cls(recv_timeout_s=number(ENV.RECV_TIMEOUT_S, cls.recv_timeout_s),
                   idle_timeout_s=number(ENV.IDLE_TIMEOUT_S, cls.idle_timeout_s),
                   heartbeat_timeout_s=number(ENV.HEARTBEAT_TIMEOUT_S, cls.heartbeat_timeout_s))


def _pick_device(text: str) -> torch.device:
    if text in ("", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(text)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ClusterError(f"{ENV.DEVICE}={text} but this machine has no CUDA device; "
                           f"launch with --device cpu")
    return device


def _die_with_launcher(environ: Mapping[str, str]) -> None:
    """Under `splitrun launch`, make the kernel kill this process if the
    launcher dies (Linux), so no process outlives it."""
    pid = environ.get(ENV.LAUNCHER_PID)
    if not pid or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        return  # the heartbeat timeout stops an orphan instead
    if os.getppid() != int(pid):
        raise ClusterError(f"the launcher (pid {pid}) is gone; not starting")


def _configure_logging(environ: Mapping[str, str]) -> None:
    """The launcher asks its children to log at a level; set it up once."""
    level = environ.get(ENV.LOG_LEVEL)
    if level and not logging.getLogger().handlers:
        logging.basicConfig(level=level.upper(), stream=sys.stderr,
                            format="%(levelname)s %(name)s: %(message)s")


class Job:
    """This process's membership in a running job."""

    def __init__(self, label: Label, cluster: Cluster, device: torch.device,
                 settings: JobSettings, *, client: SchedulerClient | None = None,
                 transport: GrpcTransport | None = None, incarnation: int = 0,
                 heartbeat_interval_s: float = 0.5, plan_out: str | None = None) -> None:
        self.label = label
        self.cluster = cluster
        self.device = device
        self.settings = settings
        self.incarnation = incarnation
        self.client = client
        self.transport = transport
        self.plan_out = plan_out
        self._heartbeat: Heartbeat | None = None
        if client is not None:
            self._heartbeat = Heartbeat(
                client, label, heartbeat_interval_s, settings.heartbeat_timeout_s,
                on_failed=self._job_failed, on_finished=self._workers_finished)
            self._heartbeat.start()

    # -- joining --

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Job:
        """Join the job `splitrun launch` or `splitrun join` started this process in."""
        environ = os.environ if environ is None else environ
        _configure_logging(environ)
        _die_with_launcher(environ)
        settings = JobSettings.from_env(environ)
        device = _pick_device(environ.get(ENV.DEVICE, "auto"))
        if environ.get(ENV.PLAN_OUT):
            cluster = Cluster(int(environ.get(ENV.NUM_WORKERS, "1")),
                              int(environ.get(ENV.NUM_SERVERS, "0")))
            return cls(Label.worker(0), cluster, device, settings,
                       plan_out=environ[ENV.PLAN_OUT])
        address = environ.get(ENV.SCHEDULER)
        if not address:
            raise ClusterError(
                f"{ENV.SCHEDULER} is not set: this script joins a splitrun job; start it "
                f"with `splitrun launch --workers N {sys.argv[0]}` or `splitrun join "
                f"--scheduler HOST:PORT {sys.argv[0]}`")
        role = Role.parse(environ.get(ENV.ROLE, "worker"))
        rank_text = environ.get(ENV.RANK, "")
        rank = int(rank_text) if rank_text not in ("", "-1") else None
        token = environ.get(ENV.TOKEN, "")
        host = environ.get(ENV.HOST, "127.0.0.1")
        advertise = environ.get(ENV.ADVERTISE) or host
        client = SchedulerClient(address, token)
        # The tensor server starts before registering: its address is part of
        # the registration. Its label is provisional until the scheduler assigns
        # the rank.
        provisional = Label(rank or 0, role)
        transport = GrpcTransport(provisional, token=token, incarnation=0, host=host, port=0)
        bound = transport.start()
        port = bound.rsplit(":", 1)[1]
        registration = client.register(role, rank, f"{advertise}:{port}")
        transport.set_identity(registration.label, registration.incarnation)
        logger.info("joined as %s of %s (incarnation %d, device %s)",
                    registration.label.describe(), registration.cluster,
                    registration.incarnation, device)
        return cls(registration.label, registration.cluster, device, settings,
                   client=client, transport=transport, incarnation=registration.incarnation,
                   heartbeat_interval_s=registration.heartbeat_interval_s)

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
        logger.error("[%s] stopping: %s", self.label.describe(), reason)
        if self.transport is not None:
            self.transport.abort(PeerFailed(f"job failed: {reason}"))

    def _workers_finished(self, num_steps: int) -> None:
        if self.transport is not None:
            self.transport.finish_at(num_steps)

    # -- running --

    def start(self, program: Program, mode: Mode | None = None, *,
              gather_state: bool = True, num_steps: int | None = None,
              resume: str | os.PathLike | None = None) -> Trainer:
        """Split `program` for this job's cluster, agree on the plan with every
        other process, connect to the peers and return the trainer.

        `gather_state`: at `finish()`, worker 0 receives every process's final
        state. `num_steps` (optional) sizes the progress bar. `resume`: a
        checkpoint written by `Trainer.save` (any number of servers) to start
        from; training continues at its step.
        """
        plan = split(program, self.cluster, mode)
        plan.lint()
        if self.plan_out is not None:
            _write_plan(plan, self.plan_out)
            raise SystemExit(0)
        summary = plan.summary().splitlines()[0]
        self.client.submit_plan(self.label, plan.fingerprint, summary)
        peers = self.client.wait_for_peers(self.label, self.settings.register_timeout_s)
        self.transport.set_peers({label: address for label, address in peers.items()
                                  if label != self.label})
        expected = expected_channels(plan, plan.program, self.label)
        expected.update(_control_channels(plan, plan.program or program, self.label))
        expected.update(_embedding_channels(plan, self.label))
        state, first_step = program.initial_state, 0
        if resume is not None:
            state, first_step = checkpoint.from_checkpoint(
                program, checkpoint.read_checkpoint(resume))
            logger.info("[%s] resuming from %s at step %d", self.label.describe(), resume,
                        first_step)
        # The embedding store must take its requests before any can arrive,
        # i.e. before `expect` lets the plan's messages in.
        caches = attach_cache(plan, self.label, self.transport, self.incarnation, state=state,
                              device=self.device, first_step=first_step,
                              timeout_s=self.settings.recv_timeout_s)
        self.transport.expect(expected)
        executor = Executor(plan, self.label, self.transport, program=plan.program,
                            device=self.device, incarnation=self.incarnation,
                            recv_timeout_s=self.settings.recv_timeout_s,
                            bindings=caches.bindings)
        executor.load_state(state)
        logger.info("[%s] plan %s: %s", self.label.describe(), plan.fingerprint, summary)
        return Trainer(self, plan, plan.program, executor, gather_state=gather_state,
                       num_steps=num_steps, first_step=first_step, caches=caches)

    def report_failure(self, error: BaseException) -> None:
        if self.client is None or isinstance(error, (PeerFailed, JobFinished)):
            return
        try:
            self.client.report_failure(self.label, f"{type(error).__name__}: {error}")
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


class Trainer:
    """Runs this process's share of the split step."""

    def __init__(self, job: Job, plan: SplitPlan, program: Program, executor: Executor, *,
                 gather_state: bool, num_steps: int | None, first_step: int = 0,
                 caches: CacheParts | None = None) -> None:
        self.job = job
        self.plan = plan
        self.program = program
        self.executor = executor
        self.gather_state = gather_state
        self.steps_done = first_step
        self.final_state: dict[str, torch.Tensor] | None = None
        self.caches = caches or CacheParts()
        self._progress = Progress(num_steps, enabled=job.is_driver)
        self._finished = False

    @property
    def stats(self):
        return self.executor.stats

    @property
    def cache_counters(self) -> dict[str, dict]:
        """Embedding-cache mode: per table, lookups, unique ids, hits, misses,
        evictions and bytes pulled and pushed (totals and the last step's)."""
        client = self.caches.client
        return {} if client is None else client.counters

    def _feeds(self, batch) -> dict[str, torch.Tensor]:
        if isinstance(batch, Mapping):
            feeds = dict(batch)
        elif isinstance(batch, torch.Tensor):
            feeds = {"batch.0": batch}
        elif isinstance(batch, Sequence):
            feeds = {f"batch.{i}": t for i, t in enumerate(batch)}
        else:
            raise SplitrunError(
                f"step() takes the batch as a tensor, a sequence of tensors or a dict "
                f"of feeds, got {type(batch).__name__}")
        feeds.update(self.program.hparams(self.steps_done))
        return feeds

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
                f"finish), or loop over job.shard(batches), which is empty on servers")
        if self._finished:
            raise SplitrunError("step() after finish()")
        client = self.caches.client
        if client is not None:
            client.step = self.steps_done
            client.next_feeds = None if next_batch is None else self._feeds(next_batch)
        try:
            outputs = self.executor.run_step(self.steps_done, self._feeds(batch))
        except BaseException as exc:
            self.job.report_failure(exc)
            raise
        self.steps_done += 1
        if self.job._heartbeat is not None:
            self.job._heartbeat.step = self.steps_done
        loss = outputs.get("loss")
        extra = "" if client is None else f"hit rate {client.hit_rate():.3f}"
        self._progress.update(self.steps_done - 1, None if loss is None else loss.item(), extra)
        return outputs

    def shard(self, batches):
        """The batches this process trains on: in parameter-server mode worker
        r of W gets rows [r*B/W, (r+1)*B/W) of every global batch; in general
        mode every worker gets whole batches; servers get none."""
        if not self.job.is_worker:
            return iter(())
        if self.plan.mode is ModeKind.GENERAL:
            return iter(batches)
        return shard_batches(batches, self.job.rank, self.job.cluster.num_workers)

    def save(self, path: str | os.PathLike) -> None:
        """Write a checkpoint of the whole job's state after the steps done so
        far. Every worker calls it at the same point of its loop; servers answer
        between steps; worker 0 writes the file."""
        if not self.job.is_worker:
            raise SplitrunError("save() is called by the workers; servers answer it")
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
        if self.caches.client is not None:  # dirty rows go back, then the tables come
            state.update(self.caches.client.dump(step))
        info = {"cluster": str(job.cluster), "plan": self.plan.fingerprint}
        checkpoint.write_checkpoint(checkpoint.to_checkpoint(self.program, state, step, info),
                                    path)
        logger.info("[%s] checkpoint of step %d written to %s", job.label.describe(), step,
                    path)

    def _send_state(self, channel: str, step: int) -> None:
        keys = self.plan.process(self.job.label).state
        if keys:
            tensors = [self.executor.state[k].detach().cpu() for k in keys]
            self.job.transport.send(Label.worker(0), MessageKey(self.job.incarnation, step,
                                                               channel), tensors)

    def _collect_state(self, channel_of, step: int) -> dict[str, torch.Tensor]:
        """Worker 0: its own state and every other owner's, sent on `channel_of(owner)`."""
        state = {k: v.detach().cpu() for k, v in self.executor.state.items()}
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
                self.executor.run_step(self.steps_done, {},
                                       first_recv_timeout_s=settings.idle_timeout_s,
                                       control=(checkpoint.CONTROL_CHANNEL, self._on_control))
            except JobFinished:
                return
            except BaseException as exc:
                self.job.report_failure(exc)
                raise
            self.steps_done += 1
            if self.job._heartbeat is not None:
                self.job._heartbeat.step = self.steps_done

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
            stats = self.executor.stats
            logger.info("[%s] %d steps in %.2f s; sent %d B in %d messages, received %d B; "
                        "waited %.2f s in receives", job.label.describe(), self.steps_done,
                        elapsed, stats.bytes_sent, stats.messages_sent, stats.bytes_received,
                        stats.recv_wait_s)
            for table, counters in self.cache_counters.items():
                logger.info("[%s] cache %s: %s", job.label.describe(), table,
                            {k: v for k, v in counters.items() if k != "last_step"})
            self.caches.close()
            job.close()
        return self.final_state

    def _gather_state(self) -> None:
        client = self.caches.client
        if self.job.is_driver:
            self.final_state = self._collect_state(checkpoint.final_state_channel,
                                                   self.steps_done)
            if client is not None:
                self.final_state.update(client.dump(self.steps_done))
        else:
            self._send_state(checkpoint.final_state_channel(self.job.label), self.steps_done)
            if client is not None:
                client.drain_prefetch()


def _control_channels(plan: SplitPlan, program: Program, me: Label
                      ) -> dict[str, ExpectedChannel]:
    """Channels outside the step's plan: worker 0 receives every owner's state
    (for saves and at finish); serving processes receive worker 0's commands."""
    channels: dict[str, ExpectedChannel] = {}
    if me == Label.worker(0):
        nodes = {n.name: n for n in program.graph.nodes}
        for proc in plan.processes:
            if proc.label == me or not proc.state:
                continue
            metas = []
            for key in proc.state:
                value = nodes[program.input_for_key(key).node].meta["val"]
                metas.append((value.dtype, tuple(value.shape)))
            for channel in (checkpoint.save_channel, checkpoint.final_state_channel):
                channels[channel(proc.label)] = ExpectedChannel(proc.label, tuple(metas))
    elif me.role is Role.SERVER:
        channels[checkpoint.CONTROL_CHANNEL] = ExpectedChannel(
            Label.worker(0), ((torch.int64, ()),))
    return channels


def _embedding_channels(plan: SplitPlan, me: Label) -> dict[str, ExpectedChannel]:
    """Embedding-cache mode: workers' requests to servers and the replies; their
    sizes change every step, so only the sender is checked."""
    if not (plan.program.extras or {}).get("cache_tables"):
        return {}
    if me.role is Role.WORKER:
        return {embedding_protocol.reply_channel(server): ExpectedChannel(server, None)
                for server in plan.labels if server.role is Role.SERVER}
    return {embedding_protocol.request_channel(worker): ExpectedChannel(worker, None)
            for worker in plan.labels if worker.role is Role.WORKER}


def _write_plan(plan: SplitPlan, path: str) -> None:
    """`splitrun plan`: the plan as DOT, SVG (with graphviz) or text, by suffix."""
    import shutil
    import subprocess

    if path.endswith(".svg"):
        dot = shutil.which("dot")
        if dot is None:
            raise ClusterError("writing .svg needs graphviz's `dot` on PATH; write .dot instead")
        subprocess.run([dot, "-Tsvg", "-o", path], input=plan.to_dot(), text=True,
                       check=True, timeout=120)
    elif path.endswith(".txt"):
        with open(path, "w") as out:
            out.write(plan.to_text())
    else:
        with open(path, "w") as out:
            out.write(plan.to_dot())
    logger.info("plan written to %s\n%s", path, plan.summary())
