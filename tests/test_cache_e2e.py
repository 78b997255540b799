"""Embedding-cache mode end to end: real launcher, real processes, real gRPC."""

import sys

import pytest
import torch
from cluster import JOB_TIMEOUT_S, SCRIPTS, splitrun

sys.path.insert(0, str(SCRIPTS.parent))
from cache_models import feeds, make  # noqa: E402

from splitrun.runtime import run_threaded  # noqa: E402
from splitrun.splitter import Cluster, ParameterServerMode, split_program  # noqa: E402

pytestmark = pytest.mark.slow

CACHE_JOB = SCRIPTS / "cache_job.py"


def launch(tmp_path, name, workers, servers, *args):
    out = tmp_path / f"{name}.pt"
    proc = splitrun("launch", "--workers", workers, "--servers", servers, CACHE_JOB, *args,
                    "--out", out)
    assert proc.wait(JOB_TIMEOUT_S) == 0, proc.output()
    return torch.load(out), proc.output()


def test_one_worker_two_servers_equal_whole_tables(tmp_path):
    result, output = launch(tmp_path, "run", 1, 2, "--steps", 20, "--cache-rows", 40)
    program, batches = make("adagrad", 1, 20, cache_rows=None, sparse_tables=True)
    expected = program.train_unsplit(20, feeds(batches))[1]
    assert result["state"].keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(result["state"][key], value), key
    for counters in result["counters"].values():
        assert counters["evictions"] > 0 and 0 < counters["hit_rate"] < 1
    assert "hit rate" in output  # shown in worker 0's progress


def test_two_workers_equal_parameter_server_mode(tmp_path):
    result, _ = launch(tmp_path, "run", 2, 2, "--steps", 20, "--policy", "lfu")
    program, batches = make("adagrad", 2, 20, cache_rows=None, sparse_tables=True)
    split_prog = split_program(program, Cluster(2, 2), ParameterServerMode())
    expected = run_threaded(split_prog, 20, feeds(batches)).state
    for key, value in expected.items():
        assert torch.equal(result["state"][key], value), key


def test_save_writes_dirty_rows_back_and_resumes_with_other_servers(tmp_path):
    checkpoint = tmp_path / "step10.pt"
    launch(tmp_path, "first", 1, 1, "--steps", 20, "--stop-after", 10, "--save", checkpoint)
    saved = torch.load(checkpoint, weights_only=True)
    program, batches = make("adagrad", 1, 10, cache_rows=None, sparse_tables=True)
    at_ten = program.train_unsplit(10, feeds(batches))[1]
    # The checkpoint holds the whole, current tables: every dirty row came back.
    for key in ("tables.0.weight", "tables.1.weight"):
        assert torch.equal(saved["model"][key], at_ten[key])
    resumed, _ = launch(tmp_path, "resumed", 1, 2, "--steps", 20, "--resume", checkpoint)
    straight, _ = launch(tmp_path, "straight", 1, 1, "--steps", 20)
    for key, value in straight["state"].items():
        assert torch.equal(resumed["state"][key], value), key
