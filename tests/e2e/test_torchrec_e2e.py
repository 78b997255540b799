"""TorchRec's DLRM end to end: real launcher, real processes, real gRPC.

A table pooled by two features trains on 2 workers (cache mode with the MLPs
all-reduced on the workers; parameter-server mode with the MLPs on the
server, fed TorchRec `Batch`es), to plain single-process TorchRec within
1e-5; its checkpoints (a .pt file and an exported sharded directory) load
strictly into a fresh DLRM, their optimizer state into torch's optimizer.
Without TorchRec: a model with an int64 buffer saves with 2 workers and its
dense parameters on them.
"""

import torch
from cluster import SCRIPTS
from torchrec_models import make_dlrm, torchrec_reference

from splitrun.launcher import cli

TORCHREC_JOB = SCRIPTS / "torchrec_job.py"
PS_JOB = SCRIPTS / "ps_job.py"
STEPS = 8


def launch(local_cluster, tmp_path, name, *args):
    out = tmp_path / f"{name}.pt"
    local_cluster.run(TORCHREC_JOB, *args, "--steps", STEPS, "--out", out, workers=2,
                      servers=1)
    return torch.load(out)


def assert_like_torchrec(state, optimizer):
    expected = torchrec_reference(optimizer, STEPS)
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=1e-5, msg=key)


def test_shared_table_in_cache_mode_saves_checkpoints_a_fresh_dlrm_loads_strictly(
        local_cluster, tmp_path):
    plain, sharded = tmp_path / "dlrm.pt", tmp_path / "dlrm-dir"
    result = launch(local_cluster, tmp_path, "cache", "--mode", "cache", "--dense", "worker",
                    "--optimizer", "sgd", "--save", plain, "--save", sharded)
    assert_like_torchrec(result["state"], "sgd")
    assert result["counters"]  # the tables were cached
    exported = tmp_path / "exported.pt"
    assert cli.main(["export", str(sharded), str(exported)]) == 0
    for path in (plain, exported):
        checkpoint = torch.load(path, weights_only=True)
        fresh = make_dlrm()
        fresh.load_state_dict(checkpoint["model"], strict=True)  # no triu_indices
        for key, value in fresh.state_dict().items():
            if key in result["state"] and value.is_floating_point():
                assert torch.equal(value, result["state"][key]), (path, key)
        # Plain SGD keeps no state, and torch still finds the "state" key.
        torch.optim.SGD(fresh.parameters(), lr=0.1).load_state_dict(checkpoint["optimizer"])


def test_shared_table_in_ps_mode_with_dense_on_the_server_from_torchrec_batches(
        local_cluster, tmp_path):
    result = launch(local_cluster, tmp_path, "ps", "--mode", "ps", "--dense", "server",
                    "--optimizer", "adagrad", "--torchrec-batches")
    assert_like_torchrec(result["state"], "adagrad")


def test_int64_buffer_saves_with_two_workers_holding_the_dense_parameters(local_cluster,
                                                                         tmp_path):
    out, checkpoint = tmp_path / "out.pt", tmp_path / "indexed.pt"
    local_cluster.run(PS_JOB, "--kind", "indexed", "--optimizer", "sgd", "--dense", "worker",
                      "--steps", 4, "--save", checkpoint, "--out", out, workers=2, servers=1)
    saved = torch.load(checkpoint, weights_only=True)
    final = torch.load(out)["state"]
    assert saved["model"]["columns"].dtype == torch.int64
    for key, value in saved["model"].items():
        assert torch.equal(value, final[key]), key
