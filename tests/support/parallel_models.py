"""Models and a harness for the parallel-mode tests: split a captured step
over a group, train it through `run_threaded` and train the unsplit step."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from splitrun.runtime import run_threaded
from splitrun.splitter import Cluster, ParallelLinear, ParallelMode, capture, optim, split_program
from splitrun.splitter.modes.parallel.layout import split_member_key

BATCH, IN, HIDDEN, OUT = 8, 8, 16, 4


class ColumnRowMLP(nn.Module):
    """A column-parallel linear, then a row-parallel one (Megatron's MLP)."""

    def __init__(self, pin_second: bool = True) -> None:
        super().__init__()
        self.l1 = ParallelLinear(IN, HIDDEN, dim=-1)
        self.l2 = ParallelLinear(HIDDEN, OUT, dim=0) if pin_second else nn.Linear(HIDDEN, OUT)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x)))


def mse(model, x, y):
    return nn.functional.mse_loss(model(x), y)


def make_optimizer(name: str):
    return {"sgd": optim.SGD(lr=0.1), "adam": optim.Adam(lr=0.01),
            "adam_chain": optim.Adam(lr=0.01, foreach=False),
            "sgd_momentum": optim.SGD(lr=0.05, momentum=0.9)}[name]


def mlp_batches(num_steps: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    data = [(torch.randn(BATCH, IN, generator=gen), torch.randn(BATCH, OUT, generator=gen))
            for _ in range(num_steps)]
    return lambda step: {"batch.0": data[step][0], "batch.1": data[step][1]}


def capture_mlp(optimizer: str = "adam", pin_second: bool = True, seed: int = 0):
    torch.manual_seed(seed)
    model = ColumnRowMLP(pin_second)
    example = (torch.randn(BATCH, IN), torch.randn(BATCH, OUT))
    return capture(model, mse, make_optimizer(optimizer), example)


@dataclass
class Trained:
    plan: object
    layout: object  # the split's ParallelLayout
    run: object
    full_state: dict
    expected_state: dict
    expected_history: list


def train_both(program, num_workers: int, num_steps: int, batches, **mode_kwargs) -> Trained:
    split = split_program(program, Cluster(num_workers=num_workers), ParallelMode(**mode_kwargs))
    split.lint()
    run = run_threaded(split, num_steps, batches, recv_timeout_s=30)
    history, expected = program.train_unsplit(num_steps, batches)
    return Trained(split.plan, split.artifacts, run,
                   whole_state(split.artifacts, run.state), expected, history)


def whole_state(layout, state: dict) -> dict:
    """`run_threaded`'s final state, which must be whole: every key the
    layout places, none of the members' pieces."""
    pieces = [key for key in state if split_member_key(key) is not None]
    assert not pieces, f"run_threaded returned members' pieces: {pieces}"
    assert set(layout.state) <= set(state)
    return state
