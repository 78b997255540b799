"""A small recommendation model and click data for the embedding-cache tests."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from splitrun.splitter import RowInit, capture, optim, place, place_embedding_cache
from splitrun.splitter.ops.row_init import whole_table

NUM_TABLES = 2
ROWS = 400
DIM = 4
GLOBAL_BATCH = 16
LOOKUPS = 3  # ids per sample and table

OPTIMIZERS = {"sgd": optim.SGD, "adagrad": optim.Adagrad, "adam": optim.Adam}
# The dense updates as single-tensor chains (the default: multi-tensor calls).
OPTIMIZERS.update({f"{name}_chain": functools.partial(kind, foreach=False)
                   for name, kind in list(OPTIMIZERS.items())})
LR = 0.3


class TinyRecommender(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tables = nn.ModuleList(nn.Embedding(ROWS, DIM) for _ in range(NUM_TABLES))
        self.dense = nn.Linear(3, DIM)
        self.top = nn.Sequential(nn.Linear(DIM * (NUM_TABLES + 1), 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, dense, *ids):
        parts = [self.dense(dense)] + [t(i).sum(1) for t, i in zip(self.tables, ids)]
        return self.top(torch.cat(parts, 1)).squeeze(1)


def click_loss(model, dense, *rest):
    *ids, label = rest
    return F.binary_cross_entropy_with_logits(model(dense, *ids), label)


def click_batches(num_steps: int, seed: int = 0, exponent: float = 1.1,
                  batch: int = GLOBAL_BATCH):
    """Ids drawn from a Zipf-like law (hot rows recur: the cache gets hits and
    must evict), labels from a hidden linear model."""
    generator = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, ROWS + 1, dtype=torch.float64) ** exponent
    batches = []
    for _ in range(num_steps):
        dense = torch.randn(batch, 3, generator=generator)
        ids = [torch.multinomial(weights, batch * LOOKUPS, replacement=True,
                                 generator=generator).reshape(batch, LOOKUPS)
               for _ in range(NUM_TABLES)]
        label = ((dense[:, 0] + 0.01 * ids[0][:, 0] - 0.5) > 0).float()
        batches.append((dense, *ids, label))
    return batches


# The row initializer of the lazy-rows variants (`make(..., lazy_rows=True)`).
LAZY_INIT = RowInit.normal(std=0.5, seed=11)


def make(optimizer: str, num_workers: int, num_steps: int, *, cache_rows: int | None = 48,
         policy: str = "lru", max_staleness: int = 0, sparse_tables: bool = False,
         batch: int = GLOBAL_BATCH, lr: float = LR, lazy_rows: bool = False,
         meta_tables: bool = False):
    """(program for one worker's shard, the global batches). With cache_rows the
    tables are cached; with sparse_tables they are sparse embeddings instead (the
    whole-table and parameter-server references). `lazy_rows`: the tables'
    rows come from `LAZY_INIT`: cached, the servers make them lazily and the
    model's own tables are left at a value no row has (NaN: read, it would
    show); a reference's tables are `whole_table(LAZY_INIT, ...)`.
    `meta_tables` (with `lazy_rows`, cached): the model's tables are on the
    `meta` device, no process holds any of their rows but its servers' own
    (the other layers start as in the other variants)."""
    torch.manual_seed(0)
    model = TinyRecommender()
    place(model, role="server")
    if meta_tables:
        for index in range(NUM_TABLES):
            model.tables[index] = nn.Embedding(ROWS, DIM, device="meta")
    elif lazy_rows:
        with torch.no_grad():
            for index, table in enumerate(model.tables):
                table.weight.copy_(whole_table(LAZY_INIT, ROWS, DIM, f"tables.{index}.weight")
                                   if cache_rows is None else torch.full_like(table.weight,
                                                                              float("nan")))
    if cache_rows is not None:
        place_embedding_cache(model.tables, cache_rows=cache_rows, policy=policy,
                              max_staleness=max_staleness,
                              init=LAZY_INIT if lazy_rows else None)
    for table in model.tables:
        table.sparse = sparse_tables
    batches = click_batches(num_steps, batch=batch)
    shard = batch // num_workers
    program = capture(model, click_loss, OPTIMIZERS[optimizer](lr=lr),
                      tuple(t[:shard] for t in batches[0]))
    return program, batches


def feeds(batches):
    return lambda step: {f"batch.{i}": t for i, t in enumerate(batches[step])}


# -- multi-hot features: cached embedding bags and padding ------------------------

class BagRecommender(nn.Module):
    """Three cached tables as DLRM-style models use them, all padded with id 0:
    a sum bag over flat ids with offsets and per-sample weights, a mean bag
    over fixed-length rows of ids, and a plain embedding."""

    def __init__(self, sparse: bool = False) -> None:
        super().__init__()
        self.tables = nn.ModuleList([
            nn.EmbeddingBag(ROWS, DIM, mode="sum", padding_idx=0, sparse=sparse),
            nn.EmbeddingBag(ROWS, DIM, mode="mean", padding_idx=0, sparse=sparse),
            nn.Embedding(ROWS, DIM, padding_idx=0, sparse=sparse)])
        self.dense = nn.Linear(3, DIM)
        self.top = nn.Sequential(nn.Linear(DIM * 4, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, dense, summed_ids, weights, mean_ids, single_ids):
        num_bags, length = summed_ids.shape
        offsets = torch.arange(0, num_bags * length, length)
        parts = [self.dense(dense),
                 self.tables[0](summed_ids.reshape(-1), offsets,
                                per_sample_weights=weights.reshape(-1)),
                 self.tables[1](mean_ids), self.tables[2](single_ids).sum(1)]
        return self.top(torch.cat(parts, 1)).squeeze(1)


def bag_click_loss(model, dense, summed_ids, weights, mean_ids, single_ids, label):
    return F.binary_cross_entropy_with_logits(
        model(dense, summed_ids, weights, mean_ids, single_ids), label)


def bag_click_batches(num_steps: int, seed: int = 0, batch: int = GLOBAL_BATCH):
    """Zipf ids as `click_batches`, about a fifth of them padding (id 0)."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for dense, first, second, label in click_batches(num_steps, seed, batch=batch):
        padded = []
        for ids in (first, second, (first + second) % ROWS):
            ids = ids.clone()
            ids[torch.rand(ids.shape, generator=generator) < 0.2] = 0
            padded.append(ids)
        weights = torch.rand(first.shape, generator=generator)
        batches.append((dense, padded[0], weights, padded[1], padded[2], label))
    return batches


def make_bags(optimizer: str, num_workers: int, num_steps: int, *,
              cache_rows: int | None = 48, policy: str = "lru", max_staleness: int = 0,
              batch: int = GLOBAL_BATCH, lr: float = LR):
    """As `make`, for `BagRecommender`: cached tables with cache_rows, else
    sparse whole tables (the one-process and parameter-server references)."""
    torch.manual_seed(0)
    model = BagRecommender(sparse=cache_rows is None)
    place(model, role="server")
    if cache_rows is not None:
        place_embedding_cache(model.tables, cache_rows=cache_rows, policy=policy,
                              max_staleness=max_staleness)
    batches = bag_click_batches(num_steps, batch=batch)
    shard = batch // num_workers
    program = capture(model, bag_click_loss, OPTIMIZERS[optimizer](lr=lr),
                      tuple(t[:shard] for t in batches[0]))
    return program, batches


# -- DLRM-style sum bags: the embedding cache's fused kernel --------------------------

class SumBagRecommender(nn.Module):
    """`NUM_SUM_BAG_TABLES` sum bags over fixed-length rows of ids, no padding
    or weights (what FBGEMM's fused bags take), of two widths."""

    def __init__(self, sparse: bool = False) -> None:
        super().__init__()
        self.tables = nn.ModuleList(nn.EmbeddingBag(ROWS, dim, mode="sum", sparse=sparse)
                                    for dim in SUM_BAG_DIMS)
        self.dense = nn.Linear(3, DIM)
        self.top = nn.Sequential(nn.Linear(DIM + sum(SUM_BAG_DIMS), 8), nn.ReLU(),
                                 nn.Linear(8, 1))

    def forward(self, dense, *ids):
        parts = [self.dense(dense)] + [t(i) for t, i in zip(self.tables, ids)]
        return self.top(torch.cat(parts, 1)).squeeze(1)


SUM_BAG_DIMS = (4, 4, 8)
NUM_SUM_BAG_TABLES = len(SUM_BAG_DIMS)


def sum_bag_batches(num_steps: int, seed: int = 0, batch: int = GLOBAL_BATCH):
    batches = []
    for dense, first, second, label in click_batches(num_steps, seed, batch=batch):
        batches.append((dense, first, second, (first * 7 + second) % ROWS, label))
    return batches


def make_sum_bags(optimizer: str, num_workers: int, num_steps: int, *,
                  cache_rows: int | None = 48, policy: str = "lru", max_staleness: int = 0,
                  batch: int = GLOBAL_BATCH, lr: float = LR, dense_on_servers: bool = True):
    """As `make`, for `SumBagRecommender`."""
    torch.manual_seed(0)
    model = SumBagRecommender(sparse=cache_rows is None)
    if dense_on_servers:
        place(model, role="server")
    if cache_rows is not None:
        place_embedding_cache(model.tables, cache_rows=cache_rows, policy=policy,
                              max_staleness=max_staleness)
    batches = sum_bag_batches(num_steps, batch=batch)
    shard = batch // num_workers
    program = capture(model, click_loss, OPTIMIZERS[optimizer](lr=lr),
                      tuple(t[:shard] for t in batches[0]))
    return program, batches
