"""Attach embedding caching to one process of an embedding-cache plan: a
worker gets an `EmbeddingClient` (and the executor bindings for the graph's
cache ops), a server an `EmbeddingStore` serving its slices of the tables."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from splitrun.splitter.labels import Label, Role
from splitrun.splitter.plan import SplitPlan

from .client import EmbeddingClient
from .protocol import PREFIX
from .store import EmbeddingStore
from ..transport.protocol import Transport

__all__ = ["CacheParts", "attach_cache"]


@dataclass
class CacheParts:
    client: EmbeddingClient | None = None
    store: EmbeddingStore | None = None
    bindings: dict = field(default_factory=dict)

    def close(self) -> None:
        if self.store is not None:
            self.store.stop()


def attach_cache(plan: SplitPlan, label: Label, transport: Transport, incarnation: int, *,
                 state: Mapping[str, torch.Tensor], device: torch.device | str = "cpu",
                 first_step: int = 0, timeout_s: float = 120.0) -> CacheParts:
    """`state`: where a checkpoint's tables are (whole); without them the
    tables start from their values at capture."""
    extras = plan.program.extras if plan.program is not None else {}
    tables = extras.get("cache_tables")
    if not tables:
        return CacheParts()
    initial = extras["cache_initial"]
    state = {key: state.get(key, value) for key, value in initial.items()}
    if label.role is Role.WORKER:
        client = EmbeddingClient(tables, label, plan.cluster, transport, incarnation,
                                 device=device, timeout_s=timeout_s, first_step=first_step)
        return CacheParts(client=client, bindings=client.bindings())
    store = EmbeddingStore(tables, label, plan.cluster, transport, incarnation, state,
                           first_step=first_step)
    transport.route(PREFIX, store.on_message)
    store.start()
    return CacheParts(store=store)
