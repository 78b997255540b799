"""The one registry of marker ops: graph nodes whose function only stands for
what the runtime binds it to (a worker's row cache, a process group).

Called unbound, a marker raises. `MARKERS` lists every one with what binds
it, so an executor refuses, when it starts, a graph holding one it has no
binding for (naming the node and the marker), instead of failing at the
node's first run. A marker a mode adds goes here, or no executor checks it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from .cache import (
    cached_bag,
    cached_bag_gradient,
    cached_bags,
    cached_bags_update,
    cached_lookup,
    cached_update,
)
from .collectives import all_gather, all_gather_stacked, all_reduce, all_to_all, reduce_scatter
from .worker_all_reduce import all_reduce_mean

__all__ = ["MARKERS"]

_CACHE = "a worker's embedding cache (EmbeddingCacheMode)"
_GROUP = ("a torch.distributed process group of its parallel group "
          "(ParallelMode(backend='torch_distributed'))")
_WORKERS = "a torch.distributed process group of all the workers (dense='worker')"

# marker -> what the runtime binds it to (said in the executor's refusal)
MARKERS: Mapping[Callable, str] = MappingProxyType({
    cached_lookup: _CACHE,
    cached_bag: _CACHE,
    cached_bag_gradient: _CACHE,
    cached_update: _CACHE,
    cached_bags: _CACHE,
    cached_bags_update: _CACHE,
    all_reduce: _GROUP,
    all_gather: _GROUP,
    reduce_scatter: _GROUP,
    all_to_all: _GROUP,
    all_gather_stacked: _GROUP,
    all_reduce_mean: _WORKERS,
})
