"""Shared test setup. Helper modules (tests/, tests/scripts/) and the examples'
models (examples/) are importable through `pythonpath` in setup.cfg.

Launched jobs are compared with references computed in this process bit for
bit, and a different intra-op thread count sums in a different order. The
launcher takes a user's OMP_NUM_THREADS as its thread budget, so setting it
to this process's count makes every child compute as this process does.
"""

import os

import pytest
import torch
from cluster import LocalCluster

os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))


@pytest.fixture
def local_cluster(tmp_path):
    """Starts `splitrun` processes (in the test's tmp_path) and kills, by pid,
    every one still running when the test ends, whatever its outcome."""
    cluster = LocalCluster(cwd=tmp_path)
    try:
        yield cluster
    finally:
        cluster.close()
