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


# -- multi-hot features: embedding bags and padding ------------------------------

BAG_ROWS = 40
BAG_LENGTH = 5  # ids per sample; id 0 is padding, so bags hold 0 to 5 real ids


class BagNet(nn.Module):
    """Multi-hot features as DLRM-style models write them: a sum bag over a
    flat id list with offsets and per-sample weights, a mean bag over fixed-
    length rows of ids, and a plain embedding; all sparse, all padded with id 0."""

    def __init__(self, rows: int = BAG_ROWS):
        super().__init__()
        self.sum_bag = nn.EmbeddingBag(rows, 6, mode="sum", sparse=True, padding_idx=0)
        self.mean_bag = nn.EmbeddingBag(rows, 6, mode="mean", sparse=True, padding_idx=0)
        self.emb = nn.Embedding(rows, 6, sparse=True, padding_idx=0)
        self.head = nn.Linear(18, 4)

    def forward(self, ids, weights):
        num_bags, length = ids.shape
        offsets = torch.arange(0, num_bags * length, length, device=ids.device)
        summed = self.sum_bag(ids.reshape(-1), offsets, per_sample_weights=weights.reshape(-1))
        return self.head(torch.cat([summed, self.mean_bag(ids), self.emb(ids[:, 0])], 1))


def bag_batches(num_steps: int, batch: int = GLOBAL_BATCH, seed: int = 1):
    """(ids, per-sample weights, labels); about a third of the ids are padding,
    and every batch has a sample whose bags are all padding."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(num_steps):
        ids = torch.randint(1, BAG_ROWS, (batch, BAG_LENGTH), generator=generator)
        ids[torch.rand(batch, BAG_LENGTH, generator=generator) < 0.3] = 0
        ids[batch // 2 - 1] = 0
        weights = torch.rand(batch, BAG_LENGTH, generator=generator)
        batches.append((ids, weights, torch.randint(0, 4, (batch,), generator=generator)))
    return batches


def bag_loss(model, ids, weights, labels):
    return F.cross_entropy(model(ids, weights), labels)


def make_bag(optimizer: str, num_workers: int, num_steps: int):
    """(program for one worker's shard, program on the full batch, global batches)."""
    torch.manual_seed(0)
    model = BagNet()
    place(model, role="server")
    batches = bag_batches(num_steps)
    shard = GLOBAL_BATCH // num_workers
    program = capture(model, bag_loss, OPTIMIZERS[optimizer](),
                      tuple(t[:shard] for t in batches[0]))
    full = capture(model, bag_loss, OPTIMIZERS[optimizer](), batches[0])
    return program, full, batches


def all_feeds(batches):
    return lambda step: {f"batch.{i}": t for i, t in enumerate(batches[step])}
