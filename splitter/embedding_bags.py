"""Sparse `nn.EmbeddingBag`s as capture sees them: a lookup and a reduction.

While a step is traced, every embedding bag with a sparse gradient (its own
`sparse=True`, or a cached table) runs as `F.embedding` of all its ids
(sparse, without padding) followed by per-bag sums: per-sample weights
multiply the rows, padding ids' rows are masked out (and left out of a mean's
count), and `index_add` sums each bag. Its gradient is then the lookup's:
`(ids, values)` with one row per id, which parameter-server mode averages,
the row-wise optimizers apply (skipping the padding row), and embedding-cache
mode serves from the cache like any lookup.

Why not torch's own bag op: its sparse backward has no static-shape form
(torch's CPU fast path returns an empty `offset2bag`, and the fake kernel of
its backward with per-sample weights then fails), and the lookup-plus-sum
form needs nothing new from the splitter or the runtime.
"""

from __future__ import annotations

import contextlib
import types

import torch
import torch.nn.functional as F
from torch import nn

from .errors import CaptureError

__all__ = ["bags_as_lookups", "bag_as_lookup"]


def bag_as_lookup(bag: nn.EmbeddingBag, input: torch.Tensor, offsets: torch.Tensor | None = None,
                  per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
    """`bag(input, offsets, per_sample_weights)` (modes sum and mean), as a
    sparse lookup of every id and a sum per bag."""
    if input.dim() == 2:
        if offsets is not None:
            raise CaptureError(f"{type(bag).__name__}: offsets go with a 1-D input, got a 2-D "
                               f"input and offsets")
        num_bags, length = input.shape
        ids = input.reshape(-1)
        bag_of = torch.arange(ids.numel(), device=ids.device) // length
    elif input.dim() == 1:
        if offsets is None:
            raise CaptureError(f"{type(bag).__name__}: a 1-D input needs offsets")
        starts = offsets[:-1] if bag.include_last_offset else offsets
        num_bags, ids = starts.shape[0], input
        positions = torch.arange(ids.numel(), dtype=starts.dtype, device=ids.device)
        bag_of = torch.searchsorted(starts, positions, right=True) - 1
    else:
        raise CaptureError(f"{type(bag).__name__}: input must be 1-D or 2-D, got "
                           f"{input.dim()}-D")
    rows = F.embedding(ids, bag.weight, sparse=True)
    if per_sample_weights is not None:
        rows = rows * per_sample_weights.reshape(-1, 1).to(rows.dtype)
    counted = None
    if bag.padding_idx is not None:
        counted = (ids != bag.padding_idx).to(rows.dtype)
        rows = rows * counted.unsqueeze(1)
    out = rows.new_zeros(num_bags, rows.shape[1]).index_add(0, bag_of, rows)
    if bag.mode == "mean":
        if counted is None:
            counted = torch.ones(ids.shape, dtype=rows.dtype, device=rows.device)
        sizes = rows.new_zeros(num_bags).index_add(0, bag_of, counted)
        out = out / sizes.clamp(min=1).unsqueeze(1)
    return out


@contextlib.contextmanager
def bags_as_lookups(model: nn.Module):
    """While tracing: every embedding bag with a sparse gradient runs as
    `bag_as_lookup`. (Bags in mode max are refused before this.)"""
    bags = [module for module in model.modules()
            if isinstance(module, nn.EmbeddingBag) and module.sparse]
    try:
        for bag in bags:
            bag.forward = types.MethodType(bag_as_lookup, bag)
        yield
    finally:
        for bag in bags:
            del bag.forward
