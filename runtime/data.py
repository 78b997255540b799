"""Data sharding: worker r of W trains on its own slice of each global batch."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch

from .errors import SplitrunError

__all__ = ["shard_batch", "shard_batches"]


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


def shard_batches(batches: Iterable, rank: int, num_workers: int) -> Iterator:
    for batch in batches:
        yield shard_batch(batch, rank, num_workers)
