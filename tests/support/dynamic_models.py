"""A small model with a dynamic table (ids any int64) and its reference: the
same model with a bounded table over every id the batches see, its rows
from the same initializer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from splitrun.splitter import (
    DynamicTable,
    RowInit,
    capture,
    optim,
    place,
    place_embedding_cache,
)

DIM = 4
LOOKUPS = 3
GLOBAL_BATCH = 16
LR = 0.3
INIT = RowInit.normal(std=0.5, seed=5)
TABLE = "table.weight"
OPTIMIZERS = {"sgd": optim.SGD, "adagrad": optim.Adagrad}


class HashedIds(nn.Module):
    """A sum bag of hashed ids, then a linear layer."""

    def __init__(self, rows: int = 1, device: str = "meta") -> None:
        super().__init__()
        self.table = nn.EmbeddingBag(rows, DIM, mode="sum", device=device)
        self.top = nn.Linear(DIM, 1)

    def forward(self, ids):
        return self.top(self.table(ids)).squeeze(1)


def click_loss(model, ids, label):
    return F.binary_cross_entropy_with_logits(model(ids), label)


def hashed_batches(num_steps: int, seed: int = 0, batch: int = GLOBAL_BATCH,
                   vocabulary: int = 300) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Ids from a Zipf-like law over `vocabulary` hashed int64 ids (beyond
    2^31 and negative), labels from the ids."""
    generator = torch.Generator().manual_seed(seed)
    hashed = torch.randint(-(1 << 62), 1 << 62, (vocabulary,), generator=generator)
    weights = 1.0 / torch.arange(1, vocabulary + 1, dtype=torch.float64) ** 1.1
    out = []
    for _ in range(num_steps):
        picks = torch.multinomial(weights, batch * LOOKUPS, replacement=True,
                                  generator=generator).reshape(batch, LOOKUPS)
        out.append((hashed[picks], (picks[:, 0] % 2).float()))
    return out


def make_dynamic(optimizer: str, num_workers: int, batches, *,
                 policy: DynamicTable | None = None, cache_policy: str = "lru",
                 max_staleness: int = 0):
    """The program for one worker's share of the batches, its table dynamic
    (`cache_policy` "none": one worker caches no row either; `max_staleness`:
    several workers cache rows read up to that many steps old)."""
    torch.manual_seed(0)
    model = HashedIds()
    place(model.top, role="worker")
    place_embedding_cache(model.table, cache_rows=64, init=INIT, policy=cache_policy,
                          dynamic=policy or DynamicTable(), max_staleness=max_staleness)
    shard = GLOBAL_BATCH // num_workers
    return capture(model, click_loss, OPTIMIZERS[optimizer](lr=LR),
                   tuple(t[:shard] for t in batches[0]))


def train_reference(optimizer: str, batches) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(every id seen, sorted; the trained state) of the captured step run
    unsplit on the model whose table holds one row per id seen (sparse),
    each `INIT`'s row of that id, fed each id's rank among them."""
    seen = torch.unique(torch.cat([ids.reshape(-1) for ids, _ in batches]))
    torch.manual_seed(0)
    model = HashedIds()  # the same top layer as make_dynamic's
    reference = HashedIds(seen.numel(), device="cpu")
    reference.table.sparse = True
    with torch.no_grad():
        reference.top.load_state_dict(model.top.state_dict())
        reference.table.weight.copy_(INIT.rows(seen, DIM, TABLE))
    ranked = [(torch.searchsorted(seen, ids), label) for ids, label in batches]
    program = capture(reference, click_loss, OPTIMIZERS[optimizer](lr=LR), ranked[0])
    return seen, program.train_unsplit(len(ranked), feeds(ranked))[1]


def feeds(batches):
    return lambda step: {f"batch.{i}": t for i, t in enumerate(batches[step])}
