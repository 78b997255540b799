"""A worker's embedding caches: what each step needs from the servers.

It binds the graph's marker ops: `cached_bags` plans every table of the step
against its cache at once (evicting, writing dirty rows back, pulling
misses), with one message per server for all of the tables (one write-back,
one pull, one prefetch of the next step's misses; a plan made ahead sends
its write-back and pull as one PUSH_PULL), then sums each bag
straight from the cached rows' slots (no row per lookup): the fused group's
tables in one FBGEMM call (`fused_bags.py`); `cached_bags_update` runs that
group's backward with SGD fused into it. `cached_lookup` and `cached_bag`
do the same for one table; `cached_bag_gradient` sums a bag's gradient per
unique id; `cached_update` applies a table's row-wise optimizer (with
several workers: its gradients go to the servers, every table's in one
message per server once the step's last table is in).

The messages themselves (one per server for every table: pushes, pulls,
prefetches) are `server_exchange.py`'s.

The cache plans a step without sorting its ids (`RowCache.plan`: each
lookup's slot from the id -> slot map; only the misses are made distinct); a
fused group's kernel sums its gradients itself. A table whose
gradient is summed here makes its ids unique once per step (`StepIds`, one
stable sort, when the gradient first asks): the gradient is summed per
unique id before it is applied to the cached rows or sent to the servers (so
a server receives each id once per worker): a bag's from its bag gradient in
that unique's order (`ops.bags.bag_gradient_rows`), an embedding's,
one row per lookup, with one `index_add_` over that step's inverse.

Consistency model:
- One worker: write-back. The update runs on the cached rows, whose optimizer
  state is cached with them; a dirty row goes back to its server when evicted
  and when the job saves or finishes. The servers' tables are then exactly what
  training with the whole table in one process gives. The next step's plan is
  made while a step computes, in a thread (`plans_ahead.py`, which says why
  that is exact). A dynamic table's too, planned in its step: its servers
  say after each pull which of the step's ids have rows (only those are
  updated) and which rows expired (`RowCache.reset`).
- Several workers: gradients go to the servers every step (each server
  averages them over the workers and updates, as parameter-server mode does),
  and a cached row older than `max_staleness` steps is pulled again before it
  is used; 0 means every row is fresh each step: parameter-server mode exactly.
- Policy NONE (no caching, any number of workers): every batch pulls all its
  rows and every gradient goes to the servers.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping

import torch

from splitrun.splitter.labels import Cluster, Label
from splitrun.splitter.ops.bags import bag_forward, bag_gradient_rows
from splitrun.splitter.ops.cache import (
    CachedTable,
    EvictionPolicy,
    cached_bag,
    cached_bag_gradient,
    cached_bags,
    cached_bags_update,
    cached_lookup,
    cached_update,
)
from splitrun.splitter.ops.sparse_updates import IN_PLACE

from ...transport.dtypes import nbytes_of
from ...transport.protocol import Transport
from .fused_bags import FusedBags
from .id_sharding import IdSharding
from .plans_ahead import PlansAhead
from .protocol import Gather, Op, nbytes_of_items
from .row_cache import BatchPlan, RowCache
from .server_exchange import Parts, ServerExchange
from .sharding import RowSharding
from .step_ids import StepIds
from .step_rows import StepRows

__all__ = ["EmbeddingClient"]

logger = logging.getLogger(__name__)

# The most bytes of rows (with their row state) one message of a flush holds.
FLUSH_MESSAGE_BYTES = 8 << 20


class EmbeddingClient:
    def __init__(self, tables: list[CachedTable], label: Label, cluster: Cluster,
                 transport: Transport, incarnation: int, *, device: torch.device | str = "cpu",
                 timeout_s: float = 120.0, first_step: int = 0,
                 fused_groups: tuple[tuple[str, ...], ...] = ()) -> None:
        self.tables = tables
        self.label = label
        self.cluster = cluster
        self.transport = transport
        self.incarnation = incarnation
        self.timeout_s = timeout_s
        self.write_back = {t.key: t.settings.write_back(cluster.num_workers) for t in tables}
        # A dynamic table not cached (several workers without staleness, or
        # policy "none") holds the step's own rows, pulled every step (step_rows.py).
        self.caches = {t.key: StepRows(t, device) if t.settings.dynamic is not None
                       and not t.settings.caches_dynamic_rows(cluster.num_workers)
                       else RowCache(t, device) for t in tables}
        self.index = {t.key: i for i, t in enumerate(tables)}
        self.sharding = {t.key: IdSharding(cluster.num_servers) if t.settings.dynamic is not None
                         else RowSharding(t.num_rows, cluster.num_servers) for t in tables}
        self.fused = {group: FusedBags([self.caches[key] for key in group])
                      for group in fused_groups}
        # A table one worker caches whole is resident: slot = id, every row
        # pulled once (at its first lookup), no plan, no misses afterwards.
        self.resident = {t.key: self.write_back[t.key] and t.settings.dynamic is None
                         and self.caches[t.key].capacity >= t.num_rows for t in tables}
        self._loaded: set[str] = set()
        self._resident_slots: dict[str, torch.Tensor] = {}  # this step's lookups
        self._step = first_step
        self._next_feeds: Mapping[str, torch.Tensor] | None = None
        self._plans: dict[str, BatchPlan] = {}
        # Write-through: this step's gradients per server, sent once every
        # such table's are in.
        self._gradients: dict[Label, Parts] = {}
        self._num_write_through = sum(not w for w in self.write_back.values())
        self.exchange = ServerExchange(self.caches, self.write_back, self.index, self.sharding,
                                       label, cluster.num_servers, transport, incarnation,
                                       timeout_s=timeout_s)
        # The next step's plans, made while this one computes (`_plan_ahead`).
        self.ahead = PlansAhead(self.caches, self.exchange.exchange, owner=label,
                                timeout_s=timeout_s, waits=self.exchange.waits)

    def begin_step(self, step: int, next_feeds: Mapping[str, torch.Tensor] | None) -> None:
        """The step about to run, and the next step's feeds if known: the
        lookups of this step then prefetch the rows the next one misses."""
        self._step = step
        self._next_feeds = next_feeds

    def bindings(self) -> dict:
        return {cached_lookup: self.lookup, cached_bag: self.bag, cached_bags: self.bags,
                cached_bags_update: self.bags_update, cached_bag_gradient: self.bag_gradient,
                cached_update: self.update}

    @property
    def counters(self) -> dict[str, dict]:
        return {key: cache.counters.as_dict() for key, cache in self.caches.items()}

    @property
    def waits(self) -> dict[str, float]:
        """Seconds blocked for rows: for replies to prefetches (what the
        prefetch did not hide) and to pulls made in the step itself."""
        return self.exchange.waits

    def hit_rate(self) -> float | None:
        """The last step's hits over its distinct ids, over the tables a
        worker caches (None if it caches none: a dynamic table's rows are
        pulled every step with several workers)."""
        caches = [c for c in self.caches.values() if isinstance(c, RowCache)]
        if not caches:
            return None
        hits = sum(c.counters.last_step.get("hits", 0) for c in caches)
        unique = sum(c.counters.last_step.get("unique_ids", 0) for c in caches)
        return hits / unique if unique else 0.0

    # -- bound to the graph's marker ops --

    def lookup(self, ids: torch.Tensor, *, table: str) -> torch.Tensor:
        slots = self._lookup_slots([(table, ids)])[0]
        cache = self.caches[table]
        return cache.rows.index_select(0, slots.to(cache.device)).reshape(
            *ids.shape, cache.table.dim)

    def bag(self, ids: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None, *,
            table: str, mean: bool, padding_idx: int | None) -> torch.Tensor:
        return self.bags([ids], [offsets], [weights], tables=(table,), means=(mean,),
                         padding_idxs=(padding_idx,))[0]

    def bags(self, ids: list[torch.Tensor], offsets: list[torch.Tensor],
             weights: list[torch.Tensor | None], *, tables: tuple[str, ...],
             means: tuple[bool, ...], padding_idxs: tuple[int | None, ...]
             ) -> tuple[torch.Tensor, ...]:
        """Bags of cached rows for several tables: one plan and one exchange
        with each server for all of them; each lookup reads its row's slot in
        place (no row per lookup is gathered), as `sparse_bag` reads the whole
        table; a fused group's tables in one kernel call."""
        slots = self._lookup_slots(list(zip(tables, ids)))
        out: list[torch.Tensor | None] = [None] * len(tables)
        position = {table: index for index, table in enumerate(tables)}
        for group, fused in self.fused.items():
            if group[0] in position:  # the split put a group in one cached_bags
                where = [position[key] for key in group]
                for index, rows in zip(where, fused.forward([slots[i] for i in where],
                                                            [offsets[i] for i in where])):
                    out[index] = rows
        for index, table in enumerate(tables):
            if out[index] is None:
                out[index] = bag_forward(self.caches[table].rows, slots[index], ids[index],
                                         offsets[index], weights[index], means[index],
                                         padding_idxs[index])
        return tuple(out)

    def bags_update(self, grads: list[torch.Tensor], lr: torch.Tensor, step: torch.Tensor, *,
                    tables: tuple[str, ...]) -> None:
        """A fused group's bag gradients applied to its cached rows by one
        backward-and-SGD call; the rows it looked up are dirty."""
        fused = self.fused[tables]
        fused.backward_update(grads, lr, maximize=bool(
            self.caches[tables[0]].table.optimizer_settings.get("maximize", False)))
        for table in tables:
            plan = self._plans.pop(table, None)
            # A plan's distinct slots (a third of its lookups on the bench), in numpy.
            slots = plan.used_slots if plan is not None else self._resident_slots.pop(table)
            self.caches[table].mark_dirty(slots)

    def bag_gradient(self, grad: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor,
                     weights: torch.Tensor | None, *, table: str, mean: bool,
                     padding_idx: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A bag's gradient summed per unique id, grouped by the lookup's unique."""
        plan = self._plans.get(table)
        step_ids = plan.ids if plan is not None and plan.ids.holds(ids) else StepIds.of(ids)
        return step_ids.unique, bag_gradient_rows(grad, ids, offsets, weights, mean,
                                                  padding_idx, step_ids.order, step_ids.starts)

    def _lookup_slots(self, lookups: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        """The cache slot of each lookup's row, every row in place: resident
        tables' slots are their ids; the others are planned (`_plan_tables`)."""
        planned = [(t, ids) for t, ids in lookups if not self.resident[t]]
        plans = dict(zip((t for t, _ in planned), self._plan_tables(planned))) if planned else {}
        slots = []
        for table, ids in lookups:
            if table in plans:
                slots.append(plans[table].lookup_slots)
                continue
            self._load_resident(table)
            flat = ids.reshape(-1).to("cpu", torch.int64)
            self.caches[table].check_ids(flat)
            count = flat.numel()  # every lookup hits (counted per lookup)
            self.caches[table].counters.record(lookups=count, unique_ids=count, hits=count,
                                               misses=0, evictions=0, bytes_pulled=0,
                                               bytes_pushed=0, planned_ahead=0)
            self._resident_slots[table] = flat
            slots.append(flat)
        return slots

    def _load_resident(self, table: str) -> None:
        """Pull every row of a resident table into slot = id (once)."""
        if table in self._loaded:
            return
        cache = self.caches[table]
        ids = torch.arange(cache.table.num_rows)
        requests = [(server, positions, self.exchange.request(server, Op.PULL, self._step, [
            (table, [ids.index_select(0, positions)])]))
            for server, positions in self.exchange.by_server(table, ids)]
        pulled = 0
        for server, positions, seq in requests:
            (reply,) = self.exchange.reply_parts(server, seq, [table], "pulled")
            cache.install(positions, reply[0], dict(zip(cache.table.state_names, reply[1:])),
                          fresh_for=self._step)
            pulled += nbytes_of(reply)
        cache.make_resident()
        cache.counters.bytes_pulled += pulled
        self._loaded.add(table)

    def _plan_tables(self, lookups: list[tuple[str, torch.Tensor]], *,
                     ahead: bool = True) -> list[BatchPlan]:
        """Plan each table's ids against its cache (or take the plan made
        while the last step computed); evicted dirty rows go back and misses
        are pulled in one message per server for all the tables; then the
        next step's plans are made while this step computes (`_plan_ahead`),
        or the next step's misses asked for (`_prefetch`)."""
        keys = [table for table, _ in lookups]
        if len(set(keys)) < len(keys):  # a table looked up twice: one after the other
            return [plan for lookup in lookups
                    for plan in self._plan_tables([lookup], ahead=False)]
        done, unmoved = self.ahead.take(self._step, lookups)
        ahead_made = set(done) | set(unmoved)
        now = [(table, ids) for table, ids in lookups if table not in ahead_made]
        if now or unmoved:
            done.update(self._plan_now(now, unmoved))
        plans = []
        for table, ids in lookups:
            plan, pulled, pushed = done[table]
            # A hit is a row served without a pull (a stale cached row is a miss).
            misses = plan.pull_ids.numel()
            self.caches[table].counters.record(
                lookups=ids.numel(), unique_ids=plan.num_unique,
                hits=plan.num_unique - misses, misses=misses, evictions=plan.evictions,
                bytes_pulled=pulled, bytes_pushed=pushed, planned_ahead=int(table in ahead_made))
            self._plans[table] = plan
            plans.append(plan)
        planned_ahead = self._plan_ahead(keys) if ahead else set()
        self.exchange.prefetch([table for table in keys if table not in planned_ahead],
                              self._next_feeds, self._step)
        return plans

    def _plan_now(self, lookups: list[tuple[str, torch.Tensor]],
                  planned: dict[str, BatchPlan]) -> dict[str, tuple[BatchPlan, int, int]]:
        """Plan the tables' ids in the step and move the rows of these plans
        and of `planned` (plans made ahead whose rows did not move): (plan,
        bytes pulled, bytes pushed) per table."""
        keys = [table for table, _ in lookups] + list(planned)
        plans = []
        for table, ids in lookups:
            cache = self.caches[table]
            plans.append(cache.plan(ids, self._step, write_back=self.write_back[table],
                                    max_staleness=cache.table.settings.max_staleness))
        plans += planned.values()
        pushed = self.exchange.write_back([(t, p.evicted_ids, p.evicted_slots)
                                           for t, p in zip(keys, plans)], self._step)
        pulled = self.exchange.pull(list(zip(keys, plans)), self._step)
        return {table: (plan, pulled.get(table, 0), pushed.get(table, 0))
                for table, plan in zip(keys, plans)}

    # -- planning the next step while this one computes --

    def _plan_ahead(self, tables: list[str]) -> set[str]:
        """Plan the next batch of the write-back tables among `tables` in a
        thread, now, while this step computes (`plans_ahead.py`: evict,
        write back, pull and install, as the next step's own plan would, one
        message per server). The tables it will plan."""
        if self._next_feeds is None:
            return set()
        lookups = []
        for table in tables:
            cache = self.caches[table]
            feed = cache.table.ids_feed
            # A dynamic table's servers make each step's rows as its pull comes.
            if (not self.write_back[table] or self.resident[table]
                    or cache.table.settings.dynamic is not None
                    or table in self.ahead.excluded or cache.policy is EvictionPolicy.NONE
                    or feed is None or feed not in self._next_feeds):
                continue
            lookups.append((table, self._next_feeds[feed]))
        return self.ahead.start(self._step + 1, lookups)

    def close(self) -> None:
        """End the planning thread (once its plan in progress is made)."""
        self.ahead.close()

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
            slots = cache.slots_of(ids) if slots is None else slots
            if cache.dynamic:  # only rows their servers have are trained
                live = cache.live.index_select(0, slots)
                if not bool(live.all()):
                    cache.counters.dropped_gradients += int((~live).sum())
                    slots, summed = slots[live], summed[live.to(summed.device)]
            slots = slots.to(cache.device)
            # In place: rows leave the cache only as copies (gathers, pushes).
            IN_PLACE[cache.table.optimizer](cache.rows, slots, summed, lr, step,
                                            *(cache.state[n] for n in cache.table.state_names),
                                            is_coalesced=True, **cache.table.optimizer_settings)
            cache.dirty.index_fill_(0, slots.cpu(), True)
            return
        values = summed.cpu()
        pushed = 0
        # Every server hears from every worker each step.
        for server, positions in self.exchange.by_server(table, ids, every_server=True):
            items = [ids.index_select(0, positions), Gather(values, positions),
                     lr.cpu(), step.cpu()]
            self._gradients.setdefault(server, []).append((table, items))
            pushed += nbytes_of_items(items[:2])
        cache.counters.bytes_pushed += pushed
        cache.counters.last_step["bytes_pushed"] = pushed
        if sum(len(parts) for parts in self._gradients.values()) == (
                self._num_write_through * len(self.exchange.servers)):
            gradients, self._gradients = self._gradients, {}
            for server, parts in gradients.items():
                self.exchange.request(server, Op.GRADS, self._step, parts)

    # -- end of training, checkpoints --

    def flush(self) -> None:
        """Write every dirty row back (write-back mode); requests stay in order,
        so a later dump sees them. In messages of at most `FLUSH_MESSAGE_BYTES`
        of rows: caches of hundreds of MB never go back as one message built
        in memory beside them (a message that large does not fit in a
        shared-memory ring, so it is copied out first)."""
        self.ahead.settle_all()
        parts, size = [], 0  # the next messages' rows, every table's (one per server)
        for table, cache in self.caches.items():
            ids, slots = cache.dirty_slots()
            row_bytes = cache.table.row_bytes
            start = 0
            while start < ids.numel():
                take = min(ids.numel() - start, max(1, (FLUSH_MESSAGE_BYTES - size) // row_bytes))
                parts.append((table, ids[start:start + take], slots[start:start + take]))
                size += take * row_bytes
                start += take
                if size + row_bytes > FLUSH_MESSAGE_BYTES:
                    self._write_back_counted(parts)
                    parts, size = [], 0
        if parts:
            self._write_back_counted(parts)

    def _write_back_counted(self, parts: list[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
        for table, pushed in self.exchange.write_back(parts, self._step).items():
            self.caches[table].counters.bytes_pushed += pushed

    def drain_prefetch(self) -> None:
        """Take the replies of prefetches no step will use (the last batch's)."""
        self.ahead.settle_all()
        self.exchange.drain_prefetch()

    def save_rows(self, directory: str, steps_done: int) -> dict[str, bytes]:
        """Worker 0, for a sharded checkpoint: every server writes its rows of
        every table into `directory` (after the dirty rows went back and every
        step's updates are in); their reports, by server."""
        self.drain_prefetch()
        self.flush()
        path = torch.frombuffer(bytearray(directory.encode()), dtype=torch.uint8)
        requests = [(server, self.exchange.request(server, Op.SAVE, steps_done, [], [path]))
                    for server in self.exchange.servers]
        return {str(server): bytes(self.exchange.reply(server, seq)[0].numpy())
                for server, seq in requests}

    def dump(self, steps_done: int, tables: Collection[str] | None = None
             ) -> dict[str, torch.Tensor]:
        """Worker 0: every table (of `tables`, if given) and its row state,
        whole, from the servers."""
        self.drain_prefetch()
        self.flush()
        result = {}
        for table in self.tables:
            if tables is not None and table.key not in tables:
                continue
            if table.settings.dynamic is not None:
                result.update(self._dump_dynamic(table, steps_done))
                continue
            rows = torch.empty(table.num_rows, table.dim, dtype=table.dtype)
            state = {n: torch.empty_like(rows) for n in table.state_names}
            requests = [(server, self.exchange.request(server, Op.DUMP, steps_done,
                                                       [(table.key, [])]))
                        for server in self.exchange.servers]
            for server, seq in requests:
                reply = self.exchange.reply(server, seq)
                ids = self.sharding[table.key].ids_of(server.rank)
                rows[ids] = reply[0]
                for name, value in zip(table.state_names, reply[1:]):
                    state[name][ids] = value
            result[table.key] = rows
            result.update({f"{table.key}.{n}": v for n, v in state.items()})
        return result

    def _dump_dynamic(self, table, steps_done: int) -> dict[str, torch.Tensor]:
        """A dynamic table's live rows, their ids (`<key>.ids`, ascending)
        and row state, from every server."""
        requests = [(server, self.exchange.request(server, Op.DUMP, steps_done,
                                                   [(table.key, [])]))
                    for server in self.exchange.servers]
        parts = [self.exchange.reply(server, seq) for server, seq in requests]
        ids = torch.cat([part[0] for part in parts])
        order = torch.argsort(ids)
        names = (table.key, *(f"{table.key}.{n}" for n in table.state_names))
        result = {f"{table.key}.ids": ids[order]}
        for index, name in enumerate(names, start=1):
            result[name] = torch.cat([part[index] for part in parts])[order]
        return result
