"""Sharded checkpoints end to end: real launcher, real processes. A job saved
with two servers (every process writing its own files) resumes with one and
with three, and ends where the uninterrupted job ends; `splitrun export`
turns the directory into a plain file a plain model loads."""

import json
import os
import subprocess
import sys

import pytest
import torch
from cache_models import make as make_cache
from cluster import REPO, SCRIPTS
from ps_models import make as make_ps

from splitrun.runtime.sharded_checkpoint import CHECKSUMS, METADATA

pytestmark = pytest.mark.slow

PS_JOB = SCRIPTS / "ps_job.py"
CACHE_JOB = SCRIPTS / "cache_job.py"
EXPORT_TIMEOUT_S = 120.0  # one `splitrun export` process: start python, read, write


@pytest.fixture
def launch(local_cluster, tmp_path):
    """Runs a job script through the launcher; returns what worker 0 wrote to --out."""
    def launch(script, name, workers, servers, *args):
        out = tmp_path / f"{name}.pt"
        local_cluster.run(script, *args, "--out", out, workers=workers, servers=servers)
        return torch.load(out)
    return launch


def export(directory, out):
    return subprocess.run([sys.executable, "-m", "splitrun.launcher.cli", "export",
                           str(directory), str(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=EXPORT_TIMEOUT_S)


def written_by(directory) -> set[str]:
    """The processes whose data files the checkpoint lists."""
    lines = (directory / CHECKSUMS).read_text().split("\n")
    names = [line.split()[1] for line in lines if line.strip()]
    return {name.removeprefix("__").rsplit("_", 1)[0] for name in names if name != METADATA}


def assert_equal_states(got, expected, atol):
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=atol, msg=key)


def test_ps_saved_with_two_servers_resumes_with_one_and_three(launch, tmp_path):
    directory = tmp_path / "step10"
    launch(PS_JOB, "first", 2, 2, "--steps", 20, "--stop-after", 10, "--save", directory)
    assert written_by(directory) == {"w0", "s0", "s1"}, "each server wrote its own file"
    straight = launch(PS_JOB, "straight", 2, 2, "--steps", 20)
    for servers in (1, 3):
        resumed = launch(PS_JOB, f"resumed{servers}", 2, servers, "--steps", 20,
                         "--resume", directory)
        assert resumed["steps"] == 20
        assert_equal_states(resumed["state"], straight["state"], atol=1e-6)

    # Export: a plain file a plain model (and optimizer) loads.
    out = tmp_path / "model.pt"
    result = export(directory, out)
    assert result.returncode == 0, result.stderr
    plain = torch.load(out, weights_only=True)
    assert plain["step"] == 10
    _, full, _ = make_ps("dense", "adam", 1, 20)
    model = full.module if hasattr(full, "module") else None
    program, _, _ = make_ps("dense", "adam", 2, 20)
    assert set(plain["model"]) == {k for k in program.initial_state
                                   if not k.endswith(("exp_avg", "exp_avg_sq"))}
    if model is not None:
        model.load_state_dict(plain["model"])


def test_cache_saved_with_two_servers_resumes_with_one_and_three(launch, tmp_path):
    directory = tmp_path / "step10"
    launch(CACHE_JOB, "first", 1, 2, "--steps", 20, "--stop-after", 10, "--save", directory)
    assert written_by(directory) == {"w0", "s0", "s1", "s0-rows", "s1-rows"}
    straight = launch(CACHE_JOB, "straight", 1, 2, "--steps", 20)
    for servers in (1, 3):
        resumed = launch(CACHE_JOB, f"resumed{servers}", 1, servers, "--steps", 20,
                         "--resume", directory)
        for key, value in straight["state"].items():
            assert torch.equal(resumed["state"][key], value), key

    out = tmp_path / "model.pt"
    result = export(directory, out)
    assert result.returncode == 0, result.stderr
    plain = torch.load(out, weights_only=True)
    program, batches = make_cache("adagrad", 1, 10, cache_rows=None, sparse_tables=True)
    from cache_models import feeds
    at_ten = program.train_unsplit(10, feeds(batches))[1]
    for key in ("tables.0.weight", "tables.1.weight"):  # back in id order
        assert torch.equal(plain["model"][key], at_ten[key]), key
    json.dumps(plain["splitrun"])
    os.fspath(out)
