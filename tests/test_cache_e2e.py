"""Embedding-cache mode end to end: real launcher, real processes, real gRPC."""

import pytest
import torch
from cache_models import feeds, make
from cluster import SCRIPTS

from splitrun.runtime import run_threaded
from splitrun.splitter import Cluster, ParameterServerMode, split_program

pytestmark = pytest.mark.slow

CACHE_JOB = SCRIPTS / "cache_job.py"


@pytest.fixture
def launch(local_cluster, tmp_path):
    """Runs CACHE_JOB through the launcher; returns what worker 0 wrote to --out."""
    def launch(name, workers, servers, *args):
        out = tmp_path / f"{name}.pt"
        proc = local_cluster.run(CACHE_JOB, *args, "--out", out, workers=workers, servers=servers)
        return torch.load(out), proc.output()
    return launch


def test_one_worker_two_servers_equal_whole_tables(launch):
    result, output = launch("run", 1, 2, "--steps", 20, "--cache-rows", 40)
    program, batches = make("adagrad", 1, 20, cache_rows=None, sparse_tables=True)
    expected = program.train_unsplit(20, feeds(batches))[1]
    assert result["state"].keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(result["state"][key], value), key
    for counters in result["counters"].values():
        assert counters["evictions"] > 0 and 0 < counters["hit_rate"] < 1
    assert "hit rate" in output  # shown in worker 0's progress


def test_two_workers_equal_parameter_server_mode(launch):
    result, _ = launch("run", 2, 2, "--steps", 20, "--policy", "lfu")
    program, batches = make("adagrad", 2, 20, cache_rows=None, sparse_tables=True)
    split_prog = split_program(program, Cluster(2, 2), ParameterServerMode())
    expected = run_threaded(split_prog, 20, feeds(batches)).state
    for key, value in expected.items():
        assert torch.equal(result["state"][key], value), key


def test_save_writes_dirty_rows_back_and_resumes_with_other_servers(launch, tmp_path):
    checkpoint = tmp_path / "step10.pt"
    launch("first", 1, 1, "--steps", 20, "--stop-after", 10, "--save", checkpoint)
    saved = torch.load(checkpoint, weights_only=True)
    program, batches = make("adagrad", 1, 10, cache_rows=None, sparse_tables=True)
    at_ten = program.train_unsplit(10, feeds(batches))[1]
    # The checkpoint holds the whole, current tables: every dirty row came back.
    for key in ("tables.0.weight", "tables.1.weight"):
        assert torch.equal(saved["model"][key], at_ten[key])
    resumed, _ = launch("resumed", 1, 2, "--steps", 20, "--resume", checkpoint)
    straight, _ = launch("straight", 1, 1, "--steps", 20)
    for key, value in straight["state"].items():
        assert torch.equal(resumed["state"][key], value), key
