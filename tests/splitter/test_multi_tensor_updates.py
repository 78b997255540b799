"""foreach=True optimizers run as torch's multi-tensor kernels, grouped per
process: equal to `torch.optim.X(..., foreach=True)` bit for bit given the
same gradients."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from splitrun.runtime import run_threaded
from splitrun.splitter import (
    Cluster,
    ParameterServerMode,
    capture,
    check_plan,
    place,
    split_program,
)
from splitrun.splitter.ops.multi_tensor import foreach_update

NUM_STEPS = 5
OPTIMIZERS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-3,
                                              foreach=True),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=1e-2, foreach=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, foreach=True),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.05, lr_decay=0.01, foreach=True),
}


def _case(name, on_servers=False):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    generator = torch.Generator().manual_seed(4)
    data = [(torch.randn(8, 6, generator=generator),
             torch.randint(0, 3, (8,), generator=generator)) for _ in range(NUM_STEPS)]
    if on_servers:
        place(model, role="server")
    eager = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    eager.load_state_dict(model.state_dict())
    program = capture(model, lambda m, x, y: F.cross_entropy(m(x), y),
                      OPTIMIZERS[name](model.parameters()), data[0], return_grads=True)
    feeds = lambda step: {"batch.0": data[step][0], "batch.1": data[step][1]}  # noqa: E731
    return program, feeds, eager


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_one_worker_equals_torch_foreach_bit_for_bit(name):
    program, feeds, eager = _case(name)
    split = split_program(program, Cluster(num_workers=1))
    check_plan(split.plan, split.program)
    grouped = [n for n in split.program.graph.nodes if n.target is foreach_update]
    assert len(grouped) == 1 and grouped[0].kwargs["num_params"] == 4
    run = run_threaded(split, NUM_STEPS, feeds, recv_timeout_s=30)
    reference = OPTIMIZERS[name](eager.parameters())
    for step in range(NUM_STEPS):
        for key, param in eager.named_parameters():
            param.grad = run.history[step][f"grad.{key}"].clone()
        reference.step()
    for key, param in eager.named_parameters():
        assert torch.equal(run.state[key], param.detach()), key


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("num_servers", [1, 2])
def test_parameter_server_split_equals_unsplit_bit_for_bit(name, num_servers):
    program, feeds, _ = _case(name, on_servers=True)
    split = split_program(program, Cluster(1, num_servers), ParameterServerMode())
    check_plan(split.plan, split.program)
    for proc in split.plan.processes:
        calls = [i for i in proc.schedule if i.target.startswith("foreach_update")]
        assert len(calls) <= 1, f"{proc.label}: one multi-tensor call, got {calls}"
    _, expected_state = program.train_unsplit(NUM_STEPS, feeds)
    run = run_threaded(split, NUM_STEPS, feeds, recv_timeout_s=30)
    for key, value in expected_state.items():
        assert torch.equal(run.state[key], value), key
    assert not torch.equal(run.state["0.weight"], program.initial_state["0.weight"])
