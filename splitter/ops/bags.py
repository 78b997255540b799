"""Sparse `nn.EmbeddingBag`s as the graph holds them: one fused bag op.

While a step is traced, every embedding bag with a sparse gradient (its own
`sparse=True`, or a cached table) runs as `sparse_bag(weight, ids, offsets,
weights, mean, padding_idx)` (`capturing/bags.py`): one `F.embedding_bag`
(mode sum) over the table's rows, the per-sample weights and the padding
mask folded into one weight per lookup, a mean divided by each bag's count
of non-padding ids.
No per-lookup rows are materialized.

Its gradient is the table's sparse gradient. Traced, it is `(ids,
sparse_bag_backward(...))` (one row per lookup, static shapes); capture then
replaces it by `bag_gradient(...)`, a called op whose result is already
summed per unique id: the lookups are grouped by id once (`sorted_groups`: a
stable sort), and each unique id's gradient row is one more
`F.embedding_bag` over the bag gradient, its lookups in batch order. The
row-wise optimizers, parameter-server mode (which sends it on as it is) and
embedding-cache mode (whose worker computes the same sums from the unique it
made for the lookup, `EmbeddingClient.bag_gradient`) take that.

Whole tables and cached rows go through the same two functions
(`bag_forward`, `bag_gradient_rows`), on the same row values, with the same
lookups in the same order: a cached bag is bit for bit the whole table's.

Why not torch's own bag op in the graph: its sparse backward has no
static-shape form (torch's CPU fast path returns an empty `offset2bag`, and
the fake kernel of its backward with per-sample weights then fails).
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import fx

__all__ = ["sparse_bag", "sparse_bag_backward", "bag_gradient", "bag_forward",
           "bag_gradient_rows", "sorted_groups", "IdGroups", "is_bag_gradient"]


# -- the arithmetic, shared by whole tables and cached rows ------------------------

class IdGroups(NamedTuple):
    """A step's lookup ids grouped by id (one stable sort)."""

    unique: torch.Tensor    # the distinct ids, sorted
    inverse: torch.Tensor   # lookup position -> index into `unique`
    counts: torch.Tensor    # lookups of each unique id
    order: torch.Tensor     # lookup positions, grouped by id, batch order within a group
    starts: torch.Tensor    # where each unique id's group starts in `order`


def sorted_groups(ids: torch.Tensor) -> IdGroups:
    """`ids` (flat) grouped by id: what `torch.unique(sorted=True,
    return_inverse=True, return_counts=True)` gives, plus the stable sort's
    order, which sums per unique id need."""
    count = ids.numel()
    ordered, order = torch.sort(ids, stable=True)
    new = torch.ones(count, dtype=torch.bool, device=ids.device)
    if count > 1:
        torch.ne(ordered[1:], ordered[:-1], out=new[1:])
    starts = new.nonzero().reshape(-1)
    inverse = torch.empty_like(order).scatter_(0, order, torch.cumsum(new, 0) - 1)
    counts = torch.diff(starts, append=starts.new_tensor([count]))
    return IdGroups(ordered.masked_select(new), inverse, counts, order, starts)


def _lookup_weights(ids: torch.Tensor, weights: torch.Tensor | None, padding_idx: int | None,
                    dtype: torch.dtype) -> torch.Tensor | None:
    """One weight per lookup: the per-sample weight, 0 for a padding id."""
    if padding_idx is None:
        return None if weights is None else weights.to(dtype)
    kept = (ids != padding_idx).to(dtype)
    return kept if weights is None else weights.to(dtype) * kept


def _bag_of(offsets: torch.Tensor, count: int) -> torch.Tensor:
    """The bag of each of `count` lookups (offsets: each bag's start, an empty
    bag's start equal to the next one's): bag starts counted up to each
    position (a cumulative sum; 10x faster than `searchsorted` on the CPU)."""
    starts = torch.zeros(count + 1, dtype=offsets.dtype, device=offsets.device)
    starts.index_add_(0, offsets, torch.ones_like(offsets))
    return torch.cumsum(starts[:count], 0) - 1


def _bag_sizes(ids: torch.Tensor, offsets: torch.Tensor, padding_idx: int | None,
               dtype: torch.dtype) -> torch.Tensor:
    """Lookups of each bag, padding ids left out (a mean's divisor, >= 1), on
    the device of `offsets`."""
    ids = ids.to(offsets.device)
    if padding_idx is None:
        sizes = torch.diff(offsets, append=offsets.new_tensor([ids.numel()]))
    else:
        sizes = torch.zeros(offsets.numel(), dtype=torch.int64, device=offsets.device).index_add_(
            0, _bag_of(offsets, ids.numel()), (ids != padding_idx).to(torch.int64))
    return sizes.clamp(min=1).to(dtype)


def bag_forward(rows: torch.Tensor, index: torch.Tensor, ids: torch.Tensor,
                offsets: torch.Tensor, weights: torch.Tensor | None, mean: bool,
                padding_idx: int | None) -> torch.Tensor:
    """Bags of `rows[index]` ([bags, dim]): `index` picks each lookup's row of
    `rows` (the table: the ids; a cache: their slots); `ids` are the ids
    themselves (for the padding mask and the mean's counts)."""
    index = index.to(rows.device)
    offsets = offsets.to(rows.device)
    scale = _lookup_weights(ids, weights, padding_idx, rows.dtype)
    out = F.embedding_bag(index, rows, offsets, mode="sum",
                          per_sample_weights=None if scale is None else scale.to(rows.device))
    if mean:
        out = out / _bag_sizes(ids, offsets, padding_idx, rows.dtype).to(rows.device).unsqueeze(1)
    return out


def bag_gradient_rows(grad: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor,
                      weights: torch.Tensor | None, mean: bool, padding_idx: int | None,
                      order: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """The bag gradient `grad` ([bags, dim]) summed per unique id ([unique,
    dim], the order of `starts`): each unique id's lookups (`order`, grouped
    by `starts`) in batch order, each its bag's gradient times its weight."""
    device = grad.device
    offsets = offsets.to(device)
    if mean:
        grad = grad / _bag_sizes(ids, offsets, padding_idx, grad.dtype).to(device).unsqueeze(1)
    order = order.to(device)
    scale = _lookup_weights(ids, weights, padding_idx, grad.dtype)
    # index_select, not [order]: on the CPU advanced indexing is ~4x slower.
    return F.embedding_bag(_bag_of(offsets, ids.numel()).index_select(0, order), grad,
                           starts.to(device), mode="sum",
                           per_sample_weights=None if scale is None
                           else scale.to(device).index_select(0, order))


# -- the traced ops ------------------------------------------------------------------

@torch.library.custom_op("splitrun::sparse_bag", mutates_args=())
def sparse_bag(weight: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor,
               weights: torch.Tensor | None, mean: bool, padding_idx: int | None
               ) -> torch.Tensor:
    """A sum (or mean) bag of `weight`'s rows; `offsets`: each bag's start."""
    return bag_forward(weight, ids, ids, offsets, weights, mean, padding_idx)


@sparse_bag.register_fake
def _(weight, ids, offsets, weights, mean, padding_idx):
    return weight.new_empty(offsets.shape[0], weight.shape[1])


@torch.library.custom_op("splitrun::sparse_bag_backward", mutates_args=())
def sparse_bag_backward(grad: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor,
                        weights: torch.Tensor | None, mean: bool, padding_idx: int | None
                        ) -> torch.Tensor:
    """The bag's weight gradient, one row per lookup (a returned gradient's
    values; training reads `bag_gradient` instead)."""
    offsets = offsets.to(grad.device)
    if mean:
        grad = grad / _bag_sizes(ids, offsets, padding_idx, grad.dtype).unsqueeze(1)
    rows = grad.index_select(0, _bag_of(offsets, ids.numel()))
    scale = _lookup_weights(ids, weights, padding_idx, grad.dtype)
    return rows if scale is None else rows * scale.unsqueeze(1)


@sparse_bag_backward.register_fake
def _(grad, ids, offsets, weights, mean, padding_idx):
    return grad.new_empty(ids.shape[0], grad.shape[1])


def _setup_context(ctx, inputs, output):
    weight, ids, offsets, weights, mean, padding_idx = inputs
    ctx.save_for_backward(ids, offsets, weights)
    ctx.shape = weight.shape
    ctx.mean, ctx.padding_idx = mean, padding_idx


def _backward(ctx, grad):
    ids, offsets, weights = ctx.saved_tensors
    values = sparse_bag_backward(grad, ids, offsets, weights, ctx.mean, ctx.padding_idx)
    weight_grad = torch.sparse_coo_tensor(ids.unsqueeze(0), values, ctx.shape,
                                          check_invariants=False)
    return weight_grad, None, None, None, None, None


sparse_bag.register_autograd(_backward, setup_context=_setup_context)


def bag_gradient(grad: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor,
                 weights: torch.Tensor | None, mean: bool, padding_idx: int | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """A bag's sparse gradient as (unique ids, their summed rows): what
    `coalesce` of `(ids, sparse_bag_backward(...))` gives, with no row per
    lookup. Its shapes depend on the data: a called graph node."""
    groups = sorted_groups(ids.reshape(-1))
    return groups.unique, bag_gradient_rows(grad, ids, offsets, weights, mean, padding_idx,
                                            groups.order, groups.starts)


def is_bag_gradient(node: fx.Node) -> bool:
    """True for the values (or indices) node of a `bag_gradient`: already
    summed per unique id."""
    return (node.op == "call_function" and node.target is operator.getitem
            and isinstance(node.args[0], fx.Node)
            and getattr(node.args[0], "target", None) is bag_gradient)
