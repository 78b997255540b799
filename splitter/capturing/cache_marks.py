"""The mark that asks for a table to be cached: `place_embedding_cache` sets
a table's `CacheSettings` on the module, and capture reads them back
(`cache_settings_of`) into the program it makes."""

from __future__ import annotations

from torch import nn

from ..errors import CaptureError
from ..ops.cache import CacheSettings, EvictionPolicy
from ..ops.dynamic_table import DynamicTable
from ..ops.row_init import RowInit

__all__ = ["place_embedding_cache", "cache_settings_of"]

# The attribute place_embedding_cache sets on a marked table.
_CACHE_ATTR = "_splitrun_cache"


def place_embedding_cache(modules, *, cache_rows: int, policy: EvictionPolicy | str | None = None,
                          max_staleness: int = 0, init: RowInit | None = None,
                          dynamic: DynamicTable | None = None):
    """Keep these `nn.Embedding` or `nn.EmbeddingBag` tables on the servers and
    cache `cache_rows` rows of each on every worker. `modules`: one table, or
    an iterable of them (an `nn.ModuleList` of tables). Bags take modes sum
    and mean; `padding_idx` works (that row is never updated), `max_norm`
    does not. `init` (`RowInit.normal(...)` etc.): the table's rows start
    from it, made by each server for its own rows only, so the model may build
    the table on the `meta` device (docs/embedding-cache.md). `dynamic`
    (`DynamicTable(...)`): the table has no row count, its ids are any int64;
    the model's table is a placeholder of the rows' width (docs/embedding-
    cache.md, "Dynamic tables"). `policy` (None): "lru" for a table with a
    row count; "none" for a dynamic table, whose workers then hold only each
    step's rows (caching them is asked for with "lru": on one host it cost
    more than the pulls it saved, bench/dynamic_job.py)."""
    if dynamic is not None and not isinstance(dynamic, DynamicTable):
        raise CaptureError(f"place_embedding_cache(dynamic=...) takes a DynamicTable, got "
                           f"{type(dynamic).__name__}")
    if policy is None:
        policy = EvictionPolicy.NONE if dynamic is not None else EvictionPolicy.LRU
    settings = CacheSettings(cache_rows, EvictionPolicy(policy) if isinstance(policy, str)
                             else policy, max_staleness, init, dynamic)
    tables = [modules] if isinstance(modules, nn.Module) and not isinstance(
        modules, (nn.ModuleList, nn.ModuleDict)) else list(
        modules.values() if isinstance(modules, nn.ModuleDict) else modules)
    for table in tables:
        if not isinstance(table, (nn.Embedding, nn.EmbeddingBag)):
            raise CaptureError(f"place_embedding_cache takes nn.Embedding or nn.EmbeddingBag "
                               f"tables, got {type(table).__name__}")
        if table.max_norm is not None:
            raise CaptureError(f"a cached {type(table).__name__} cannot use max_norm (it "
                               f"renormalizes rows in place during the forward); drop it")
        if isinstance(table, nn.EmbeddingBag) and table.mode == "max":
            raise CaptureError("a cached EmbeddingBag takes mode 'sum' or 'mean', not 'max'")
        if table.weight.device.type == "meta" and init is None and dynamic is None:
            raise CaptureError(
                f"a cached {type(table).__name__}({table.num_embeddings}, "
                f"{table.embedding_dim}) on the meta device holds no rows to start from; give "
                f"it a row initializer (place_embedding_cache(..., init=RowInit.normal(...))), "
                f"whose rows each server makes for its own ids")
        setattr(table, _CACHE_ATTR, settings)
    return modules


def cache_settings_of(module: nn.Module) -> CacheSettings | None:
    return getattr(module, _CACHE_ATTR, None)
