"""Data sharding: worker r of W trains on its own slice of each global batch.

In-memory global batches are sliced (`shard_batch`). A source that can read
one worker's shard by itself (a `ShardedSource`, such as
`runtime.datasets.CriteoFile`) is asked for it instead, so no worker builds
the global batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Protocol, runtime_checkable

import torch

from ..errors import SplitrunError

__all__ = ["ShardedSource", "shard_batch", "shard_batches"]


def _slice(tensor: torch.Tensor, rank: int, num_workers: int, where: str) -> torch.Tensor:
    rows = tensor.shape[0] if tensor.dim() else 0
    if rows % num_workers:
        raise SplitrunError(
            f"{where} has {rows} rows, which {num_workers} workers cannot share evenly; use a "
            f"global batch size divisible by {num_workers} (drop the last partial batch)")
    size = rows // num_workers
    return tensor[rank * size:(rank + 1) * size]


def shard_batch(batch, rank: int, num_workers: int):
    """Rows [r*B/W, (r+1)*B/W) of every tensor of `batch` (a tensor, a sequence
    or a mapping of tensors); the shards of all workers make up the batch."""
    if isinstance(batch, torch.Tensor):
        return _slice(batch, rank, num_workers, "the batch")
    if isinstance(batch, Mapping):
        return {k: _slice(v, rank, num_workers, f"batch[{k!r}]") for k, v in batch.items()}
    if isinstance(batch, Sequence):
        return type(batch)(_slice(t, rank, num_workers, f"batch item {i}")
                           for i, t in enumerate(batch))
    raise SplitrunError(f"cannot shard a batch of type {type(batch).__name__}; pass tensors")


@runtime_checkable
class ShardedSource(Protocol):
    """A source of global batches that gives worker `rank` of `num_workers`
    its rows [r*B/W, (r+1)*B/W) of each, reading only those."""

    def worker_shard(self, rank: int, num_workers: int) -> Iterable: ...


def shard_batches(batches: Iterable, rank: int, num_workers: int) -> Iterator:
    """Worker `rank`'s shard of every global batch of `batches`: read by the
    source itself where it is a `ShardedSource`, else sliced from each batch."""
    if isinstance(batches, ShardedSource):
        return iter(batches.worker_shard(rank, num_workers))
    return (shard_batch(batch, rank, num_workers) for batch in batches)
