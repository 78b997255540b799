"""The scheduler task 0 of a Slurm or torchrun job runs inside its own process.

Under `srun` or `torchrun` no splitrun launcher runs a scheduler, so the
process of task 0 (worker 0) starts one before it registers, at the address
every task derived from the same variables (`identity`), and keeps
it until every process is done. If the job fails, it stays up (bounded) until
every peer has heard why, so they report the cause instead of a lost scheduler.
That wait happens before the process starts to exit: once the interpreter shuts
down, gRPC's thread pool takes no new calls, and the scheduler goes silent.
"""

from __future__ import annotations

import logging
import time

from splitrun.splitter.labels import Cluster

from ..rpc.tls import TlsFiles
from .scheduler import Scheduler, SchedulerSettings

__all__ = ["HostedScheduler"]

logger = logging.getLogger(__name__)


class HostedScheduler:
    """A `Scheduler` owned by one process of the job."""

    def __init__(self, cluster: Cluster, token: str, *, heartbeat_timeout_s: float) -> None:
        # Distinct per start of a job, so a restarted peer's stale messages are refused.
        incarnation = time.time_ns() & ((1 << 62) - 1)
        self._scheduler = Scheduler(SchedulerSettings(
            cluster.num_workers, cluster.num_servers, token, incarnation,
            heartbeat_timeout_s=heartbeat_timeout_s))
        self._closed = False

    def start(self, host: str, port: int, tls: TlsFiles | None) -> str:
        address = self._scheduler.start(host, port, tls)
        logger.info("hosting the job's scheduler at %s", address)
        return address

    def linger_after_failure(self, timeout_s: float) -> bool:
        """After this process's failure (or the job's): wait, at most
        `timeout_s`, until every peer has heard of it. False if the job did
        not fail or some peer did not hear in time."""
        if self._closed or self._scheduler.failure is None:
            return False
        return self._scheduler.wait_failure_told(timeout_s)

    def close(self, timeout_s: float) -> None:
        """Wait (at most `timeout_s`) until every process is done, or, after a
        failure, until every peer heard of it; then stop."""
        if self._closed:
            return
        self._closed = True
        scheduler = self._scheduler
        scheduler.wait_done(timeout_s)
        failure = scheduler.failure
        if failure is not None:
            told = scheduler.wait_failure_told(min(timeout_s,
                                                   2 * scheduler.settings.heartbeat_timeout_s))
            logger.info("the job failed (%s); %s", failure[1],
                        "every peer was told" if told else "some peers were not told in time")
        scheduler.stop()
