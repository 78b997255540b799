"""One process's share of a split program, ready to run steps.

`ProcessRuntime` assembles a process once: it attaches the embedding cache
(a worker's row cache, a server's table store) where the split caches tables,
builds the executor with the cache's bindings and loads the state the process
owns. Real processes (`Job`/`Trainer`) and threads (`run_threaded`) both drive
one through its methods, so there is one way a process is put together.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

import torch

from splitrun.splitter.initial_state import InitialState
from splitrun.splitter.labels import Label
from splitrun.splitter.splitting.graph_splitter import SplitProgram

from ..cluster.process_memory import refuse_beyond_memory_cap
from ..cluster.rendezvous import Rendezvous
from ..errors import RecvTimeout
from ..transport.protocol import MessageKey, Transport
from .allocator import keep_freed_memory
from .collectives import CollectiveStats, attach_collectives
from .embedding.attach import attach_cache
from .executor import Executor, ExecutorStats
from .worker_all_reduce import attach_worker_all_reduce

__all__ = ["ProcessRuntime"]

Feeds = Mapping[str, torch.Tensor]

# A step number no job reaches (see `serve_rows`).
_NEVER = 1 << 62


class ProcessRuntime:
    """`label`'s share of `split`, over `transport`.

    `state`: where the state starts (a full or partial dict: the initial state
    or a checkpoint's); each process takes what it owns. `first_step`: the step
    a resumed job continues at. `rendezvous`: where a parallel split's
    torch.distributed process groups are formed (needed only by such splits).
    `hparams(step)`: where the step's hyperparameters come from, if not from
    the program's optimizer when asked (threads of one process share one
    reading per step). `free_model` (a server of its own process only:
    threads of one process share the model): once it holds its own state,
    the server frees the model's tensors (`InitialState.take`) and the whole
    cached tables (`attach_cache`): the model on it then holds 0 bytes.
    """

    def __init__(self, split: SplitProgram, label: Label, transport: Transport, *,
                 incarnation: int = 0, device: str | torch.device = "cpu",
                 state: Mapping[str, torch.Tensor] | None = None, first_step: int = 0,
                 recv_timeout_s: float = 120.0, rendezvous: Rendezvous | None = None,
                 hparams: Callable[[int], dict[str, torch.Tensor]] | None = None,
                 free_model: bool = False) -> None:
        self.split = split
        self.label = label
        self._hparams = split.program.hparams if hparams is None else hparams
        # Steps allocate large outputs afresh: keep freed memory for reuse.
        keep_freed_memory()
        state = split.program.initial_state if state is None else state
        # The state this process owns, made now (only it); the model's own
        # tensors freed before the optimizer state is made.
        own = list(split.plan.process(label).state)
        if isinstance(state, InitialState):
            refuse_beyond_memory_cap(
                {key: state.nbytes(key) for key in own}, f"[{label.describe()}]",
                "the parameters and optimizer state it owns", "give it more memory, or "
                "spread the parameters over more servers (place(model, role=\"server\") "
                "balances them by size)")
            taken = state.take(own, free_sources=free_model, taker=label.describe())
            state = state.copy()
            state.update(taken)
        # The embedding store must take requests before any can arrive, so
        # it is attached before the executor (and before the caller lets the
        # plan's messages in).
        self._cache = attach_cache(split, label, transport, incarnation, state=state,
                                   device=device, first_step=first_step,
                                   timeout_s=recv_timeout_s, free_tables=free_model)
        self._collectives = attach_collectives(split, label, rendezvous, device=device,
                                               timeout_s=recv_timeout_s)
        self._worker_average = attach_worker_all_reduce(split, label, rendezvous, device=device,
                                                        timeout_s=recv_timeout_s)
        self.executor = Executor(split.plan, split.program, label, transport, device=device,
                                 incarnation=incarnation, recv_timeout_s=recv_timeout_s,
                                 bindings={**self._cache.bindings,
                                           **self._collectives.bindings,
                                           **self._worker_average.bindings})
        self.executor.load_state(state)

    # -- steps --

    def hparams(self, step: int) -> dict[str, torch.Tensor]:
        """The step's hyperparameters (learning rates, step count), read now
        from the program's optimizer (a `torch.optim` one's current rates)."""
        return self._hparams(step)

    def feeds(self, step: int, batch: Feeds | None,
              hparams: Feeds | None = None) -> dict[str, torch.Tensor]:
        """The feeds of `step`: this process's batch (None for servers) and the
        step's hyperparameters (`hparams` when read already)."""
        return {**(batch or {}), **(self.hparams(step) if hparams is None else hparams)}

    def run_step(self, step: int, batch: Feeds | None,
                 next_batch: Feeds | None = None, *,
                 hparams: Feeds | None = None) -> dict[str, torch.Tensor]:
        """Run this process's subgraph for `step`; the outputs delivered here.
        `next_batch` lets an embedding cache prefetch the next step's rows;
        `hparams`: the step's hyperparameters, if read before (else now)."""
        client = self._cache.client
        if client is not None:
            client.begin_step(step, None if next_batch is None
                              else self.feeds(step + 1, next_batch))
        return self.executor.run_step(step, self.feeds(step, batch, hparams))

    def serve_step(self, step: int, *, first_recv_timeout_s: float,
                   control: tuple[str, Callable] | None = None) -> dict[str, torch.Tensor]:
        """A serving process's step: like `run_step`, but its first receive may
        wait `first_recv_timeout_s` (the workers may spend a while between
        steps) and hands `control` messages to their handler meanwhile. Raises
        `JobFinished` when the workers finished before this step."""
        return self.executor.run_step(step, self.feeds(step, None),
                                      first_recv_timeout_s=first_recv_timeout_s,
                                      control=control)

    # -- state --

    @property
    def state(self) -> dict[str, torch.Tensor]:
        """The state this process owns, as of the last step."""
        return self.executor.state

    @property
    def state_keys(self) -> tuple[str, ...]:
        return self.split.plan.process(self.label).state

    @property
    def stats(self) -> ExecutorStats:
        return self.executor.stats

    @property
    def collective_stats(self) -> CollectiveStats | None:
        """Collectives run on a torch.distributed process group (parallel mode's
        opt-in backend, or the workers' average of dense gradients kept on
        the workers): calls and input bytes; None when there is no group."""
        group = self._collectives.group or self._worker_average.average
        return None if group is None else group.stats

    @property
    def has_cache(self) -> bool:
        return self._cache.client is not None

    @property
    def has_store(self) -> bool:
        """A server holding rows of cached tables."""
        return self._cache.store is not None

    @property
    def cache_counters(self) -> dict[str, dict]:
        """A worker, per cached table: lookups, unique ids, hits, misses,
        evictions and bytes pulled and pushed (totals and the last step's); a
        server, per dynamic table: its rows' counters (`DynamicCounters`);
        empty elsewhere."""
        client, store = self._cache.client, self._cache.store
        if client is not None:
            return client.counters
        return {} if store is None else store.dynamic_counters()

    @property
    def cache_waits(self) -> dict[str, float]:
        """Embedding-cache workers: seconds blocked for rows so far, for
        prefetched replies (what the prefetch did not hide) and for pulls made
        in the step; empty without a cache."""
        client = self._cache.client
        return {} if client is None else dict(client.waits)

    def cache_hit_rate(self) -> float | None:
        client = self._cache.client
        return None if client is None else client.hit_rate()

    def dump_tables(self, steps_done: int, tables: Collection[str] | None = None
                    ) -> dict[str, torch.Tensor]:
        """Worker 0 of an embedding-cache split: every cached table (of
        `tables`, if given) and its row state, whole, from the servers (dirty
        rows written back first)."""
        client = self._cache.client
        return {} if client is None else client.dump(steps_done, tables)

    def save_rows(self, directory: str, steps_done: int) -> dict[str, bytes]:
        """Worker 0 of an embedding-cache split: every server writes its rows
        of the cached tables into `directory`; their reports, by server."""
        client = self._cache.client
        return {} if client is None else client.save_rows(directory, steps_done)

    def set_row_writer(self, handler) -> None:
        """A server of an embedding-cache split: what writes its rows at a
        sharded save (`EmbeddingStore.set_save_handler`)."""
        if self._cache.store is not None:
            self._cache.store.set_save_handler(handler)

    def serve_rows(self, *, idle_timeout_s: float) -> None:
        """A server whose share of the step is empty (embedding-cache mode with
        dense parameters on the workers): its table store answers requests
        until the workers finish (returns then). Raises `RecvTimeout` if no
        request came for `idle_timeout_s`."""
        store = self._cache.store
        # A plan channel no one sends on, at a step no job reaches: its receive
        # ends with JobFinished once the workers report their last step.
        key = MessageKey(self.executor.incarnation, _NEVER, "rows-served-until-finished")
        served = -1
        while True:
            try:
                self.executor.transport.recv(Label.worker(0), key, idle_timeout_s)
            except RecvTimeout:
                if store is None or store.requests_served == served:
                    raise
                served = store.requests_served

    @property
    def store_rows(self) -> dict[str, tuple[int, int]]:
        """A server of an embedding-cache split: per table, (rows its store
        has made or copied, its shard's rows); empty elsewhere."""
        return {} if self._cache.store is None else self._cache.store.rows_made()

    def set_store_hook(self, hook) -> None:
        """A server of an embedding-cache split: `hook(step)` runs in its table
        store's serving thread before each request (`EmbeddingStore.set_request_hook`)."""
        if self._cache.store is not None:
            self._cache.store.set_request_hook(hook)

    def drain_prefetch(self) -> None:
        """Take the replies of prefetches no step will use (the last batch's)."""
        if self._cache.client is not None:
            self._cache.client.drain_prefetch()

    def close(self) -> None:
        self._cache.close()
        self._collectives.close()
        self._worker_average.close()
