"""The launcher's thread budget: the intra-op thread count each process it
starts is given (torch's default, every core in every process, oversubscribes
a machine as soon as two processes compute). Every process running with it,
through the real launcher: tests/e2e/test_thread_budget_e2e.py."""

import os

import pytest

from splitrun.launcher.child_env import thread_budget
from splitrun.splitter.errors import SplitrunError


def test_the_default_shares_the_cores_among_local_processes(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = os.cpu_count() or 1
    assert thread_budget(None, 1) == cores
    assert thread_budget(None, cores * 4) == 1, "never below one thread"
    assert thread_budget(3, 100) == 3, "an explicit budget wins"
    with pytest.raises(SplitrunError, match="--threads-per-process must be >= 1, got 0"):
        thread_budget(0, 1)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert thread_budget(None, 100) == 3, "the user's OMP_NUM_THREADS wins over the default"
