"""Small random models for property tests of parallel mode's propagation:
chains and residual blocks of linears, layer norms, activations and
embeddings, ending in a loss, with pins at random (parallel layers of either
kind, `constrain` on activations). `capture_random_model(draw)` takes
hypothesis's `draw` (from `st.data()`) and returns a captured step and a
group size; every dimension divides by 4, so every pin is feasible at 2 and
4 ranks."""

from __future__ import annotations

import torch
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F

from splitrun.splitter import (
    ParallelCrossEntropyLoss,
    ParallelEmbedding,
    ParallelLinear,
    capture,
    constrain,
    optim,
)

BATCH, VOCAB = 8, 16
WIDTHS = (8, 16)
CLASSES = 4
ACTIVATIONS = {"relu": torch.relu, "tanh": torch.tanh, "gelu": F.gelu}
PINS = (None, "R", "S(0)", "S(1)")


def _linear(draw, width_in: int, width_out: int) -> nn.Linear:
    dim = draw(st.sampled_from(["plain", -1, 0, None]))
    if dim == "plain":
        return nn.Linear(width_in, width_out)
    return ParallelLinear(width_in, width_out, dim=dim)


class RandomModel(nn.Module):
    """Runs `steps`, a list of (kind, argument) the draw chose, in order."""

    def __init__(self, draw, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList()
        self.steps: list[tuple[str, object]] = []
        self.uses_ids = draw(st.booleans())
        width = draw(st.sampled_from(WIDTHS))
        if self.uses_ids:
            dim = draw(st.sampled_from(["plain", 0, 1]))
            self._add("module", nn.Embedding(VOCAB, width) if dim == "plain"
                      else ParallelEmbedding(VOCAB, width, dim=dim))
        self.width_in = width
        for _ in range(num_layers):
            kind = draw(st.sampled_from(["linear", "norm", "activation", "residual", "pin"]))
            if kind == "linear":
                out = draw(st.sampled_from(WIDTHS))
                self._add("module", _linear(draw, width, out))
                width = out
            elif kind == "norm":
                self._add("module", nn.LayerNorm(width))
            elif kind == "activation":
                self.steps.append(("activation", draw(st.sampled_from(sorted(ACTIVATIONS)))))
            elif kind == "residual":
                hidden = draw(st.sampled_from(WIDTHS))
                block = nn.Sequential(_linear(draw, width, hidden), nn.ReLU(),
                                      _linear(draw, hidden, width))
                self._add("residual", block)
            else:
                pin = draw(st.sampled_from(PINS))
                if pin is not None:
                    self.steps.append(("pin", pin))
        self._add("module", _linear(draw, width, CLASSES))
        self.loss = draw(st.sampled_from(["cross_entropy", "parallel_cross_entropy", "mse"]))

    def _add(self, kind: str, module: nn.Module) -> None:
        self.layers.append(module)
        self.steps.append((kind, len(self.layers) - 1))

    def forward(self, x):
        for kind, argument in self.steps:
            if kind == "module":
                x = self.layers[argument](x)
            elif kind == "residual":
                x = x + self.layers[argument](x)
            elif kind == "activation":
                x = ACTIVATIONS[argument](x)
            else:
                x = constrain(x, argument)
        return x


def loss_of(model: RandomModel, x, y):
    logits = model(x)
    if model.loss == "mse":
        return F.mse_loss(logits, y)
    if model.loss == "parallel_cross_entropy":
        return ParallelCrossEntropyLoss()(logits, y)
    return F.cross_entropy(logits, y)


def capture_random_model(draw):
    """(a captured step of a random model, a group size of 2 or 4)."""
    torch.manual_seed(0)
    model = RandomModel(draw, draw(st.integers(min_value=1, max_value=4)))
    x = (torch.randint(0, VOCAB, (BATCH,)) if model.uses_ids
         else torch.randn(BATCH, model.width_in))
    y = (torch.randn(BATCH, CLASSES) if model.loss == "mse"
         else torch.randint(0, CLASSES, (BATCH,)))
    optimizer = draw(st.sampled_from([optim.SGD(lr=0.1), optim.Adam(lr=0.01)]))
    program = capture(model, loss_of, optimizer, (x, y))
    return program, draw(st.sampled_from([2, 4]))
