"""Cluster membership: the scheduler, its client and the heartbeat thread."""

from .membership import Heartbeat, Registration, SchedulerClient
from .scheduler import Scheduler, SchedulerSettings

__all__ = ["Heartbeat", "Registration", "SchedulerClient", "Scheduler", "SchedulerSettings"]
