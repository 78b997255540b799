"""Embedding-cache mode's pass over the cached bags: several tables at once.

After `EmbeddingCacheMode` has turned each cached bag into `cached_bag` and
its gradient and update into `cached_bag_gradient` and `cached_update`, this
pass

- merges consecutive `cached_bag` nodes into one `cached_bags` node, so the
  worker plans every table of the step at once and talks to each server once
  (one pull, one write-back) instead of once per table; bags stay
  consecutive while no node reads an earlier bag before the next one
  (DLRM-style models look every table up, then combine them);
- hands the bags that FBGEMM's fused kernel can train (`fusable`) to one
  `cached_bags_update` node per group: their gradients go, with the
  learning rate, into one backward call that sums each row's gradient and
  applies SGD to the cached rows in place (`runtime/engine/embedding/fused_bags.py`).
  A group is the fusable tables of one `cached_bags` node with the same
  number of bags and the same learning-rate and step inputs; the others keep
  `cached_bag_gradient` and `cached_update`.

Fusable: a sum bag without padding or per-sample weights, float32, trained
with plain SGD, looked up once, whose one worker owns its cached rows
(write-back). FBGEMM's SGD rounds `row - lr * grad` once, as the row-wise SGD
of `ops.sparse_updates` does, so the fused step is bit for bit the unsplit one.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable

from torch import fx

from ...ops.cache import (
    CachedTable,
    cached_bag,
    cached_bag_gradient,
    cached_bags,
    cached_bags_update,
    cached_update,
)

__all__ = ["batch_cached_bags", "FUSED_OPTIMIZERS"]

# Row-wise optimizers FBGEMM's CPU kernels fuse into the bag's backward
# exactly as `ops.sparse_updates` computes them.
FUSED_OPTIMIZERS = frozenset({"sgd"})


def batch_cached_bags(graph: fx.Graph, tables: list[CachedTable],
                      fusable: Callable[[CachedTable], bool]
                      ) -> tuple[list[CachedTable], tuple[tuple[str, ...], ...]]:
    """Merge the cached bags (see the module docstring). Returns the tables,
    the fused ones marked, and the fused groups' table keys."""
    by_key = {t.key: t for t in tables}
    merged = [_merge(graph, run) for run in _consecutive_runs(graph)]
    groups = []
    for node in merged:
        groups += _fuse_updates(graph, node, by_key, fusable)
    fused = {key for group in groups for key in group}
    tables = [dataclasses.replace(t, fused=True) if t.key in fused else t for t in tables]
    return tables, tuple(groups)


def _consecutive_runs(graph: fx.Graph) -> list[list[fx.Node]]:
    """The `cached_bag` nodes in graph order, cut where a node reads an
    earlier bag of the run before the next bag."""
    position = {node: index for index, node in enumerate(graph.nodes)}
    runs: list[list[fx.Node]] = []
    first_use = None  # the earliest reader of the current run's bags
    for node in graph.nodes:
        if node.target is not cached_bag:
            continue
        if runs and first_use is not None and first_use < position[node]:
            runs.append([])
            first_use = None
        if not runs:
            runs.append([])
        runs[-1].append(node)
        uses = [position[user] for user in node.users]
        if uses:
            first_use = min(uses) if first_use is None else min(first_use, *uses)
    return runs


def _merge(graph: fx.Graph, run: list[fx.Node]) -> fx.Node:
    """One `cached_bags` node in place of the bags of `run` (at the last one's
    place: every bag's inputs are ready there, and no reader comes earlier)."""
    with graph.inserting_before(run[-1]):
        node = graph.call_function(cached_bags, (
            [bag.args[0] for bag in run], [bag.args[1] for bag in run],
            [bag.args[2] for bag in run]), {
            "tables": tuple(bag.kwargs["table"] for bag in run),
            "means": tuple(bag.kwargs["mean"] for bag in run),
            "padding_idxs": tuple(bag.kwargs["padding_idx"] for bag in run)})
    node.meta = {k: v for k, v in run[0].meta.items() if k != "val"}
    for index, bag in enumerate(run):
        with graph.inserting_before(run[-1]):
            item = graph.call_function(operator.getitem, (node, index))
        item.meta = dict(bag.meta)
        bag.replace_all_uses_with(item)
        graph.erase_node(bag)
    return node


def _fuse_updates(graph: fx.Graph, bags: fx.Node, by_key: dict[str, CachedTable],
                  fusable: Callable[[CachedTable], bool]) -> list[tuple[str, ...]]:
    """The fusable tables of one `cached_bags` node: their gradients and
    updates replaced by `cached_bags_update` nodes, one per group."""
    gradients = {node.kwargs["table"]: node for node in graph.nodes
                 if node.target is cached_bag_gradient}
    updates = {node.kwargs["table"]: node for node in graph.nodes
               if node.target is cached_update}
    _, offsets, weights = bags.args
    means, paddings = bags.kwargs["means"], bags.kwargs["padding_idxs"]
    members: dict[tuple, list[str]] = {}
    for index, key in enumerate(bags.kwargs["tables"]):
        gradient, update = gradients.get(key), updates.get(key)
        if (gradient is None or update is None or not update.kwargs.get("coalesced")
                or means[index] or paddings[index] is not None or weights[index] is not None
                or not fusable(by_key[key]) or _num_lookups(graph, key) != 1):
            continue
        num_bags = offsets[index].meta["val"].shape[0]
        table = by_key[key]
        group_key = (num_bags, update.args[2], update.args[3],
                     tuple(sorted(table.optimizer_settings.items())), table.optimizer)
        members.setdefault(group_key, []).append(key)
    position = {node: index for index, node in enumerate(graph.nodes)}
    groups = []
    for keys in members.values():
        last = max((updates[key] for key in keys), key=position.__getitem__)
        _, _, lr, step = last.args
        with graph.inserting_before(last):
            node = graph.call_function(cached_bags_update, (
                [gradients[key].args[0] for key in keys], lr, step), {"tables": tuple(keys)})
        node.meta = {k: v for k, v in last.meta.items() if k != "val"}
        for key in keys:
            graph.erase_node(updates[key])
            gradient = gradients[key]
            for item in list(gradient.users):
                if not item.users:
                    graph.erase_node(item)
            if not gradient.users:
                graph.erase_node(gradient)
        groups.append(tuple(keys))
    return groups


def _num_lookups(graph: fx.Graph, key: str) -> int:
    return sum(node.kwargs["tables"].count(key) for node in graph.nodes
               if node.target is cached_bags)
