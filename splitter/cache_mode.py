"""Embedding-cache mode: tables live on the servers, each worker caches hot rows.

`place_embedding_cache(module, cache_rows=...)` marks `nn.Embedding` tables.
Capture treats them as sparse embeddings (lookup forward, `(indices, values)`
gradients, a row-wise update). This mode's prebuild then takes the table out
of the graph: its lookup becomes `cached_lookup(ids, table=...)` and its update
`cached_update(indices, values, lr, step, table=...)`, marker ops that the
runtime binds to the worker's row cache. Everything else is parameter-server
mode: dense parameters on servers, gradients averaged over workers.

Consistency (see runtime/embedding_client.py): with one worker the cache is
write-back (updates applied to cached rows, their optimizer state travelling
with them, dirty rows written back when evicted and at the end), which equals
training with the whole table in one process. With W >= 2 workers, gradients
go to the servers every step (which average them and update, as in
parameter-server mode) and a cached row is refreshed once older than
`max_staleness` steps: 0 gives exactly parameter-server mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
from torch import fx, nn

from .errors import CaptureError, PlanError
from .labels import Cluster
from .plan import ModeKind
from .program import InputKind, OutputKind, Program
from .ps_mode import ParameterServerMode
from .sparse_optim import ROW_WISE_UPDATES, sparse_adagrad, sparse_sgd

__all__ = ["EvictionPolicy", "CacheSettings", "CachedTable", "place_embedding_cache",
           "cache_settings_of", "cached_lookup", "cached_update", "EmbeddingCacheMode"]

_CACHE_ATTR = "_splitrun_cache"
_aten = torch.ops.aten


class EvictionPolicy(Enum):
    LRU = "lru"   # evict the rows used longest ago
    LFU = "lfu"   # evict the rows looked up least often (counted over the whole run)
    # No caching: every batch pulls all its rows and every gradient goes to the
    # servers (plain parameter-server lookups); cache_rows is the batch buffer.
    NONE = "none"


@dataclass(frozen=True)
class CacheSettings:
    cache_rows: int
    policy: EvictionPolicy = EvictionPolicy.LRU
    # With several workers: a cached row is re-read from its server once it
    # is older than this many steps (0: every step, exactly parameter-server mode).
    max_staleness: int = 0

    def write_back(self, num_workers: int) -> bool:
        """One worker caching rows owns them while cached: updates stay in the
        cache until the row goes back. Otherwise gradients go to the servers."""
        return num_workers == 1 and self.policy is not EvictionPolicy.NONE

    def __post_init__(self) -> None:
        if self.cache_rows < 1:
            raise CaptureError(f"cache_rows must be >= 1, got {self.cache_rows}")
        if self.max_staleness < 0:
            raise CaptureError(f"max_staleness must be >= 0, got {self.max_staleness}")


@dataclass(frozen=True)
class CachedTable:
    """One cached table as the runtime sees it."""

    key: str                      # the table's parameter name, e.g. "tables.0.weight"
    num_rows: int
    dim: int
    dtype: torch.dtype
    settings: CacheSettings
    optimizer: str                # "sgd" or "adagrad"
    optimizer_settings: dict      # keyword settings of the row-wise update
    state_names: tuple[str, ...]  # per-row optimizer state ("sum" for Adagrad)
    ids_feed: str | None          # the batch input its ids come from, for prefetch


def place_embedding_cache(modules, *, cache_rows: int, policy: EvictionPolicy | str = "lru",
                          max_staleness: int = 0):
    """Keep these `nn.Embedding` tables on the servers and cache `cache_rows`
    rows of each on every worker. `modules`: one embedding, or an iterable of
    them (an `nn.ModuleList` of tables)."""
    settings = CacheSettings(cache_rows, EvictionPolicy(policy) if isinstance(policy, str)
                             else policy, max_staleness)
    tables = [modules] if isinstance(modules, nn.Module) and not isinstance(
        modules, (nn.ModuleList, nn.ModuleDict)) else list(
        modules.values() if isinstance(modules, nn.ModuleDict) else modules)
    for table in tables:
        if not isinstance(table, nn.Embedding):
            raise CaptureError(f"place_embedding_cache takes nn.Embedding tables, got "
                               f"{type(table).__name__}")
        if table.padding_idx is not None or table.max_norm is not None:
            raise CaptureError("cached tables cannot use padding_idx or max_norm")
        setattr(table, _CACHE_ATTR, settings)
    return modules


def cache_settings_of(module: nn.Module) -> CacheSettings | None:
    return getattr(module, _CACHE_ATTR, None)


def cached_lookup(ids: torch.Tensor, *, table: str) -> torch.Tensor:
    """Rows of `table` for `ids`, from the worker's cache (bound by the runtime)."""
    raise PlanError(f"cached_lookup of table {table!r} ran without an embedding cache; "
                    f"run the program through splitrun's runtime in embedding-cache mode")


def cached_update(indices: torch.Tensor, values: torch.Tensor, lr: torch.Tensor,
                  step: torch.Tensor, *, table: str) -> None:
    """Hands `table`'s sparse gradient to the worker's cache (bound by the runtime)."""
    raise PlanError(f"cached_update of table {table!r} ran without an embedding cache")


CACHE_OPS = frozenset({cached_lookup, cached_update})
_ROW_WISE = {sparse_sgd: "sgd", sparse_adagrad: "adagrad"}


class EmbeddingCacheMode(ParameterServerMode):
    kind = ModeKind.EMBEDDING_CACHE

    def prebuild(self, program: Program, cluster: Cluster) -> Program:
        cached = program.extras.get("cached_tables")
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
        outputs = [(spec, node) for spec, node in zip(program.outputs, returned)
                   if not (spec.kind is OutputKind.STATE and spec.key in removed_outputs)]
        for spec in program.inputs:
            if spec.key in removed_inputs:
                graph.erase_node(nodes[spec.node])
        graph.output(tuple(node for _, node in outputs))
        initial = {k: v for k, v in program.initial_state.items() if k not in removed_inputs}
        # The tables start on the servers from these (or from a checkpoint).
        tables_initial = {k: program.initial_state[k] for k in removed_inputs}
        extras = dict(program.extras, cache_tables=tables, cache_initial=tables_initial)
        rewritten = Program(
            fx.GraphModule(program.graph_module, graph, class_name="EmbeddingCacheStep"),
            tuple(s for s in program.inputs if s.key not in removed_inputs),
            tuple(spec for spec, _ in outputs), initial, program.hparams_fn, extras)
        return super().prebuild(rewritten, cluster)

    def _take_table(self, program, graph, nodes, key, settings) -> CachedTable:
        spec = program.input_for_key(key)
        weight = nodes[spec.node]
        value = weight.meta["val"]
        lookups, update = [], None
        for user in list(weight.users):
            if user.target is _aten.embedding.default and user.args[0] is weight:
                lookups.append(user)
            elif user.target in _ROW_WISE:
                update = user
            elif user.target in ROW_WISE_UPDATES:
                raise PlanError(
                    f"cached table {key!r} is trained with {user.target.__name__}; cached "
                    f"tables support SGD and row-wise Adagrad (their row state travels with "
                    f"the row); give the table its own optimizer group")
            else:
                raise PlanError(
                    f"cached table {key!r} is read by {user.name} ({user.target}) besides its "
                    f"lookup; a cached table can only be looked up (no tied weights)")
        if not lookups or update is None:
            raise PlanError(f"cached table {key!r} has no lookup or no row-wise update; was "
                            f"the step captured with an optimizer?")
        optimizer = _ROW_WISE[update.target]
        ids_feed = None
        for lookup in lookups:
            ids = lookup.args[1]
            ids_feed = ids_feed or _batch_feed(program, ids)
            with graph.inserting_before(lookup):
                new = graph.call_function(cached_lookup, (ids,), {"table": key})
            new.meta = dict(lookup.meta)
            lookup.replace_all_uses_with(new)
            graph.erase_node(lookup)
        param, indices, values, lr, step, *state = update.args
        with graph.inserting_before(update):
            handoff = graph.call_function(cached_update, (indices, values, lr, step),
                                          {"table": key})
        handoff.meta = {k: v for k, v in update.meta.items() if k != "val"}
        for getitem in list(update.users):
            graph.erase_node(getitem)  # the table's new value is not plan state
        graph.erase_node(update)
        state_names = tuple(n.rsplit(".", 1)[1] for n in _state_keys(program, key))
        return CachedTable(key, value.shape[0], value.shape[1], value.dtype, settings,
                           optimizer, dict(update.kwargs), state_names, ids_feed)


def _state_keys(program: Program, key: str) -> list[str]:
    return [s.key for s in program.inputs
            if s.kind is InputKind.OPT_STATE and s.key.rsplit(".", 1)[0] == key]


# Ops that keep every element of their input: ids read through them are the
# batch input's ids, so the next batch's can be prefetched.
_SAME_ELEMENTS = frozenset({_aten.view, _aten._unsafe_view, _aten.reshape, _aten.flatten,
                            _aten.unsqueeze, _aten.squeeze, _aten.detach, _aten.alias,
                            _aten.clone})


def _batch_feed(program: Program, node: fx.Node) -> str | None:
    """The batch input whose every element `node` holds, if any."""
    while node.op == "call_function" and len(node.all_input_nodes) == 1 and \
            getattr(node.target, "overloadpacket", node.target) in _SAME_ELEMENTS:
        node = node.all_input_nodes[0]
    if node.op == "placeholder":
        spec = program.input_spec(node.name)
        if spec is not None and spec.kind is InputKind.BATCH:
            return spec.key
    return None
