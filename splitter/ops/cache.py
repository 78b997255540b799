"""Cached embedding tables as the splitter describes them to the runtime: a
table's settings (`CacheSettings`, what `place_embedding_cache` marks), what
the runtime needs to know of each (`CachedTable`), and the marker ops a
cached lookup, bag, bag gradient and update become in the graph
(`cached_lookup`, `cached_bag`, `cached_bag_gradient`, `cached_update`;
several tables' bags at once, `cached_bags`, and their fused backward and
update, `cached_bags_update`), bound by the runtime.

Capture reads the marks (`capturing/cache_marks.py`); `EmbeddingCacheMode`
rewrites the graph; the runtime's row cache binds the markers. All three
import this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from ..errors import CaptureError, PlanError
from .dynamic_table import DynamicTable
from .row_init import RowInit

__all__ = ["EvictionPolicy", "CacheSettings", "CachedTable", "cached_lookup", "cached_bag",
           "cached_bag_gradient", "cached_update", "cached_bags", "cached_bags_update"]

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
    # is older than this many steps (0: every step, exactly parameter-server mode);
    # the staleness rule of ParameterServerMode(staleness=s), for rows.
    max_staleness: int = 0
    # How the table's rows start (row_init.RowInit): set, the servers make their
    # own rows from it as they are first used and the model's tensor is never
    # read (it may sit on the `meta` device); None: rows start as the model's.
    init: RowInit | None = None
    # A table without a row count (dynamic_table.DynamicTable): ids are any
    # int64, rows are made on first sight by the id's server; None: bounded.
    dynamic: DynamicTable | None = None

    def write_back(self, num_workers: int) -> bool:
        """One worker caching rows owns them while cached: updates stay in the
        cache until the row goes back (a dynamic table's too: its servers
        still own admission and expiry, and tell the worker which of its rows
        are live and which expired). Otherwise gradients go to the servers."""
        return num_workers == 1 and self.policy is not EvictionPolicy.NONE

    def caches_dynamic_rows(self, num_workers: int) -> bool:
        """A dynamic table's workers keep its rows between steps: one worker
        (write-back), or several reading rows up to `max_staleness` steps old
        (write-through). Else each step pulls every row it looks up: with
        several workers and no staleness a cached row would be read again
        every step anyway."""
        return self.dynamic is not None and self.policy is not EvictionPolicy.NONE and (
            num_workers == 1 or self.max_staleness > 0)

    def __post_init__(self) -> None:
        if self.cache_rows < 1:
            raise CaptureError(f"cache_rows must be >= 1, got {self.cache_rows}")
        if self.max_staleness < 0:
            raise CaptureError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.dynamic is not None and self.policy is EvictionPolicy.LFU:
            # LFU counts every id's lookups over the run, in a map over the rows.
            raise CaptureError("a dynamic table's worker cache evicts by policy='lru' (or "
                               "caches nothing: 'none'); 'lfu' counts lookups per row of a "
                               "table with a row count")


@dataclass(frozen=True)
class CachedTable:
    """One cached table as the runtime sees it."""

    key: str                      # the table's parameter name, e.g. "tables.0.weight"
    num_rows: int
    dim: int
    dtype: torch.dtype
    settings: CacheSettings
    optimizer: str                # "sgd", "adagrad" or "adam" (sparse_updates.IN_PLACE)
    optimizer_settings: dict      # keyword settings of the row-wise update
    state_names: tuple[str, ...]  # per-row optimizer state ("sum"; "exp_avg", "exp_avg_sq")
    ids_feed: str | None          # the batch input its ids come from, for prefetch
    padding_idx: int | None = None  # a row no gradient updates (the layer's padding_idx)
    # Its bag's backward and row-wise update run as one fused FBGEMM call with
    # the other tables of its group (`cached_bags_update`); set by the mode.
    fused: bool = False

    @property
    def row_bytes(self) -> int:
        """One row with its optimizer state, as it is stored and sent."""
        return self.dim * self.dtype.itemsize * (1 + len(self.state_names))


def cached_lookup(ids: torch.Tensor, *, table: str) -> torch.Tensor:
    """Rows of `table` for `ids`, from the worker's cache (bound by the runtime)."""
    raise PlanError(f"cached_lookup of table {table!r} ran without an embedding cache; "
                    f"run the program through splitrun's runtime in embedding-cache mode")


def cached_bag(ids: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None, *,
               table: str, mean: bool, padding_idx: int | None) -> torch.Tensor:
    """`bags.sparse_bag` of `table`, its rows read from the worker's
    cache (bound by the runtime)."""
    raise PlanError(f"cached_bag of table {table!r} ran without an embedding cache; "
                    f"run the program through splitrun's runtime in embedding-cache mode")


def cached_bag_gradient(grad: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor,
                        weights: torch.Tensor | None, *, table: str, mean: bool,
                        padding_idx: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`bags.bag_gradient` of `table`'s bag, summed per unique id with
    the unique its cached lookup made (bound by the runtime)."""
    raise PlanError(f"cached_bag_gradient of table {table!r} ran without an embedding cache")


def cached_update(indices: torch.Tensor, values: torch.Tensor, lr: torch.Tensor,
                  step: torch.Tensor, *, table: str, coalesced: bool = False) -> None:
    """Hands `table`'s sparse gradient to the worker's cache (bound by the
    runtime). `coalesced`: the indices are unique, each row's values summed."""
    raise PlanError(f"cached_update of table {table!r} ran without an embedding cache")


def cached_bags(ids: list[torch.Tensor], offsets: list[torch.Tensor],
                weights: list[torch.Tensor | None], *, tables: tuple[str, ...],
                means: tuple[bool, ...], padding_idxs: tuple[int | None, ...]
                ) -> tuple[torch.Tensor, ...]:
    """`cached_bag` of several tables at once (one plan, one exchange with
    each server, the fused tables' bags in one kernel call), bound by the
    runtime."""
    raise PlanError(f"cached_bags of tables {', '.join(tables)} ran without an embedding cache; "
                    f"run the program through splitrun's runtime in embedding-cache mode")


def cached_bags_update(grads: list[torch.Tensor], lr: torch.Tensor, step: torch.Tensor, *,
                       tables: tuple[str, ...]) -> None:
    """The fused tables' bag gradients (`grads`, one [bags, dim] per table)
    applied to their cached rows by one fused backward-and-update kernel
    call (bound by the runtime)."""
    raise PlanError(f"cached_bags_update of tables {', '.join(tables)} ran without an "
                    f"embedding cache")
