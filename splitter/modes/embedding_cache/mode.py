"""Embedding-cache mode: tables live on the servers, each worker caches hot rows.

`place_embedding_cache(module, cache_rows=...)` marks `nn.Embedding` and
`nn.EmbeddingBag` tables. Capture treats them as sparse embeddings (lookup
forward, `(indices, values)` gradients, a row-wise update). This mode's
prebuild then takes the table out of the graph: its lookup becomes
`cached_lookup(ids, table=...)` and its update `cached_update(indices, values,
lr, step, table=...)`, marker ops that the runtime binds to the worker's row
cache. A bag is captured as one fused op (`ops.bags.sparse_bag`): it
becomes `cached_bag(ids, offsets, weights, table=...)`, which sums each bag
straight from the cached rows, and its gradient, `bag_gradient`, becomes
`cached_bag_gradient`, summed per unique id with the unique of the lookup.
Consecutive bags then become one `cached_bags` node (one plan and one
exchange with each server for every table of the step), and the bags FBGEMM
can train run their backward and SGD update as one fused call
(`cached_bags_update`; see bag_batching.py).
Everything else is parameter-server mode: dense parameters on servers,
gradients averaged over workers; or, with `dense="worker"`, dense parameters
on every worker (gradients all-reduced between them) and only the tables'
rows on the servers.

Consistency (see runtime/engine/embedding/client.py): with one worker the cache is
write-back (updates applied to cached rows, their optimizer state travelling
with them, dirty rows written back when evicted and at the end), which equals
training with the whole table in one process. With W >= 2 workers, gradients
go to the servers every step (which average them and update, as in
parameter-server mode) and a cached row is refreshed once older than
`max_staleness` steps: 0 gives exactly parameter-server mode. It is the rule
of `ParameterServerMode(staleness=s)` for rows: a row a worker reads at step c
is at least version c - max_staleness (version v: the servers' row after the
updates of steps 0 .. v-1; see modes/parameter_server.py).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import fx

from ...errors import PlanError
from ...fx_facts import op_packet
from ...labels import Cluster, Label, Role
from ...ops.bags import bag_gradient
from ...ops.cache import (
    CachedTable,
    cached_bag,
    cached_bag_gradient,
    cached_lookup,
    cached_update,
)
from ...ops.sparse_updates import ROW_WISE_UPDATES, sparse_adagrad, sparse_adam, sparse_sgd
from ...plan.model import ModeKind, SplitPlan
from ...program import InputKind, InputSpec, OutputKind, Program
from ..dense_placement import DensePlacement
from ..parameter_server import ParameterServerMode, ServerAssignment
from .bag_batching import FUSED_OPTIMIZERS, batch_cached_bags
from .summary import cached_table_entries

_aten = torch.ops.aten
_SPARSE_BAG = torch.ops.splitrun.sparse_bag.default

__all__ = ["EmbeddingCacheMode", "CacheArtifacts"]

# The row-wise updates a cached table can take (the keys of ops.sparse_updates.IN_PLACE):
# their per-row state (Adagrad's sum, Adam's moments) travels with the row.
_ROW_WISE = {sparse_sgd: "sgd", sparse_adagrad: "adagrad", sparse_adam: "adam"}


@dataclass(frozen=True)
class CacheArtifacts(ServerAssignment):
    """Parameter-server facts for the dense parameters, plus the cached tables
    (taken out of the graph) and their starting values (with their row-wise
    optimizer state), which the servers load unless a checkpoint gives others."""

    tables: tuple[CachedTable, ...] = ()
    initial: Mapping[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    # Tables whose bags' backward and update run as one fused kernel call each
    # step (`bag_batching`): their caches share one buffer per group.
    fused_groups: tuple[tuple[str, ...], ...] = ()


class EmbeddingCacheMode(ParameterServerMode):
    kind = ModeKind.EMBEDDING_CACHE

    def __init__(self, *, dense: DensePlacement | str = DensePlacement.SERVER) -> None:
        # Gradients in one message a step (no buckets). dense="worker": the
        # dense parameters on every worker (all-reduced), only rows on servers.
        super().__init__(dense=dense)

    def works_outside_the_plan(self, label: Label) -> bool:
        return label.role is Role.SERVER  # servers serve the tables' rows

    def prebuild(self, program: Program, cluster: Cluster
                 ) -> tuple[Program, CacheArtifacts]:
        cached = program.cached_tables
        if not cached:
            raise PlanError("embedding-cache mode found no cached table; mark tables with "
                            "place_embedding_cache(model.tables, cache_rows=...) before capture")
        graph = fx.Graph()
        returned = graph.graph_copy(program.graph, {})
        nodes = {n.name: n for n in graph.nodes}
        tables, removed_inputs, removed_outputs = [], set(), set()
        for key, settings in cached.items():
            table = self._take_table(program, graph, nodes, key, settings)
            tables.append(table)
            removed_inputs |= {key, *(f"{key}.{s}" for s in table.state_names)}
            removed_outputs |= removed_inputs
        tables, fused_groups = batch_cached_bags(
            graph, tables, lambda t: (t.optimizer in FUSED_OPTIMIZERS and t.dtype == torch.float32
                                      and t.settings.write_back(cluster.num_workers)
                                      and t.settings.dynamic is None))
        outputs = [(spec, node) for spec, node in zip(program.outputs, returned)
                   if not (spec.kind is OutputKind.STATE and spec.key in removed_outputs)]
        for spec in program.inputs:
            if spec.key in removed_inputs:
                graph.erase_node(nodes[spec.node])
        graph.output(tuple(node for _, node in outputs))
        initial = program.initial_state.subset(
            k for k in program.initial_state if k not in removed_inputs)
        # The tables start on the servers from these (or from a checkpoint).
        tables_initial = {k: program.initial_state[k] for k in removed_inputs}
        rewritten = dataclasses.replace(
            program,
            graph_module=fx.GraphModule(program.graph_module, graph,
                                        class_name="EmbeddingCacheStep"),
            inputs=tuple(s for s in program.inputs if s.key not in removed_inputs),
            outputs=tuple(spec for spec, _ in outputs), initial_state=initial)
        rewritten, servers = super().prebuild(rewritten, cluster)
        return rewritten, CacheArtifacts(servers.owner, servers.slots, tuple(tables),
                                         tables_initial, fused_groups)

    def postbuild(self, plan: SplitPlan, program: Program,
                  artifacts: CacheArtifacts) -> SplitPlan:
        """The parameter-server plan, and the tables whose rows it moves
        outside its channels (for its summary and picture)."""
        plan = super().postbuild(plan, program, artifacts)
        return dataclasses.replace(plan, cached_tables=cached_table_entries(program,
                                                                            artifacts.tables))

    def _take_table(self, program, graph, nodes, key, settings) -> CachedTable:
        spec = program.input_for_key(key)
        weight = nodes[spec.node]
        value = weight.meta["val"]
        lookups, update = [], None
        for user in list(weight.users):
            if (user.target in (_aten.embedding.default, _SPARSE_BAG)
                    and user.args[0] is weight):
                lookups.append(user)
            elif user.target in _ROW_WISE:
                update = user
            elif user.target in ROW_WISE_UPDATES:
                raise PlanError(
                    f"cached table {key!r} is trained with {user.target.__name__}; cached "
                    f"tables support SGD, Adagrad (element-wise) and lazy Adam on the rows "
                    f"looked up (their row state travels with the row); give the table its "
                    f"own optimizer group")
            else:
                raise PlanError(
                    f"cached table {key!r} is read by {user.name} ({user.target}) besides its "
                    f"lookup; a cached table can only be looked up (no tied weights)")
        if not lookups or update is None:
            raise PlanError(f"cached table {key!r} has no lookup or no row-wise update; was "
                            f"the step captured with an optimizer?")
        optimizer = _ROW_WISE[update.target]
        optimizer_settings = dict(update.kwargs)
        # Ids, not cache slots: the client leaves the padding row's gradient out.
        padding_idx = optimizer_settings.pop("padding_idx", None)
        ids_feed = None
        for lookup in lookups:
            ids = lookup.args[1]
            ids_feed = ids_feed or _batch_feed(program, ids)
            with graph.inserting_before(lookup):
                if lookup.target is _SPARSE_BAG:  # a bag: its rows summed from the cache
                    _, ids, offsets, weights, mean, pad = lookup.args
                    new = graph.call_function(cached_bag, (ids, offsets, weights), {
                        "table": key, "mean": mean, "padding_idx": pad})
                else:
                    new = graph.call_function(cached_lookup, (ids,), {"table": key})
            new.meta = dict(lookup.meta)
            lookup.replace_all_uses_with(new)
            graph.erase_node(lookup)
        param, indices, values, lr, step, *state = update.args
        coalesced = _bag_gradient_to_cache(graph, values, key)
        with graph.inserting_before(update):
            handoff = graph.call_function(cached_update, (indices, values, lr, step),
                                          {"table": key, "coalesced": coalesced})
        handoff.meta = {k: v for k, v in update.meta.items() if k != "val"}
        for getitem in list(update.users):
            graph.erase_node(getitem)  # the table's new value is not plan state
        graph.erase_node(update)
        state_names = tuple(s.state_name for s in _state_specs(program, key))
        return CachedTable(key, value.shape[0], value.shape[1], value.dtype, settings,
                           optimizer, optimizer_settings, state_names, ids_feed, padding_idx)


def _bag_gradient_to_cache(graph: fx.Graph, values: fx.Node, key: str) -> bool:
    """A bag's gradient (`bag_gradient`, summed per unique id) is summed by the
    worker's cache instead, with the unique of its lookup. True if so."""
    summed = values.args[0] if values.target is operator.getitem else None
    if summed is None or getattr(summed, "target", None) is not bag_gradient:
        return False
    grad, ids, offsets, weights, mean, pad = summed.args
    with graph.inserting_before(summed):
        new = graph.call_function(cached_bag_gradient, (grad, ids, offsets, weights), {
            "table": key, "mean": mean, "padding_idx": pad})
    new.meta = dict(summed.meta)
    summed.replace_all_uses_with(new)
    graph.erase_node(summed)
    return True


def _state_specs(program: Program, key: str) -> list[InputSpec]:
    """The optimizer state of the parameter `key`."""
    return [s for s in program.inputs if s.param == key]


# Ops that keep every element of their input: ids read through them are the
# batch input's ids, so the next batch's can be prefetched.
_SAME_ELEMENTS = frozenset({_aten.view, _aten._unsafe_view, _aten.reshape, _aten.flatten,
                            _aten.unsqueeze, _aten.squeeze, _aten.detach, _aten.alias,
                            _aten.clone})


def _batch_feed(program: Program, node: fx.Node) -> str | None:
    """The batch input whose every element `node` holds, if any."""
    while node.op == "call_function" and len(node.all_input_nodes) == 1 and \
            op_packet(node) in _SAME_ELEMENTS:
        node = node.all_input_nodes[0]
    if node.op == "placeholder":
        spec = program.input_spec(node.name)
        if spec is not None and spec.kind is InputKind.BATCH:
            return spec.key
    return None
