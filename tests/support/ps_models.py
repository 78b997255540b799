"""Models and data for the parameter-server tests (threaded and launched)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

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


class IndexedNet(SparseNet):
    """SparseNet reading its rows' columns through an int64 buffer (a
    permutation, as DLRM's `triu_indices` indexes its interactions)."""

    def __init__(self, rows: int = 40):
        super().__init__(rows)
        self.register_buffer("columns", torch.tensor([5, 4, 3, 2, 1, 0]))

    def forward(self, ids):
        return self.head(self.emb(ids).sum(1)[:, self.columns])


def global_batches(kind: str, num_steps: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The global batches, drawn one at a time in step order from one seeded
    generator: the same values whether listed or drawn as a job reaches them."""
    generator = torch.Generator().manual_seed(1)
    for _ in range(num_steps):
        if kind == "dense":
            yield (torch.randn(GLOBAL_BATCH, 10, generator=generator),
                   torch.randint(0, 4, (GLOBAL_BATCH,), generator=generator))
        else:
            yield (torch.randint(0, 40, (GLOBAL_BATCH, 5), generator=generator),
                   torch.randint(0, 4, (GLOBAL_BATCH,), generator=generator))


def make(kind: str, optimizer: str, num_workers: int, num_steps: int, width: int = 24, *,
         lazy: bool = False):
    """(program for one worker's shard, global batches). With num_workers=1 the
    program takes the whole batch: the unsplit reference. One capture only:
    every process of a launched job calls this. `lazy`: the batches as an
    iterator that draws each when reached (a job killed long before its last
    step, as the fault tests' 200000-step jobs are, draws only those it ran)."""
    torch.manual_seed(0)
    model = {"dense": lambda: DenseNet(width), "sparse": SparseNet, "indexed": IndexedNet}[kind]()
    place(model, role="server")
    batches = global_batches(kind, num_steps)
    first = next(batches)
    loss_fn = lambda m, x, y: F.cross_entropy(m(x), y)  # noqa: E731
    shard = GLOBAL_BATCH // num_workers
    program = capture(model, loss_fn, OPTIMIZERS[optimizer](),
                      (first[0][:shard], first[1][:shard]))
    batches = itertools.chain([first], batches)
    return program, (batches if lazy else list(batches))


def feeds(batches):
    return lambda step: {"batch.0": batches[step][0], "batch.1": batches[step][1]}


# The OPTIMIZERS as plain torch.optim optimizers, for references run eagerly.
TORCH_OPTIMIZERS = {
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9,
                                                   weight_decay=1e-3),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
}


def keys_read(plan, label, channel_versions: dict) -> dict[int, dict[str, int]]:
    """Per step, the version of each state key that worker `label` read,
    from its `ExecutorStats.channel_versions_read` (JSON-style keys allowed)."""
    keys_of: dict[str, list[str]] = {}
    for sync in plan.data_syncs:
        if sync.reader == label:
            keys_of.setdefault(sync.channel, []).append(sync.key)
    return {int(step): {key: version for channel, version in channels.items()
                        for key in keys_of[channel]}
            for step, channels in channel_versions.items()}


def stale_reference(program, optimizer: str, batches, versions: list[dict[int, dict[str, int]]]):
    """The staleness rule (splitter/ps_mode.py) run eagerly in one process,
    with torch autograd and a torch.optim optimizer: version v is the state
    after the updates of steps 0 .. v-1; the update of step c is the mean over
    the W workers of worker w's gradient on its shard of batch c at the
    versions `versions[w][c]` (state key -> version) it read. Returns (losses,
    parameters): losses[w][c] is worker w's step-c loss, parameters the final
    ones, by state key."""
    torch.manual_seed(0)
    model = DenseNet()
    model.load_state_dict({key: program.initial_state[key] for key in model.state_dict()})
    step_with = TORCH_OPTIMIZERS[optimizer](model.parameters())
    history = [{key: p.detach().clone() for key, p in model.named_parameters()}]
    workers = len(versions)
    losses = [[] for _ in range(workers)]
    for step, (x, y) in enumerate(batches):
        shard = x.shape[0] // workers
        total = None
        for rank in range(workers):
            read = {key: history[version][key].clone().requires_grad_()
                    for key, version in versions[rank][step].items()}
            rows = slice(rank * shard, (rank + 1) * shard)
            loss = F.cross_entropy(torch.func.functional_call(model, read, (x[rows],)), y[rows])
            losses[rank].append(loss.item())
            grads = torch.autograd.grad(loss, list(read.values()))
            grads = dict(zip(read, grads))
            total = grads if total is None else {k: total[k] + g for k, g in grads.items()}
        for key, p in model.named_parameters():
            p.grad = total[key] / workers
        step_with.step()
        history.append({key: p.detach().clone() for key, p in model.named_parameters()})
    return losses, history[-1]


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
    """(program for one worker's shard, global batches); with num_workers=1 the
    program takes the whole batch."""
    torch.manual_seed(0)
    model = BagNet()
    place(model, role="server")
    batches = bag_batches(num_steps)
    shard = GLOBAL_BATCH // num_workers
    program = capture(model, bag_loss, OPTIMIZERS[optimizer](),
                      tuple(t[:shard] for t in batches[0]))
    return program, batches


def all_feeds(batches):
    return lambda step: {f"batch.{i}": t for i, t in enumerate(batches[step])}
