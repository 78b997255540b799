"""The job a user's script runs: joining it (`Job.from_env`, `joining`),
this process's membership (`member`), the training loop and finishing
(`trainer`), the settings (`settings`), what the loop reports (`metrics`,
`progress`), which batches each worker takes (`data`), and every process of a
plan as a thread of one process (`threaded`).

    from splitrun.runtime.job import Job
"""

from __future__ import annotations

from splitrun.splitter.lazy_exports import lazy_exports

_EXPORTS = {
    "ENV": ".job",
    "Job": ".job",
    "JobSettings": ".job",
    "PlanWritten": ".job",
    "Trainer": ".job",
    "pick_device": ".job",
    "report_uncaught": ".job",
    "ThreadedRun": ".threaded",
    "run_threaded": ".threaded",
}

__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
