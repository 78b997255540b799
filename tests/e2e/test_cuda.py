"""The CUDA path end to end: the real launcher with `--device cuda`, real
processes sharing the machine's GPUs (cuda:LOCAL_RANK modulo the GPUs).

Skipped without a CUDA device (CI has none). References are computed in this
process on the CPU; CUDA's kernels sum in another order than the CPU's, so
results agree to TOLERANCE, not bit for bit.
"""

import re

import pytest
import torch
from cache_models import feeds as cache_feeds
from cache_models import make as make_cache
from cluster import JOB_TIMEOUT_S, REPO, SCRIPTS
from parallel_models import capture_mlp, mlp_batches
from ps_models import feeds as ps_feeds
from ps_models import make as make_ps

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TOLERANCE = 1e-4
EXAMPLES = REPO / "examples"


def launch_on_cuda(local_cluster, script, *args, workers, servers=0, expect_code=0):
    proc = local_cluster.start("launch", "--device", "cuda", "--workers", workers,
                               "--servers", servers, script, *args)
    code = proc.wait(JOB_TIMEOUT_S)
    if expect_code == 0:
        assert code == 0, f"{' '.join(proc.argv)} exited with {code}:\n{proc.output()}"
    else:
        assert code != 0, f"{' '.join(proc.argv)} succeeded:\n{proc.output()}"
    return proc


def assert_state_close(state, expected):
    assert set(expected) <= set(state), set(expected) - set(state)
    for key, value in expected.items():
        torch.testing.assert_close(state[key].cpu(), value, rtol=0, atol=TOLERANCE,
                                   msg=lambda text, key=key: f"{key}: {text}")


def test_main_job_reaches_its_accuracy_on_cuda(local_cluster):
    proc = launch_on_cuda(local_cluster, EXAMPLES / "ps_train.py", "--epochs", 3,
                          "--min-accuracy", 0.9, workers=2, servers=1)
    accuracy = float(re.search(r"held-out accuracy: ([0-9.]+)", proc.output()).group(1))
    assert accuracy >= 0.9


def test_pipeline_example_on_cuda_agrees_with_the_unsplit_step(local_cluster):
    proc = launch_on_cuda(local_cluster, EXAMPLES / "pipeline_split.py", "--steps", 15,
                          workers=3)
    assert "of the unsplit run on the CPU" in proc.output()


@pytest.mark.parametrize("kind, optimizer", [("dense", "adam"), ("sparse", "adagrad")])
def test_parameter_server_on_cuda_equals_one_process(local_cluster, tmp_path, kind, optimizer):
    out = tmp_path / "run.pt"
    launch_on_cuda(local_cluster, SCRIPTS / "ps_job.py", "--kind", kind, "--optimizer",
                   optimizer, "--steps", 20, "--out", out, workers=2, servers=2)
    result = torch.load(out, map_location="cpu")
    assert result["device"].startswith("cuda")
    full, batches = make_ps(kind, optimizer, 1, 20)
    assert_state_close(result["state"], full.train_unsplit(20, ps_feeds(batches))[1])


def test_embedding_cache_on_cuda_equals_whole_tables(local_cluster, tmp_path):
    out = tmp_path / "run.pt"
    launch_on_cuda(local_cluster, SCRIPTS / "cache_job.py", "--steps", 20, "--cache-rows", 40,
                   "--out", out, workers=1, servers=2)
    result = torch.load(out, map_location="cpu")
    assert result["device"].startswith("cuda")
    program, batches = make_cache("adagrad", 1, 20, cache_rows=None, sparse_tables=True)
    assert_state_close(result["state"], program.train_unsplit(20, cache_feeds(batches))[1])
    for counters in result["counters"].values():
        assert counters["evictions"] > 0 and 0 < counters["hit_rate"] < 1


def test_parallel_mode_on_cuda_equals_the_unsplit_step(local_cluster, tmp_path):
    out = tmp_path / "run.pt"
    launch_on_cuda(local_cluster, SCRIPTS / "parallel_job.py", "--steps", 10, "--out", out,
                   "--backend", "channels", workers=2)
    result = torch.load(out, map_location="cpu")
    assert result["device"].startswith("cuda")
    history, expected = capture_mlp("adam").train_unsplit(10, mlp_batches(10))
    assert_state_close(result["state"], expected)
    torch.testing.assert_close(result["losses"].cpu(), torch.stack([h["loss"] for h in history]),
                               rtol=0, atol=TOLERANCE)


def test_parallel_mode_on_nccl(local_cluster, tmp_path):
    """NCCL runs one member of a group per GPU: with fewer GPUs than members
    the job is refused before NCCL is asked, naming the members that would
    share a GPU; with enough GPUs it equals the unsplit step."""
    out = tmp_path / "run.pt"
    shared = torch.cuda.device_count() < 2
    proc = launch_on_cuda(local_cluster, SCRIPTS / "parallel_job.py", "--steps", 10, "--out",
                          out, "--backend", "torch_distributed", workers=2,
                          expect_code=1 if shared else 0)
    if shared:
        assert "members 0 and 1 would share one GPU" in proc.output()
        assert "channels backend" in proc.output()
        return
    result = torch.load(out, map_location="cpu")
    assert result["collective_calls"] == 10
    assert_state_close(result["state"], capture_mlp("adam").train_unsplit(10, mlp_batches(10))[1])
