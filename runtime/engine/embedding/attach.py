"""Attach embedding caching to one process of an embedding-cache split: a
worker gets an `EmbeddingClient` (and the executor bindings for the graph's
cache ops), a server an `EmbeddingStore` serving its slices of the tables."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from splitrun.splitter.initial_state import free_storages
from splitrun.splitter.labels import Label, Role
from splitrun.splitter.plan import SplitPlan
from splitrun.splitter.splitting.graph_splitter import SplitProgram
from splitrun.splitter.splitting.mode import ModeArtifacts

from ...transport.contract import ChannelContract
from ...transport.protocol import Transport
from .client import EmbeddingClient
from .protocol import PREFIX, reply_channel, request_channel
from .store import EmbeddingStore

__all__ = ["CacheParts", "attach_cache", "cached_tables_of"]

# A worker's step and the thread that plans its next step (`EmbeddingClient`)
# share the GIL: each op of the step lets it go, and getting it back from the
# planning thread's numpy work waited up to Python's switch interval (5 ms by
# default) every time. A shorter one gave the bench's LRU job 5-25 % more
# samples/s (4 of 4 interleaved pairs, a loaded 2-core machine).
_WORKER_SWITCH_INTERVAL_S = 0.0005


@dataclass
class CacheParts:
    client: EmbeddingClient | None = None
    store: EmbeddingStore | None = None
    bindings: dict = field(default_factory=dict)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.store is not None:
            self.store.stop()


def cached_tables_of(split: SplitProgram) -> ModeArtifacts | None:
    """The split's artifacts when it caches tables (`tables`, `initial`,
    `fused_groups`), or None when it caches none."""
    return split.artifacts if split.artifacts.tables else None


def attach_cache(split: SplitProgram, label: Label, transport: Transport, incarnation: int, *,
                 state: Mapping[str, torch.Tensor], device: torch.device | str = "cpu",
                 first_step: int = 0, timeout_s: float = 120.0,
                 free_tables: bool = False) -> CacheParts:
    """`state`: where a checkpoint's tables are (whole, or a server's
    `LocalRows`); without them the tables start from their values at capture
    (or, with a row initializer, from it, lazily). `free_tables`: a server
    frees the whole tables (and row states) once it has copied its shard:
    their memory is given back, and every tensor sharing it (the model's
    table on this process) holds 0 bytes from then on (only for a process of
    its own: threads of one process share the model)."""
    cache = cached_tables_of(split)
    if cache is None:
        return CacheParts()
    tables = list(cache.tables)
    state = {key: state.get(key, value) for key, value in cache.initial.items()}
    cluster = split.plan.cluster
    transport.register(_receive_contracts(split.plan, label))
    if label.role is Role.WORKER:
        # Process-wide; only ever lowered (a shorter interval set by the user stays).
        sys.setswitchinterval(min(sys.getswitchinterval(), _WORKER_SWITCH_INTERVAL_S))
        client = EmbeddingClient(tables, label, cluster, transport, incarnation,
                                 device=device, timeout_s=timeout_s, first_step=first_step,
                                 fused_groups=cache.fused_groups)
        return CacheParts(client=client, bindings=client.bindings())
    store = EmbeddingStore(tables, label, cluster, transport, incarnation, state,
                           first_step=first_step)
    if free_tables:
        free_storages([*cache.initial.values(), *state.values()])
    transport.route(PREFIX, store.on_message)
    store.start()
    return CacheParts(store=store)


def _receive_contracts(plan: SplitPlan, label: Label) -> dict[str, ChannelContract]:
    """Workers receive the servers' replies, servers the workers' requests; their
    sizes change every message, so only the sender is checked.

    Lendable (`later_bytes` 0): a shared-memory ring may hand a large request
    or reply over in place, no copy out of the ring (`row_copy` moves rows
    from any address at its speed). Both ends drop a message's tensors once
    its rows are copied (a server's write-back into its shard, a worker's
    pulled rows into cache slots), and a ring lends at most half of itself:
    what is held longer (gradients waiting for the other workers', a
    prefetch's reply waiting for its step) only makes later messages copied
    again."""
    if label.role is Role.WORKER:
        return {reply_channel(server): ChannelContract(server, None, later_bytes=0)
                for server in plan.labels if server.role is Role.SERVER}
    return {request_channel(worker): ChannelContract(worker, None, later_bytes=0)
            for worker in plan.labels if worker.role is Role.WORKER}
