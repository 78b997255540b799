"""This process's place in a running job: who it is, the heartbeat that
keeps the scheduler informed (and tells it of the job's failure or end),
its failure and progress reports, and leaving. `Job` (`job`) is a member
that joins and starts; a `Trainer` runs in one."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from splitrun.splitter.labels import Cluster, Label, Role

from ..cluster.hosted import HostedScheduler
from ..cluster.membership import Heartbeat
from ..cluster.protocol import Membership
from ..cluster.step_file import StepFile
from ..errors import ClusterError, JobFinished, PeerDied, PeerFailed, RecvTimeout
from ..transport.protocol import Transport
from .settings import JobSettings

__all__ = ["JobMember"]

logger = logging.getLogger(__name__)


class JobMember:
    """This process's membership in a running job."""

    def __init__(self, label: Label, cluster: Cluster, device: torch.device,
                 settings: JobSettings, *,
                 client: Membership | None = None,
                 transport: Transport | None = None, incarnation: int = 0,
                 heartbeat_interval_s: float | None = 0.5, host: str = "127.0.0.1",
                 hosted_scheduler: HostedScheduler | None = None,
                 step_file: StepFile | None = None) -> None:
        self.label = label
        self.host = host  # the address peers reach this process by
        self.cluster = cluster
        self.device = device
        self.settings = settings
        self.incarnation = incarnation
        self.client = client
        self.transport = transport
        self._heartbeat: Heartbeat | None = None
        self._failure_reported = False
        self.has_left = False  # closed: nobody of the job is told anything any more
        # Task 0 of a Slurm or torchrun job hosts the job's scheduler.
        self._hosted_scheduler = hosted_scheduler
        # Where the launcher reads this process's step if it is killed.
        self._step_file = step_file
        # No interval: the members are threads of one process (`run_threaded`),
        # whose membership tells them of a failure or the end at once.
        if client is not None and heartbeat_interval_s is not None:
            self._heartbeat = Heartbeat(
                client, label, heartbeat_interval_s, settings.heartbeat_timeout_s,
                on_failed=self._job_failed, on_finished=self._workers_finished)
            self._heartbeat.start()

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
        """Tell the scheduler (with the next heartbeat) and the launcher (at
        once, in the step file) how far this process got."""
        if self._heartbeat is not None:
            self._heartbeat.report_step(steps_done)
        if self._step_file is not None:
            self._step_file.record(steps_done)

    def watch_waits(self, waiting_on: Callable[[], tuple[Label, float] | None]) -> None:
        """Let the heartbeat tell the scheduler which peer this process waits
        on and for how long (`waiting_on()`: (peer, seconds) or None)."""
        if self._heartbeat is not None:
            self._heartbeat.watch_waits(waiting_on)

    # -- failing and leaving --

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
                or self._failure_reported or self.has_left):
            return
        self._failure_reported = True
        first_line = (str(error).strip().splitlines() or [""])[0]
        # A receive that timed out says on whom: the scheduler blames that peer
        # instead when it knows the peer stalled.
        waiting = ((error.peer, error.waited_s or 0.0)
                   if isinstance(error, RecvTimeout) and error.peer is not None else None)
        try:
            if self._heartbeat is not None:
                self._heartbeat.beat_now(waiting)
            self.client.report_failure(self.label, f"{type(error).__name__}: {first_line}",
                                       dead_peer=getattr(error, "peer", None)
                                       if isinstance(error, PeerDied) else None)
        except ClusterError:
            logger.warning("[%s] could not report the failure to the scheduler",
                           self.label.describe())

    def close(self) -> None:
        self.has_left = True
        if self._step_file is not None:
            self._step_file.close()
        if self._heartbeat is not None:
            self._heartbeat.stop()
        if self.transport is not None:
            self.transport.close()
        if self.client is not None:
            self.client.close()
        if self._hosted_scheduler is not None:
            self._hosted_scheduler.close(self.settings.finish_timeout_s)
