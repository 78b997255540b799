"""Models and data for the parameter-server tests (threaded and launched)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from splitrun.splitter import capture, optim, place

GLOBAL_BATCH = 24

OPTIMIZERS = {
    "sgd_momentum": lambda: optim.SGD(lr=0.1, momentum=0.9, weight_decay=1e-3),
    "adam": lambda: optim.Adam(lr=0.01),
    "adagrad": lambda: optim.Adagrad(lr=0.1),
    # Row-wise updates only: no momentum or weight decay with sparse gradients.
    "sgd": lambda: optim.SGD(lr=0.5),
}


class DenseNet(nn.Module):
    def __init__(self, width: int = 24):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(10, width), nn.ReLU(), nn.Linear(width, width),
                                  nn.Tanh(), nn.Linear(width, 4))

    def forward(self, x):
        return self.body(x)


class SparseNet(nn.Module):
    """A sparse embedding bag (sum of rows) feeding a small head."""

    def __init__(self, rows: int = 40):
        super().__init__()
        self.emb = nn.Embedding(rows, 6, sparse=True)
        self.head = nn.Linear(6, 4)

    def forward(self, ids):
        return self.head(self.emb(ids).sum(1))


def make(kind: str, optimizer: str, num_workers: int, num_steps: int, width: int = 24):
    """(program for one worker's shard, program on the full batch, global batches)."""
    torch.manual_seed(0)
    model = DenseNet(width) if kind == "dense" else SparseNet()
    place(model, role="server")
    generator = torch.Generator().manual_seed(1)
    if kind == "dense":
        batches = [(torch.randn(GLOBAL_BATCH, 10, generator=generator),
                    torch.randint(0, 4, (GLOBAL_BATCH,), generator=generator))
                   for _ in range(num_steps)]
    else:
        batches = [(torch.randint(0, 40, (GLOBAL_BATCH, 5), generator=generator),
                    torch.randint(0, 4, (GLOBAL_BATCH,), generator=generator))
                   for _ in range(num_steps)]
    loss_fn = lambda m, x, y: F.cross_entropy(m(x), y)  # noqa: E731
    shard = GLOBAL_BATCH // num_workers
    program = capture(model, loss_fn, OPTIMIZERS[optimizer](),
                      (batches[0][0][:shard], batches[0][1][:shard]))
    full = capture(model, loss_fn, OPTIMIZERS[optimizer](), batches[0])
    return program, full, batches


def feeds(batches):
    return lambda step: {"batch.0": batches[step][0], "batch.1": batches[step][1]}
