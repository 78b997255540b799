"""A 0-dim parameter (a learnable temperature) owned by one process and read
on another trains exactly as in one process and stays float32, with every
functional optimizer, in general and parameter-server mode.

Tolerance: none in general mode (the same ops on the same values); 1e-6 in
parameter-server mode (shard gradients sum in another order).
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from splitrun.runtime import run_threaded
from splitrun.splitter import Cluster, ParameterServerMode, capture, optim, place, split_program

NUM_STEPS = 8

OPTIMIZERS = {
    "sgd": lambda: optim.SGD(lr=0.1, momentum=0.9, weight_decay=1e-3),
    "adam": lambda: optim.Adam(lr=0.05),
    "adamw": lambda: optim.AdamW(lr=0.05, weight_decay=0.1),
    "adagrad": lambda: optim.Adagrad(lr=0.1),
}


class TemperedClassifier(nn.Module):
    """Logits divided by exp(log_temp): the scalar lives on `owner`, the
    logits (and so the read of the scalar) on worker 0."""

    def __init__(self, owner: dict) -> None:
        super().__init__()
        self.head = place(nn.Linear(6, 3), rank=0)
        self.log_temp = place(nn.Parameter(torch.tensor(0.25)), **owner)

    def forward(self, x):
        return self.head(x) / self.log_temp.exp()


def make(owner: dict, optimizer: str, shard: int):
    torch.manual_seed(0)
    model = TemperedClassifier(owner)
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 6, generator=generator),
                torch.randint(0, 3, (8,), generator=generator)) for _ in range(NUM_STEPS)]
    loss_fn = lambda m, x, y: F.cross_entropy(m(x), y)  # noqa: E731
    example = (batches[0][0][:shard], batches[0][1][:shard])
    return capture(model, loss_fn, OPTIMIZERS[optimizer](), example), batches


def feeds(batches):
    return lambda step: {"batch.0": batches[step][0], "batch.1": batches[step][1]}


def test_update_keeps_the_dtype_of_a_0_dim_parameter():
    for name, make_optimizer in OPTIMIZERS.items():
        functional = make_optimizer()
        param = torch.tensor(0.5, dtype=torch.float32)
        state = functional.init_state(param)
        lr = torch.tensor(0.1, dtype=optim.HPARAM_DTYPE)
        step = torch.tensor(1.0, dtype=optim.HPARAM_DTYPE)
        new, new_state = functional.update(param, torch.tensor(0.3), state, lr, step)
        assert new.dtype == torch.float32, name
        assert all(v.dtype == torch.float32 for v in new_state.values()), name


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_scalar_on_another_worker_equals_one_process(optimizer):
    program, batches = make({"rank": 1}, optimizer, 8)
    plan = split_program(program, Cluster(num_workers=2))
    run = run_threaded(plan, NUM_STEPS, feeds(batches), recv_timeout_s=30)
    history, expected = program.train_unsplit(NUM_STEPS, feeds(batches))
    for key, value in expected.items():
        assert run.state[key].dtype == value.dtype == torch.float32, key
        assert torch.equal(run.state[key], value), f"{key} differs from one process"
    assert not torch.equal(run.state["log_temp"], program.initial_state["log_temp"])


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_scalar_on_a_server_equals_one_process(optimizer):
    program, batches = make({"role": "server"}, optimizer, 4)
    full, _ = make({"role": "server"}, optimizer, 8)
    plan = split_program(program, Cluster(num_workers=2, num_servers=1), ParameterServerMode())
    run = run_threaded(plan, NUM_STEPS, feeds(batches), recv_timeout_s=30)
    _, expected = full.train_unsplit(NUM_STEPS, feeds(batches))
    for key, value in expected.items():
        assert run.state[key].dtype == torch.float32, key
        torch.testing.assert_close(run.state[key], value, rtol=0, atol=1e-6)
    assert run.state["log_temp"].dim() == 0


@pytest.mark.slow
@pytest.mark.parametrize("mode, optimizer", [("general", "adam"), ("ps", "adagrad")])
def test_scalar_trained_through_the_launcher_equals_one_process(local_cluster, tmp_path, mode,
                                                                optimizer):
    """Real processes, real launcher (tests/scripts/scalar_job.py): the scalar
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
