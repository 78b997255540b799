"""Embedding-cache mode at run time: the servers' table store, the workers'
row caches and client, the messages between them, and the glue that attaches
them to one process."""

from .attach import CacheParts, attach_cache, cached_tables_of
from .client import EmbeddingClient
from .row_cache import RowCache
from .sharding import RowSharding
from .step_ids import StepIds
from .store import EmbeddingStore

__all__ = ["CacheParts", "attach_cache", "cached_tables_of", "EmbeddingClient", "RowCache",
           "RowSharding", "StepIds", "EmbeddingStore"]
