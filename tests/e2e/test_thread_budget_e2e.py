"""The launcher's thread budget: every process it starts runs with the
intra-op thread count it was given (torch's default, every core in every
process, oversubscribes a machine as soon as two processes compute)."""

import os
import re
import sys

import pytest
from cluster import JOB_TIMEOUT_S, SCRIPTS, Proc, child_env

from splitrun.launcher.failures import count_of


@pytest.mark.parametrize("requested, expected", [(None, None), ("2", 2)])
def test_every_process_runs_with_its_budget(tmp_path, requested, expected):
    extra = [] if requested is None else ["--threads-per-process", requested]
    env = {k: v for k, v in child_env().items()
           if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    proc = Proc([sys.executable, "-m", "splitrun.launcher", "-v", "launch", "--workers", 2,
                 "--servers", 1, *extra, SCRIPTS / "ps_job.py", "--steps", 3,
                 "--out", tmp_path / "out.pt"], env=env)
    assert proc.wait(JOB_TIMEOUT_S) == 0, proc.output()
    cores = os.cpu_count() or 1
    budget = expected if expected is not None else max(1, cores // 3)
    assert f"({count_of(budget, 'thread')} each)" in proc.output()
    reported = dict(re.findall(r"\[(\w+ \d)\].*joined as .*, (\d+) threads, ", proc.output()))
    assert reported == {"worker 0": str(budget), "worker 1": str(budget),
                        "server 0": str(budget)}, proc.output()
