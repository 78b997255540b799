"""Capture's side of sparse `nn.EmbeddingBag`s: while a step is traced every
bag with a sparse gradient runs as one `sparse_bag` (`bags_as_lookups`), and
the traced per-lookup gradient is then read through `bag_gradient`, summed
per unique id (`coalesce_bag_gradients`). The ops themselves, and why they
are shaped so, are in `ops/bags.py`."""

from __future__ import annotations

import contextlib
import operator
import types

import torch
from torch import fx, nn

from ..errors import CaptureError
from ..ops.bags import bag_gradient, sparse_bag

__all__ = ["bags_as_lookups", "bag_as_lookup", "coalesce_bag_gradients",
           "drop_unused_bag_backwards"]


def coalesce_bag_gradients(graph: fx.Graph, sparse_grads: dict[str, tuple[fx.Node, fx.Node]]
                           ) -> None:
    """Capture: every sparse gradient traced as `(ids, sparse_bag_backward)`
    reads `bag_gradient` instead (in place in `sparse_grads`). The traced
    per-lookup node stays for a returned gradient (`drop_unused_bag_backwards`)."""
    for name, (_, values) in list(sparse_grads.items()):
        if values.target is not torch.ops.splitrun.sparse_bag_backward.default:
            continue
        grad, ids, offsets, weights, mean, padding_idx = values.args
        with graph.inserting_after(values):
            summed = graph.call_function(bag_gradient, (grad, ids, offsets, weights, mean,
                                                        padding_idx))
        with graph.inserting_after(summed):
            rows = graph.call_function(operator.getitem, (summed, 0))
        with graph.inserting_after(rows):
            sums = graph.call_function(operator.getitem, (summed, 1))
        for node in (summed, rows, sums):  # the label and module of the backward
            node.meta["custom"] = dict(values.meta.get("custom") or {})
        sparse_grads[name] = (rows, sums)


def drop_unused_bag_backwards(graph: fx.Graph) -> None:
    """Erase per-lookup bag gradients no node reads (no returned gradient)."""
    for node in list(graph.nodes):
        if node.target is torch.ops.splitrun.sparse_bag_backward.default and not node.users:
            graph.erase_node(node)


# -- capture -------------------------------------------------------------------------

def bag_as_lookup(bag: nn.EmbeddingBag, input: torch.Tensor, offsets: torch.Tensor | None = None,
                  per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
    """`bag(input, offsets, per_sample_weights)` (modes sum and mean), as one
    `sparse_bag` of flat ids and each bag's start."""
    if input.dim() == 2:
        if offsets is not None:
            raise CaptureError(f"{type(bag).__name__}: offsets go with a 1-D input, got a 2-D "
                               f"input and offsets")
        num_bags, length = input.shape
        ids = input.reshape(-1)
        starts = torch.arange(0, num_bags * length, length, device=ids.device)
    elif input.dim() == 1:
        if offsets is None:
            raise CaptureError(f"{type(bag).__name__}: a 1-D input needs offsets")
        starts = offsets[:-1] if bag.include_last_offset else offsets
        ids = input
    else:
        raise CaptureError(f"{type(bag).__name__}: input must be 1-D or 2-D, got "
                           f"{input.dim()}-D")
    if ids.dtype != torch.int64:
        ids = ids.to(torch.int64)
    if starts.dtype != torch.int64:
        starts = starts.to(torch.int64)
    weights = None
    if per_sample_weights is not None:
        if per_sample_weights.requires_grad:
            raise CaptureError(f"{type(bag).__name__}: per_sample_weights that need a "
                               f"gradient are not supported by sparse (or cached) bags; "
                               f"detach them or use sparse=False")
        weights = per_sample_weights.reshape(-1)
    return sparse_bag(bag.weight, ids, starts, weights, bag.mode == "mean", bag.padding_idx)


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
