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


def _assert_equals_torch_given_its_gradients(split, feeds, eager, name):
    """The split's state after NUM_STEPS equals torch's optimizer `name` fed
    the split's own gradients, bit for bit."""
    run = run_threaded(split, NUM_STEPS, feeds, recv_timeout_s=30)
    reference = OPTIMIZERS[name](eager.parameters())
    for step in range(NUM_STEPS):
        for key, param in eager.named_parameters():
            param.grad = run.history[step][f"grad.{key}"].clone()
        reference.step()
    for key, param in eager.named_parameters():
        assert torch.equal(run.state[key], param.detach()), key


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_one_worker_equals_torch_foreach_bit_for_bit(name):
    program, feeds, eager = _case(name)
    split = split_program(program, Cluster(num_workers=1))
    check_plan(split.plan, split.program)
    grouped = [n for n in split.program.graph.nodes if n.target is foreach_update]
    assert len(grouped) == 1 and grouped[0].kwargs["num_params"] == 4
    _assert_equals_torch_given_its_gradients(split, feeds, eager, name)


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


# (torch optimizer, foreach_update's settings) with every branch of the three
# algorithms: weight decay coupled and decoupled, maximize, nesterov, lr decay.
CPU_DEFAULT_CASES = {
    "sgd_nesterov": (lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-3,
                                               nesterov=True),
                     dict(optimizer="SGD", momentum=0.9, dampening=0.0, weight_decay=1e-3,
                          nesterov=True, maximize=False), 0.05),
    "sgd_plain_maximize": (lambda p: torch.optim.SGD(p, lr=0.05, maximize=True),
                           dict(optimizer="SGD", momentum=0.0, dampening=0.0, weight_decay=0.0,
                                nesterov=False, maximize=True), 0.05),
    "adam_decay": (lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=1e-2),
                   dict(optimizer="Adam", betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                        maximize=False), 0.01),
    "adamw_maximize": (lambda p: torch.optim.AdamW(p, lr=0.01, maximize=True),
                       dict(optimizer="AdamW", betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                            maximize=True), 0.01),
    "adagrad_decay": (lambda p: torch.optim.Adagrad(p, lr=0.05, lr_decay=0.01, weight_decay=1e-3),
                      dict(optimizer="Adagrad", lr_decay=0.01, weight_decay=1e-3, eps=1e-10,
                           maximize=False, initial_accumulator_value=0.0), 0.05),
}


@pytest.mark.parametrize("name", sorted(CPU_DEFAULT_CASES))
def test_the_multi_tensor_update_equals_torchs_cpu_default_bit_for_bit(name):
    # torch's default on the CPU is its single-tensor loop (foreach=None ->
    # False); the multi-tensor kernels loop over the same kernels with the
    # same scalars, so 7 steps of 3 parameters agree to the bit.
    make, settings, lr = CPU_DEFAULT_CASES[name]
    generator = torch.Generator().manual_seed(5)
    shapes = [(16, 6), (16,), (3, 16)]
    params = [nn.Parameter(torch.randn(s, generator=generator)) for s in shapes]
    reference = make(params)
    ours = [p.detach().clone() for p in params]
    num_slots = {"SGD": 1 if settings.get("momentum") else 0, "Adagrad": 1}.get(
        settings["optimizer"], 2)
    state = [[torch.zeros(s) for s in shapes] for _ in range(num_slots)]
    for step in range(1, 8):
        grads = [torch.randn(s, generator=generator) for s in shapes]
        for param, grad in zip(params, grads):
            param.grad = grad.clone()
        reference.step()
        given = [g.clone() for g in grads]
        out = foreach_update(*ours, *given, *[t for slot in state for t in slot],
                             torch.tensor(lr, dtype=torch.float64),
                             torch.tensor(float(step), dtype=torch.float64),
                             num_params=3, **settings)
        assert all(torch.equal(g, h) for g, h in zip(given, grads)), "a gradient was written"
        ours = list(out[:3])
        state = [list(out[3 + 3 * j:6 + 3 * j]) for j in range(num_slots)]
        for key, (mine, theirs) in enumerate(zip(ours, params)):
            assert torch.equal(mine, theirs.detach()), f"step {step}, parameter {key}"


def test_on_meta_tensors_the_update_gives_shapes_only():
    params = [torch.empty(4, 3, device="meta"), torch.empty(4, device="meta")]
    out = foreach_update(*params, *params, *params, *params,
                         torch.empty((), dtype=torch.float64, device="meta"),
                         torch.empty((), dtype=torch.float64, device="meta"),
                         optimizer="Adam", num_params=2, betas=(0.9, 0.999), eps=1e-8,
                         weight_decay=0.0, maximize=False)
    assert [tuple(t.shape) for t in out] == [(4, 3), (4,)] * 3
    assert all(t.is_meta for t in out)


def test_a_group_holds_at_most_group_bytes_of_parameters(monkeypatch):
    # 16x6 + 16 floats, then 3x16 + 3: a cap of 100 floats splits the four
    # parameters into [0.weight], [0.bias, 2.weight, 2.bias]; the bits are the same.
    from splitrun.splitter.splitting import update_groups
    monkeypatch.setattr(update_groups, "GROUP_BYTES", 100 * 4)
    program, feeds, eager = _case("adam")
    split = split_program(program, Cluster(num_workers=1))
    check_plan(split.plan, split.program)
    grouped = sorted(n.kwargs["num_params"] for n in split.program.graph.nodes
                     if n.target is foreach_update)
    assert grouped == [1, 3]
    _assert_equals_torch_given_its_gradients(split, feeds, eager, "adam")
