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

The parts (this room): `joining` (device, advertised address, a hosted scheduler),
`member` (heartbeat, failure reports, leaving), `trainer` (the step loop and
finishing); below it, `checkpoints.saving` (saves and resumes), `checkpoints.gather` (state to
worker 0).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping

import torch

from splitrun.splitter.labels import Cluster, Label
from splitrun.splitter.plan.picture_names import picture_names
from splitrun.splitter.plan.text import plan_to_text
from splitrun.splitter.program import Program
from splitrun.splitter.splitting.graph_splitter import split_program
from splitrun.splitter.splitting.mode import Mode

from ..checkpoints.saving import resume_state
from ..cluster.env import ENV, ProcessEnvironment
from ..cluster.hosted import HostedScheduler
from ..cluster.membership import SchedulerClient
from ..cluster.rendezvous import SchedulerRendezvous
from ..cluster.step_file import StepFile
from ..transport.grpc import GrpcSettings, GrpcTransport
from ..transport.protocol import Transport
from ..transport.router import RoutedTransport, TransportChoice
from ..transport.shm.transport import ShmSettings
from .joining import advertised_host, host_scheduler, pick_device
from .member import JobMember
from .settings import JobSettings
from .trainer import Trainer, start_trainer

__all__ = ["Job", "Trainer", "JobSettings", "ENV", "PlanWritten", "report_uncaught",
           "pick_device"]

logger = logging.getLogger(__name__)

# The job this process joined (Job.from_env), for `report_uncaught`.
_joined: Job | None = None


def report_uncaught(error: BaseException) -> None:
    """The launcher's bootstrap, when the script ends with `error`: tell the
    scheduler (the step this process reached, and the error) before the
    process's slow teardown, so the failure is blamed here and at that step.
    The job is over: its shared-memory files go too (a SIGKILLed peer's among
    them; the process exits without closing its transport). After the
    process left the job (`trainer.finish()`), the error is the script's
    alone: nothing is reported."""
    if _joined is not None and not _joined.has_left:
        _joined.report_failure(error)
        if _joined.remove_job_files is not None:
            _joined.remove_job_files()


class PlanWritten(BaseException):  # noqa: N818 - a signal, named for what happened
    """Not an error: under `splitrun plan`, `Job.start()` wrote the plan and the
    script has nothing more to do. Like `SystemExit` it is not an `Exception`
    (a script's `except Exception` does not catch it); the launcher's bootstrap
    ends the process with status 0 on it."""


class Job(JobMember):
    """This process's membership in a running job: joined from the
    environment the launcher set (`from_env`), started on a program (`start`)."""

    def __init__(self, label: Label, cluster: Cluster, device: torch.device,
                 settings: JobSettings, *, client: SchedulerClient | None = None,
                 transport: Transport | None = None, incarnation: int = 0,
                 heartbeat_interval_s: float = 0.5, plan_out: str | None = None,
                 host: str = "127.0.0.1",
                 hosted_scheduler: HostedScheduler | None = None,
                 plan_modules_out: str | None = None,
                 step_file: StepFile | None = None,
                 remove_job_files: Callable[[], None] | None = None) -> None:
        super().__init__(label, cluster, device, settings, client=client, transport=transport,
                         incarnation=incarnation, heartbeat_interval_s=heartbeat_interval_s,
                         host=host, hosted_scheduler=hosted_scheduler, step_file=step_file)
        self.plan_out = plan_out
        self.plan_modules_out = plan_modules_out
        # The job failed and this process ends without closing: what removes
        # the job's shared-memory files on this host (`report_uncaught`).
        self.remove_job_files = remove_job_files

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
        hosted = host_scheduler(env, settings)
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
        # On CUDA, what arrives lands in pinned memory: the executor copies
        # every received tensor to the GPU, and pinned copies are DMA.
        on_gpu = device.type == "cuda"
        ring_bytes = ShmSettings().ring_bytes if env.shm_ring_mb is None else env.shm_ring_mb << 20
        transport = RoutedTransport(
            GrpcTransport(provisional, token=env.token, incarnation=0, host=env.host, port=0,
                          tls=env.tls, settings=GrpcSettings(pin_receive_buffers=on_gpu)),
            prefix=shm_prefix, choice=choice,
            settings=ShmSettings(ring_bytes=ring_bytes, pin_incoming=on_gpu))
        bound = transport.start()
        port = bound.rsplit(":", 1)[1]
        host = advertised_host(env)
        registration = client.register(env.role, env.rank, f"{host}:{port}")
        transport.set_identity(registration.label, registration.incarnation)
        # Threads and the CPU kernels' instruction set decide how floats are
        # summed: logged so a run that differs from another can be told apart.
        logger.info("joined as %s of %s (incarnation %d, device %s, %d threads, CPU kernels %s)",
                    registration.label.describe(), registration.cluster,
                    registration.incarnation, device, torch.get_num_threads(),
                    torch.backends.cpu.get_cpu_capability())
        job = cls(registration.label, registration.cluster, device, settings,
                  client=client, transport=transport, incarnation=registration.incarnation,
                  heartbeat_interval_s=registration.heartbeat_interval_s, host=host,
                  hosted_scheduler=hosted,
                  step_file=None if env.step_file is None else StepFile(env.step_file),
                  remove_job_files=transport.remove_job_files)
        global _joined
        _joined = job
        return job

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
                out.write(plan_to_text(split.plan))
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
        if self.settings.restart_from is not None:  # a restart: the launcher's checkpoint wins
            resume = self.settings.restart_from
        state, first_step = resume_state(program, split, self.label, resume)
        state = split.artifacts.split_state(state)  # parallel mode keeps state in pieces
        # Parallel mode's torch.distributed groups meet through the scheduler.
        rendezvous = None if self.client is None else SchedulerRendezvous(
            self.client, self.incarnation, self.host, self.settings.register_timeout_s)
        trainer = start_trainer(self, split, state=state, first_step=first_step,
                                rendezvous=rendezvous, gather_state=gather_state,
                                num_steps=num_steps, source=program,
                                # A server of its own process keeps only its own state.
                                free_model=not self.is_worker)
        logger.info("[%s] plan %s: %s", self.label.describe(), plan.fingerprint, summary)
        return trainer


def _write_module_map(program: Program, path: str) -> None:
    """The names of the plan's picture (`picture_names`), as JSON."""
    with open(path, "w") as out:
        json.dump(picture_names(program), out, sort_keys=True)
