"""What an embedding-cache plan says of its cached tables (`CachedTableEntry`):
their size, the bytes of a row as it travels, how many ids a worker looks up
per step. The plan's text form carries them, so its summary and picture show
the row traffic, which travels outside the plan's channels."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ...ops.cache import CachedTable, cached_bag, cached_lookup
from ...plan.model import CachedTableEntry
from ...program import Program

__all__ = ["cached_table_entries"]


def cached_table_entries(program: Program, tables: Sequence[CachedTable]
                         ) -> tuple[CachedTableEntry, ...]:
    """An entry per table of `program` (the worker's step, its lookups
    rewritten to the cache's): ids looked up per step are those of its
    lookups' id tensors (0 where their size is not known)."""
    lookups: dict[str, int] = {}
    for node in program.graph.nodes:
        if node.op == "call_function" and node.target in (cached_lookup, cached_bag):
            ids = node.args[0].meta.get("val") if hasattr(node.args[0], "meta") else None
            count = math.prod(ids.shape) if isinstance(ids, torch.Tensor) else 0
            table = node.kwargs["table"]
            lookups[table] = lookups.get(table, 0) + count
    entries = []
    for table in tables:
        entries.append(CachedTableEntry(table.key, table.num_rows, table.row_bytes,
                                        lookups.get(table.key, 0), table.settings.cache_rows,
                                        table.settings.policy.value))
    return tuple(entries)
