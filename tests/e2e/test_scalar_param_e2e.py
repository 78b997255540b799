"""A 0-dim parameter (a learnable temperature) owned by one process and read
on another, trained through the real launcher: as in one process, and float32
(the functional optimizers and the threaded runs:
tests/splitter/test_scalar_param.py).

Tolerance: none in general mode (the same ops on the same values); 1e-6 in
parameter-server mode (shard gradients sum in another order).
"""

import pytest
import torch
from scalar_models import NUM_STEPS, feeds, make


@pytest.mark.parametrize("mode, optimizer", [("general", "adam"), ("ps", "adagrad")])
def test_scalar_trained_through_the_launcher_equals_one_process(local_cluster, tmp_path, mode,
                                                                optimizer):
    """Real processes, real launcher (tests/support/scripts/scalar_job.py): the scalar
    read on another process stays float32 and 0-dim and ends as in one process."""
    from cluster import SCRIPTS, assert_clean_output

    out = tmp_path / "result.pt"
    servers = 1 if mode == "ps" else 0
    proc = local_cluster.run(SCRIPTS / "scalar_job.py", "--mode", mode, "--optimizer", optimizer,
                             "--out", out, workers=2, servers=servers)
    assert_clean_output(proc)
    result = torch.load(out)
    assert result["steps"] == NUM_STEPS
    owner = {"rank": 1} if mode == "general" else {"role": "server"}
    full, batches = make(owner, optimizer, 8)
    _, expected = full.train_unsplit(NUM_STEPS, feeds(batches))
    assert result["state"].keys() == expected.keys()
    for key, value in expected.items():
        got = result["state"][key]
        assert got.dtype == torch.float32 and got.shape == value.shape, key
        if mode == "general":
            assert torch.equal(got, value), f"{key} differs from one process"
        else:  # shard gradients sum in another order
            torch.testing.assert_close(got, value, rtol=0, atol=1e-6)
    assert result["state"]["log_temp"].dim() == 0
    assert not torch.equal(result["state"]["log_temp"], full.initial_state["log_temp"])
