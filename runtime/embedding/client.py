"""A worker's embedding caches and their conversation with the servers.

It binds the graph's marker ops: `cached_lookup` plans the batch against the
cache (evicting, writing dirty rows back, pulling misses: one message per
server) and gathers the rows; `cached_bag` plans the same way and sums each
bag straight from the cached rows' slots (no row per lookup);
`cached_bag_gradient` sums a bag's gradient per unique id; `cached_update`
applies the table's row-wise optimizer.

Each table's ids are made unique once per step (`StepIds`; a step early when
the next batch's rows are prefetched): the cache plans, counts and pulls by
unique id, and the gradient is summed per unique id before it is applied to
the cached rows or sent to the servers (so a server receives each id once per
worker): a bag's from its bag gradient in that unique's order
(`embedding_bags.bag_gradient_rows`), an embedding's, one row per lookup,
with one `index_add_` over that step's inverse.

Consistency model:
- One worker: write-back. The update runs on the cached rows, whose optimizer
  state is cached with them; a dirty row goes back to its server when evicted
  and when the job saves or finishes. The servers' tables are then exactly what
  training with the whole table in one process gives.
- Several workers: gradients go to the servers every step (each server
  averages them over the workers and updates, as parameter-server mode does),
  and a cached row older than `max_staleness` steps is pulled again before it
  is used; 0 means every row is fresh each step: parameter-server mode exactly.
- Policy NONE (no caching, any number of workers): every batch pulls all its
  rows and every gradient goes to the servers.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping

import torch

from splitrun.splitter.cached_tables import (
    CachedTable,
    EvictionPolicy,
    cached_bag,
    cached_bag_gradient,
    cached_lookup,
    cached_update,
)
from splitrun.splitter.embedding_bags import bag_forward, bag_gradient_rows
from splitrun.splitter.labels import Cluster, Label
from splitrun.splitter.sparse_optim import IN_PLACE

from .protocol import Op, header, reply_channel, request_channel
from .row_cache import BatchPlan, RowCache
from .sharding import RowSharding
from .step_ids import StepIds
from ..transport.dtypes import nbytes_of
from ..transport.protocol import MessageKey, Transport

__all__ = ["EmbeddingClient"]

logger = logging.getLogger(__name__)


class EmbeddingClient:
    def __init__(self, tables: list[CachedTable], label: Label, cluster: Cluster,
                 transport: Transport, incarnation: int, *, device: torch.device | str = "cpu",
                 timeout_s: float = 120.0, first_step: int = 0) -> None:
        self.tables = tables
        self.label = label
        self.cluster = cluster
        self.transport = transport
        self.incarnation = incarnation
        self.timeout_s = timeout_s
        self.caches = {t.key: RowCache(t, device) for t in tables}
        self.write_back = {t.key: t.settings.write_back(cluster.num_workers) for t in tables}
        self.index = {t.key: i for i, t in enumerate(tables)}
        self.sharding = {t.key: RowSharding(t.num_rows, cluster.num_servers) for t in tables}
        self.servers = [Label.server(k) for k in range(cluster.num_servers)]
        self._step = first_step
        self._next_feeds: Mapping[str, torch.Tensor] | None = None
        self._plans: dict[str, BatchPlan] = {}
        self._prefetched: dict[str, list[tuple[Label, int, torch.Tensor]]] = {}
        # The next step's ids per table, made unique when they were prefetched.
        self._next_ids: dict[str, StepIds] = {}
        self._prefetch_fresh: dict[int, int] = {}  # request seq -> step its rows are fresh for
        self._seq = itertools.count()

    def begin_step(self, step: int, next_feeds: Mapping[str, torch.Tensor] | None) -> None:
        """The step about to run, and the next step's feeds if known: the
        lookups of this step then prefetch the rows the next one misses."""
        self._step = step
        self._next_feeds = next_feeds

    def bindings(self) -> dict:
        return {cached_lookup: self.lookup, cached_bag: self.bag,
                cached_bag_gradient: self.bag_gradient, cached_update: self.update}

    @property
    def counters(self) -> dict[str, dict]:
        return {key: cache.counters.as_dict() for key, cache in self.caches.items()}

    def hit_rate(self) -> float:
        hits = sum(c.counters.last_step.get("hits", 0) for c in self.caches.values())
        unique = sum(c.counters.last_step.get("unique_ids", 0) for c in self.caches.values())
        return hits / unique if unique else 0.0

    # -- messages --

    def _request(self, server: Label, op: Op, table: str, step: int, tensors=()) -> int:
        seq = next(self._seq)
        message = [header(op, self.index[table], step), *tensors]
        self.transport.send(server, MessageKey(self.incarnation, seq,
                                               request_channel(self.label)), message)
        return seq

    def _reply(self, server: Label, seq: int) -> list[torch.Tensor]:
        return self.transport.recv(server, MessageKey(self.incarnation, seq,
                                                      reply_channel(server)), self.timeout_s)

    def _by_server(self, table: str, ids: torch.Tensor, *, every_server: bool = False):
        """(server, positions in `ids` of the ids it holds) for each server
        holding some of `ids` (`every_server`: each one), in rank order.
        Positions, not masks: `index_select` gathers faster than a mask."""
        owner = self.sharding[table].server_of(ids)
        for server in self.servers:
            positions = (owner == server.rank).nonzero().reshape(-1)
            if every_server or positions.numel():
                yield server, positions

    # -- bound to the graph's marker ops --

    def _step_ids(self, table: str, ids: torch.Tensor) -> StepIds:
        """`ids` made unique: by the prefetch of this step's rows if it saw
        these very ids, else now."""
        prepared = self._next_ids.pop(table, None)
        if prepared is not None and prepared.holds(ids):
            return prepared
        return StepIds.of(ids)

    def lookup(self, ids: torch.Tensor, *, table: str) -> torch.Tensor:
        plan = self._plan_batch(table, ids)
        return self.caches[table].gather(plan, ids.shape)

    def bag(self, ids: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None, *,
            table: str, mean: bool, padding_idx: int | None) -> torch.Tensor:
        """A bag of cached rows: each lookup reads its row's slot in place (no
        row per lookup is gathered), as `sparse_bag` reads the whole table."""
        plan = self._plan_batch(table, ids)
        cache = self.caches[table]
        return bag_forward(cache.rows, plan.slots.index_select(0, plan.inverse), ids, offsets,
                           weights, mean, padding_idx)

    def bag_gradient(self, grad: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor,
                     weights: torch.Tensor | None, *, table: str, mean: bool,
                     padding_idx: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A bag's gradient summed per unique id, grouped by the lookup's unique."""
        plan = self._plans.get(table)
        step_ids = plan.ids if plan is not None and plan.ids.holds(ids) else StepIds.of(ids)
        return step_ids.unique, bag_gradient_rows(grad, ids, offsets, weights, mean,
                                                  padding_idx, step_ids.order, step_ids.starts)

    def _plan_batch(self, table: str, ids: torch.Tensor) -> BatchPlan:
        """Plan `ids` against the cache: evictions written back, misses pulled."""
        cache = self.caches[table]
        settings = cache.table.settings
        plan = cache.plan(self._step_ids(table, ids), self._step,
                          write_back=self.write_back[table],
                          max_staleness=settings.max_staleness)
        pushed = self._write_back(table, plan.evicted_ids, plan.evicted_slots)
        pulled = self._pull(table, plan)
        # A hit is a row served without a pull (a stale cached row is a miss).
        misses = plan.pull_ids.numel()
        cache.counters.record(lookups=ids.numel(), unique_ids=plan.unique_ids.numel(),
                              hits=plan.unique_ids.numel() - misses, misses=misses,
                              evictions=plan.evictions, bytes_pulled=pulled, bytes_pushed=pushed)
        self._plans[table] = plan
        self._prefetch(table)
        return plan

    def update(self, indices: torch.Tensor, values: torch.Tensor, lr: torch.Tensor,
               step: torch.Tensor, *, table: str, coalesced: bool = False) -> None:
        """The table's gradient, one row per lookup (`indices`: the ids looked
        up), summed per unique id with the lookup's `StepIds` (`coalesced`: a
        bag's, summed already, `indices` unique), then applied to the cached
        rows (write-back) or sent to the servers."""
        cache = self.caches[table]
        plan = self._plans.pop(table, None)
        if coalesced:
            ids, summed = indices.reshape(-1).to("cpu", torch.int64), values
            slots = plan.slots if plan is not None and (
                indices is plan.unique_ids or torch.equal(ids, plan.unique_ids)) else None
        else:
            if plan is not None and plan.ids.holds(indices):
                step_ids, slots = plan.ids, plan.slots
            else:  # not this step's lookup (a table looked up twice): unique again
                step_ids, slots = StepIds.of(indices), None
            ids, summed = step_ids.unique, step_ids.reduce(values)
        padding_idx = cache.table.padding_idx
        if padding_idx is not None:  # the padding row gets no update
            keep = ids != padding_idx
            ids, summed = ids[keep], summed[keep.to(summed.device)]
            slots = None if slots is None else slots[keep]
        if self.write_back[table]:
            slots = (cache.slots_of(ids) if slots is None else slots).to(cache.device)
            # In place: rows leave the cache only as copies (gathers, pushes).
            IN_PLACE[cache.table.optimizer](cache.rows, slots, summed, lr, step,
                                            *(cache.state[n] for n in cache.table.state_names),
                                            is_coalesced=True, **cache.table.optimizer_settings)
            cache.dirty.index_fill_(0, slots.cpu(), True)
            return
        values = summed.cpu()
        pushed = 0
        # Every server hears from every worker each step.
        for server, positions in self._by_server(table, ids, every_server=True):
            tensors = [ids.index_select(0, positions), values.index_select(0, positions),
                       lr.cpu(), step.cpu()]
            self._request(server, Op.GRADS, table, self._step, tensors)
            pushed += nbytes_of(tensors[:2])
        cache.counters.bytes_pushed += pushed
        cache.counters.last_step["bytes_pushed"] = pushed

    # -- pulls, pushes, prefetch --

    def _pull(self, table: str, plan: BatchPlan) -> int:
        """Install the rows the plan needs: from this table's prefetch replies
        where they hold them, from the servers otherwise."""
        cache = self.caches[table]
        ids, slots = plan.pull_ids, plan.pull_slots
        pulled = 0
        for server, seq, prefetched_ids in self._prefetched.pop(table, []):
            reply = self._reply(server, seq)
            pulled += nbytes_of(reply)
            fresh_for = self._fresh_of(seq)
            if ids.numel() == 0:
                continue
            # Both sorted and unique: where each prefetched id is in `ids`, if there.
            position = torch.searchsorted(ids, prefetched_ids).clamp_(max=ids.numel() - 1)
            wanted = ids.index_select(0, position) == prefetched_ids
            if not bool(wanted.all()):  # some were cached meanwhile
                got = wanted.nonzero().reshape(-1)
                position = position.index_select(0, got)
                reply = [t.index_select(0, got) for t in reply]
            state = dict(zip(cache.table.state_names, reply[1:]))
            cache.install(slots.index_select(0, position), reply[0], state, fresh_for=fresh_for)
            keep = torch.ones_like(ids, dtype=torch.bool).index_fill_(0, position, False)
            ids, slots = ids.masked_select(keep), slots.masked_select(keep)
        requests = [(server, positions, self._request(server, Op.PULL, table, self._step,
                                                      [ids.index_select(0, positions)]))
                    for server, positions in self._by_server(table, ids)]
        for server, positions, seq in requests:
            reply = self._reply(server, seq)
            pulled += nbytes_of(reply)
            state = dict(zip(cache.table.state_names, reply[1:]))
            cache.install(slots.index_select(0, positions), reply[0], state,
                          fresh_for=self._step)
        return pulled

    def _fresh_of(self, seq: int) -> int:
        return self._prefetch_fresh.pop(seq, self._step)

    def _prefetch(self, table: str) -> None:
        """Ask now for the next batch's missing rows of `table`, so the reply
        travels while this step computes. Only where a row read a step early is
        allowed: one worker (its cache holds the only writes), or staleness >= 1."""
        cache = self.caches[table]
        feed = cache.table.ids_feed
        if self._next_feeds is None or feed is None or feed not in self._next_feeds:
            return
        settings = cache.table.settings
        if not self.write_back[table] and (settings.max_staleness < 1
                                           or settings.policy is EvictionPolicy.NONE):
            return
        next_ids = StepIds.of(self._next_feeds[feed])
        self._next_ids[table] = next_ids  # the next step's lookup reuses this unique
        ids = next_ids.unique
        cache.check_ids(ids)
        ids = ids.masked_select(cache.slot_of_id.index_select(0, ids) < 0)
        requests = []
        for server, positions in self._by_server(table, ids):
            wanted = ids.index_select(0, positions)
            seq = self._request(server, Op.PULL, table, self._step, [wanted])
            self._prefetch_fresh[seq] = self._step
            requests.append((server, seq, wanted))
        self._prefetched[table] = requests

    def _write_back(self, table: str, ids: torch.Tensor, slots: torch.Tensor) -> int:
        """Push the rows of `ids` (in cache `slots`, not yet overwritten) to their
        servers: one gather from the cache per server."""
        if not self.write_back[table] or ids.numel() == 0:
            return 0
        pushed = 0
        cache = self.caches[table]
        names = cache.table.state_names
        for server, positions in self._by_server(table, ids):
            rows, state = cache.rows_at(slots.index_select(0, positions))
            tensors = [ids.index_select(0, positions), rows.cpu(),
                       *(state[n].cpu() for n in names)]
            self._request(server, Op.PUSH, table, self._step, tensors)
            pushed += nbytes_of(tensors)
        return pushed

    # -- end of training, checkpoints --

    def flush(self) -> None:
        """Write every dirty row back (write-back mode); requests stay in order,
        so a later dump sees them."""
        for table, cache in self.caches.items():
            ids, slots = cache.dirty_slots()
            cache.counters.bytes_pushed += self._write_back(table, ids, slots)

    def drain_prefetch(self) -> None:
        """Take the replies of prefetches no step will use (the last batch's)."""
        for table in list(self._prefetched):
            for server, seq, _ in self._prefetched.pop(table):
                self._reply(server, seq)

    def save_rows(self, directory: str, steps_done: int) -> dict[str, bytes]:
        """Worker 0, for a sharded checkpoint: every server writes its rows of
        every table into `directory` (after the dirty rows went back and every
        step's updates are in); their reports, by server."""
        self.drain_prefetch()
        self.flush()
        path = torch.frombuffer(bytearray(directory.encode()), dtype=torch.uint8)
        first = self.tables[0].key
        requests = [(server, self._request(server, Op.SAVE, first, steps_done, [path]))
                    for server in self.servers]
        return {str(server): bytes(self._reply(server, seq)[0].numpy())
                for server, seq in requests}

    def dump(self, steps_done: int) -> dict[str, torch.Tensor]:
        """Worker 0: every table and its row state, whole, from the servers."""
        self.drain_prefetch()
        self.flush()
        result = {}
        for table in self.tables:
            rows = torch.empty(table.num_rows, table.dim, dtype=table.dtype)
            state = {n: torch.empty_like(rows) for n in table.state_names}
            requests = [(server, self._request(server, Op.DUMP, table.key, steps_done))
                        for server in self.servers]
            for server, seq in requests:
                reply = self._reply(server, seq)
                ids = self.sharding[table.key].ids_of(server.rank)
                rows[ids] = reply[0]
                for name, value in zip(table.state_names, reply[1:]):
                    state[name][ids] = value
            result[table.key] = rows
            result.update({f"{table.key}.{n}": v for n, v in state.items()})
        return result
