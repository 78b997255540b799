"""A split program computes exactly what the unsplit step computes.

Tolerance: none. The split runs the same aten ops on the same values in the
same order per value, so losses, gradients and parameters are compared with
`torch.equal` after every one of 10+ steps.
"""

import pytest
import torch
import torch.nn.functional as F
from models import TiedBigramLM, lm_loss, markov_batches
from torch import nn

from splitrun.runtime import run_threaded
from splitrun.splitter import Cluster, capture, check_plan, optim, place, split, split_program

NUM_STEPS = 10

OPTIMIZERS = {
    "sgd_momentum": lambda: optim.SGD(lr=0.05, momentum=0.9, weight_decay=1e-3),
    "adam": lambda: optim.Adam(lr=0.01),
    "adagrad": lambda: optim.Adagrad(lr=0.05),
    # The others' updates are multi-tensor calls, grouped per stage (one stage
    # holds both ends of the tied embedding); this one's the single-tensor chain.
    "adam_chain": lambda: optim.Adam(lr=0.01, foreach=False),
}


class PipelineMLP(nn.Module):
    """Three stages, one per worker; the loss runs on worker 0, so the logits
    come back to worker 0 and their gradient goes out again."""

    def __init__(self, num_workers: int) -> None:
        super().__init__()
        self.stages = nn.ModuleList([
            nn.Sequential(nn.Linear(12, 32), nn.ReLU()),
            nn.Sequential(nn.Linear(32, 32), nn.GELU()),
            nn.Linear(32, 5),
        ])
        for index, stage in enumerate(self.stages):
            place(stage, rank=min(index, num_workers - 1))

    def forward(self, x):
        for stage in self.stages:
            x = stage(x)
        return x


def mlp_loss(model, x, y):
    return F.cross_entropy(model(x), y)


def mlp_case(num_workers):
    torch.manual_seed(1)
    model = PipelineMLP(num_workers)
    generator = torch.Generator().manual_seed(2)
    data = [(torch.randn(16, 12, generator=generator),
             torch.randint(0, 5, (16,), generator=generator)) for _ in range(NUM_STEPS)]
    return model, mlp_loss, data


def lm_case(num_workers):
    torch.manual_seed(1)
    return TiedBigramLM(num_workers=num_workers), lm_loss, markov_batches(NUM_STEPS, batch=8)


CASES = {"pipeline_mlp": mlp_case, "tied_lm": lm_case}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("num_workers", [2, 3])
@pytest.mark.parametrize("case", sorted(CASES))
def test_split_equals_unsplit(case, num_workers, optimizer):
    model, loss_fn, data = CASES[case](num_workers)
    program = capture(model, loss_fn, OPTIMIZERS[optimizer](), data[0], return_grads=True)
    split_prog = split_program(program, Cluster(num_workers=num_workers))
    plan = split_prog.plan
    check_plan(plan, split_prog.program)  # the program the plan's names refer to
    busy = [p for p in plan.processes if p.num_ops]
    assert len(busy) == num_workers, "every worker must hold part of the step"

    feeds = lambda step: {"batch.0": data[step][0], "batch.1": data[step][1]}  # noqa: E731
    expected_history, expected_state = program.train_unsplit(NUM_STEPS, feeds)
    run = run_threaded(split_prog, NUM_STEPS, feeds, recv_timeout_s=30)

    for step in range(NUM_STEPS):
        assert run.history[step].keys() == expected_history[step].keys()
        for key, value in expected_history[step].items():
            assert torch.equal(run.history[step][key], value), f"step {step}: {key} differs"
    assert run.state.keys() == expected_state.keys()
    for key, value in expected_state.items():
        assert torch.equal(run.state[key], value), f"state {key} differs"
    # The parameters really moved: the comparison is not between two no-ops.
    assert not torch.equal(run.state["stages.0.0.weight" if case == "pipeline_mlp"
                                     else "embed.weight"],
                           program.initial_state["stages.0.0.weight" if case == "pipeline_mlp"
                                                 else "embed.weight"])


def test_tied_weight_reaches_its_reader_by_data_sync():
    model, loss_fn, data = lm_case(3)
    program = capture(model, loss_fn, optim.Adam(lr=0.01), data[0])
    plan = split(program, Cluster(num_workers=3))
    syncs = {(s.key, str(s.owner), str(s.reader)) for s in plan.data_syncs}
    assert ("embed.weight", "w0", "w2") in syncs
    assert "embed.weight" in plan.process(plan.labels[0]).state


def test_edges_go_back_to_an_earlier_process():
    model, loss_fn, data = mlp_case(3)
    program = capture(model, loss_fn, optim.SGD(lr=0.1), data[0])
    plan = split(program, Cluster(num_workers=3))
    pairs = {(str(c.src), str(c.dst)) for c in plan.channels}
    assert {("w0", "w1"), ("w1", "w2"), ("w2", "w0"), ("w2", "w1"), ("w1", "w0")} <= pairs


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_unsplit_step_tracks_eager_pytorch(name):
    """The captured step against plain PyTorch training (tolerance 1e-6: the
    functional update may round differently from torch's fused kernels)."""
    model, loss_fn, data = mlp_case(2)
    eager = PipelineMLP(2)
    eager.load_state_dict(model.state_dict())
    functional = OPTIMIZERS[name]()
    torch_cls = {"sgd_momentum": torch.optim.SGD, "adam": torch.optim.Adam,
                 "adam_chain": torch.optim.Adam, "adagrad": torch.optim.Adagrad}[name]
    kwargs = {k: getattr(functional, k) for k in
              {"sgd_momentum": ("lr", "momentum", "weight_decay"), "adam": ("lr", "betas", "eps"),
               "adam_chain": ("lr", "betas", "eps"), "adagrad": ("lr", "eps")}[name]}
    torch_opt = torch_cls(eager.parameters(), foreach=False, **kwargs)
    program = capture(model, loss_fn, functional, data[0])
    _, state = program.train_unsplit(
        NUM_STEPS, lambda s: {"batch.0": data[s][0], "batch.1": data[s][1]})
    for step in range(NUM_STEPS):
        torch_opt.zero_grad()
        loss_fn(eager, *data[step]).backward()
        torch_opt.step()
    for key, param in eager.named_parameters():
        torch.testing.assert_close(state[key], param.detach(), rtol=0, atol=1e-6)
