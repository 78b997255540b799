"""Cluster membership: the scheduler (`scheduler`), its client and the
heartbeat thread (`membership`). Resolved on first use, as the other rooms'
names are: importing a module of the room (the environment's names, the step
file) loads neither the scheduler nor gRPC."""

from __future__ import annotations

from splitrun.splitter.lazy_exports import lazy_exports

_EXPORTS = {
    "Heartbeat": ".membership",
    "Registration": ".membership",
    "SchedulerClient": ".membership",
    "Scheduler": ".scheduler",
    "SchedulerSettings": ".scheduler",
}

__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
