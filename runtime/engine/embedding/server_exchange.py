"""A worker's messages to the embedding servers about its cached tables.

The client (`client.py`) decides what a step needs: which rows to evict,
write back and pull. This module carries that out with one message per
server for every table: a PUSH of evicted rows, a PULL of misses, both as
one PUSH_PULL where every table pulled from that server is written back,
the GRADS of write-through tables, and the prefetch of the next step's
misses, whose replies travel while this step computes. Rows are `Gather`ed
from the caches into a message as it is sent, so nothing may write an
evicted slot before its message is out. Requests are numbered per worker;
the number keys the reply.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Mapping

import numpy as np
import torch

from splitrun.splitter.labels import Label
from splitrun.splitter.ops.cache import EvictionPolicy

from ...errors import CacheError
from ...transport.dtypes import nbytes_of
from ...transport.protocol import MessageKey, Transport
from .protocol import (
    Gather,
    Item,
    Op,
    nbytes_of_items,
    reply_channel,
    request,
    request_channel,
    send_message,
)
from .row_cache import BatchPlan, RowCache
from .sharding import RowSharding

__all__ = ["ServerExchange", "Parts"]

# Each table's tensors in one message: [(table, items)].
Parts = list[tuple[str, list[Item]]]

# No ids: a table's empty part of a message.
_NO_ROWS = torch.empty(0, dtype=torch.int64)
_NO_IDS = _NO_ROWS.numpy()


class ServerExchange:
    """The requests and replies between one worker and every server, for
    the tables of `caches` (`write_back[table]`: its rows and row state go
    back to the servers, else its gradients do). `waits` adds up the
    seconds blocked for rows: for replies to prefetches (what the prefetch
    did not hide) and to pulls made in the step itself."""

    def __init__(self, caches: dict[str, RowCache], write_back: dict[str, bool],
                 index: dict[str, int], sharding: dict[str, RowSharding], label: Label,
                 num_servers: int, transport: Transport, incarnation: int, *,
                 timeout_s: float) -> None:
        self.caches = caches
        self.write_back_tables = write_back
        self.index = index
        self.sharding = sharding
        self.label = label
        self.servers = [Label.server(k) for k in range(num_servers)]
        self.transport = transport
        self.incarnation = incarnation
        self.timeout_s = timeout_s
        self.waits = {"prefetched": 0.0, "pulled": 0.0}
        self._seq = itertools.count()
        # Prefetch requests not yet answered: (server, seq, [(table, ids)], the
        # step they were asked at: their rows are fresh for it).
        self._prefetch_requests: list[tuple[Label, int, list[tuple[str, torch.Tensor]], int]] = []
        # Prefetched rows per table: [(ids, reply tensors, step they are fresh for)].
        self._prefetched: dict[str, list[tuple[torch.Tensor, list[torch.Tensor], int]]] = {}

    # -- one message --

    def request(self, server: Label, op: Op, step: int, parts: Parts, extra=()) -> int:
        """One request to `server` about the tables of `parts` (each table's
        tensors, rows `Gather`ed into the message as it is sent); its
        sequence number, which keys the reply."""
        seq = next(self._seq)
        message = request(op, step, [self.index[table] for table, _ in parts],
                          [tensors for _, tensors in parts], extra)
        send_message(self.transport, server,
                     MessageKey(self.incarnation, seq, request_channel(self.label)), message)
        return seq

    def reply(self, server: Label, seq: int, waited: str | None = None) -> list[torch.Tensor]:
        """The reply to request `seq`; the time blocked for it is added to
        `self.waits[waited]`."""
        started = time.perf_counter()
        reply = self.transport.recv(server, MessageKey(self.incarnation, seq,
                                                       reply_channel(server)), self.timeout_s)
        if waited is not None:
            self.waits[waited] += time.perf_counter() - started
        return reply

    def reply_parts(self, server: Label, seq: int, tables: list[str], waited: str | None
                    ) -> list[list[torch.Tensor]]:
        """A pull's reply, split by table: rows, and the row state of
        write-back tables."""
        reply = self.reply(server, seq, waited)
        parts, start = [], 0
        for table in tables:
            size = 1 + (len(self.caches[table].table.state_names)
                        if self.write_back_tables[table] else 0)
            if self._sees_ids(table):  # has rows, expired, state starts
                size += 3
            parts.append(reply[start:start + size])
            start += size
        if start != len(reply):
            raise CacheError(f"[{self.label.describe()}] {server.describe()} answered a pull of "
                             f"{len(tables)} tables with {len(reply)} tensors, expected {start}")
        return parts

    def _sees_ids(self, table: str) -> bool:
        """A dynamic table this worker caches (write-back or, with several
        workers, stale up to `max_staleness`; a `StepRows` holds only the
        step's rows): its pulls name the step's ids seen beside the ids
        wanted, and its replies say which have rows and which expired."""
        cache = self.caches[table]
        return cache.table.settings.dynamic is not None and isinstance(cache, RowCache)

    def by_server(self, table: str, ids: torch.Tensor, *, every_server: bool = False
                  ) -> Iterator[tuple[Label, torch.Tensor]]:
        """(server, positions in `ids` of the ids it holds) for each server
        holding some of `ids` (`every_server`: each one), in rank order.
        Positions, not masks: `index_select` gathers faster than a mask."""
        by_server = self.sharding[table].positions_by_server(ids)
        for server, positions in zip(self.servers, by_server):
            if every_server or positions.numel():
                yield server, positions

    # -- rows in and out of the caches --

    def pull(self, plans: list[tuple[str, BatchPlan]], step: int) -> dict[str, int]:
        """Install the rows the plans need: from prefetch replies where they
        hold them, from the servers otherwise (one request per server for
        every table, fresh for `step`); bytes pulled per table."""
        pulled = dict.fromkeys((table for table, _ in plans), 0)
        self._receive_prefetched(list(pulled))
        needed = {}
        seen = {table: plan.unique_ids for table, plan in plans if self._sees_ids(table)}
        for table, plan in plans:
            cache = self.caches[table]
            ids, slots = plan.pull_ids, plan.pull_slots
            for prefetched_ids, reply, fresh_for in self._prefetched.pop(table, []):
                pulled[table] += nbytes_of(reply)
                if ids.numel() == 0:
                    continue
                # Both sorted and unique: where each prefetched id is in `ids`, if there.
                position = torch.searchsorted(ids, prefetched_ids).clamp_(max=ids.numel() - 1)
                found = ids.index_select(0, position) == prefetched_ids
                if not bool(found.all()):  # some were cached meanwhile
                    got = found.nonzero().reshape(-1)
                    position = position.index_select(0, got)
                    reply = [t.index_select(0, got) for t in reply]
                cache.install(slots.index_select(0, position), reply[0],
                              dict(zip(cache.table.state_names, reply[1:])), fresh_for=fresh_for)
                keep = torch.ones_like(ids, dtype=torch.bool).index_fill_(0, position, False)
                ids, slots = ids.masked_select(keep), slots.masked_select(keep)
            needed[table] = (ids, slots)
        for table, count in self.fetch(needed, step, waited="pulled", seen=seen).items():
            pulled[table] += count
        return pulled

    def exchange(self, plans: list[tuple[str, BatchPlan]], step: int, waited: str | None
                 ) -> tuple[dict[str, int], dict[str, int]]:
        """Write back the plans' evicted rows and pull their misses, fresh for
        `step`: one message per server for both (`fetch`); (bytes pulled,
        bytes pushed) per table. Nothing may write the evicted slots before:
        their rows are gathered into the messages as they are sent."""
        pushes, pushed = self.push_parts([(t, p.evicted_ids, p.evicted_slots)
                                          for t, p in plans])
        pulled = self.fetch({t: (p.pull_ids, p.pull_slots) for t, p in plans}, step, waited,
                            pushes, {t: p.unique_ids for t, p in plans if self._sees_ids(t)})
        return pulled, pushed

    def fetch(self, needed: dict[str, tuple[torch.Tensor, torch.Tensor]], step: int,
              waited: str | None, pushes: dict[Label, Parts] | None = None,
              seen: dict[str, torch.Tensor] | None = None) -> dict[str, int]:
        """Pull each table's ids (sorted) from the servers into its cache's
        slots, one request per server for every table, fresh for `step`;
        bytes pulled per table. `pushes` (`push_parts`), rows to write back
        first, ride in the same message (PUSH_PULL) where every table pulled
        from that server is written back; else in a PUSH before it. `seen`:
        the step's distinct ids of each dynamic table cached here (its
        servers make the step's rows from them, and say which have rows)."""
        pulled = dict.fromkeys(needed, 0)
        seen = seen or {}
        # Per server: (table, the ids it holds, their slots).
        by_server: dict[Label, list[tuple[str, np.ndarray, np.ndarray]]] = {}
        # Per server and cached dynamic table: the step's ids it owns.
        seen_by_server: dict[tuple[Label, str], np.ndarray] = {}
        for table, (ids, slots) in needed.items():
            # A dynamic table's servers each hear every worker's ids of a step
            # (none, too): they make the step's rows once all are in.
            every_server = self.caches[table].table.settings.dynamic is not None
            if ids.numel() == 0 and not every_server:
                continue
            parts = self.sharding[table].split_by_server(ids.numpy(), slots.numpy())
            if table in seen:
                for server, (server_seen,) in zip(
                        self.servers, self.sharding[table].split_by_server(seen[table].numpy())):
                    seen_by_server[server, table] = server_seen
            for server, (server_ids, server_slots) in zip(self.servers, parts):
                if server_ids.size or every_server:
                    by_server.setdefault(server, []).append((table, server_ids, server_slots))

        def pull_part(server: Label, table: str, ids: np.ndarray) -> list[torch.Tensor]:
            if table in seen:
                return [torch.from_numpy(seen_by_server.get((server, table), _NO_IDS)),
                        torch.from_numpy(ids)]
            return [torch.from_numpy(ids)]
        pushes = pushes or {}
        requests = []
        for server in self.servers:
            parts, push = by_server.get(server, []), dict(pushes.get(server, ()))
            if push and not (parts and all(self.write_back_tables[table]
                                           for table, _, _ in parts)):
                self.request(server, Op.PUSH, step, list(push.items()))
                push = {}
            if not parts:
                continue
            if not push:
                requests.append((server, parts, self.request(
                    server, Op.PULL, step,
                    [(table, pull_part(server, table, ids)) for table, ids, _ in parts])))
                continue
            # Tables pushed to this server and pulled from it, then pushed only.
            pulled_here = {table for table, _, _ in parts}
            parts += [(table, _NO_IDS, _NO_IDS) for table in push if table not in pulled_here]
            requests.append((server, parts, self.request(server, Op.PUSH_PULL, step, [
                (table, [*(push.get(table) or self._no_push(table)),
                         *pull_part(server, table, ids)])
                for table, ids, _ in parts])))
        for server, parts, seq in requests:
            replies = self.reply_parts(server, seq, [table for table, _, _ in parts], waited)
            for (table, _, slots), reply in zip(parts, replies):
                cache = self.caches[table]
                pulled[table] = pulled.get(table, 0) + nbytes_of(reply)
                # Row state comes only to a worker that updates the rows itself.
                state_names = cache.table.state_names if self.write_back_tables[table] else ()
                if slots.size:
                    cache.install(torch.from_numpy(slots), reply[0],
                                  dict(zip(state_names, reply[1:1 + len(state_names)])),
                                  fresh_for=None if self.write_back_tables[table] else step)
                if table in seen:
                    # Expired rows start over first: one made again this step has a row.
                    has_rows, expired, starts = reply[1 + len(state_names):]
                    cache.reset(expired, dict(zip(cache.table.state_names, starts.tolist())))
                    cache.mark_live(torch.from_numpy(seen_by_server.get((server, table),
                                                                        _NO_IDS)), has_rows)
        return pulled

    def _no_push(self, table: str) -> list[torch.Tensor]:
        """A PUSH_PULL's part for a table with no rows to write back."""
        cache = self.caches[table]
        rows = torch.empty(0, cache.table.dim, dtype=cache.table.dtype)
        return [_NO_ROWS, rows, *(rows for _ in cache.table.state_names)]

    def write_back(self, evicted: list[tuple[str, torch.Tensor, torch.Tensor]], step: int
                   ) -> dict[str, int]:
        """Push the rows of each table's `ids` (in cache `slots`, not yet
        overwritten) to their servers, one message per server for every
        table; bytes pushed per table."""
        by_server, pushed = self.push_parts(evicted)
        for server, parts in by_server.items():
            self.request(server, Op.PUSH, step, parts)
        return pushed

    def push_parts(self, evicted: list[tuple[str, torch.Tensor, torch.Tensor]]
                   ) -> tuple[dict[Label, Parts], dict[str, int]]:
        """The parts of the write-back of each table's `ids` (in cache
        `slots`) by server, the rows to be gathered as their message is sent;
        bytes pushed per table."""
        by_server: dict[Label, Parts] = {}
        pushed = {}
        for table, ids, slots in evicted:
            if not self.write_back_tables[table] or ids.numel() == 0:
                continue
            cache = self.caches[table]
            pushed[table] = 0
            parts = self.sharding[table].split_by_server(ids.numpy(), slots.numpy())
            for server, (server_ids, server_slots) in zip(self.servers, parts):
                if not server_ids.size:
                    continue
                # Gathered from the cache straight into the message as it is sent
                # (below, before any slot is written over).
                if cache.row_array is not None:  # the cache's views, a plan's slots
                    rows = [cache.row_array, *(cache.state_arrays[n]
                                               for n in cache.table.state_names)]
                    where = server_slots
                else:
                    rows = [cache.rows, *(cache.state[n] for n in cache.table.state_names)]
                    where = torch.from_numpy(server_slots)
                items = [torch.from_numpy(server_ids), *(Gather(r, where) for r in rows)]
                by_server.setdefault(server, []).append((table, items))
                pushed[table] += nbytes_of_items(items)
        return by_server, pushed

    # -- the next step's misses, asked for while this one computes --

    def prefetch(self, tables: list[str], next_feeds: Mapping[str, torch.Tensor] | None,
                 step: int) -> None:
        """Ask now (at `step`) for the next batch's missing rows of `tables`,
        in one request per server, so the replies travel while this step
        computes. Only where a row read a step early is allowed: one worker
        (its cache holds the only writes), or staleness >= 1."""
        if next_feeds is None:
            return
        wanted = []
        for table in tables:
            cache = self.caches[table]
            feed = cache.table.ids_feed
            settings = cache.table.settings
            if feed is None or feed not in next_feeds or settings.dynamic is not None or (
                    not self.write_back_tables[table] and (
                        settings.max_staleness < 1 or settings.policy is EvictionPolicy.NONE)):
                continue
            next_ids = next_feeds[feed].reshape(-1).to("cpu", torch.int64)
            try:
                wanted.append((table, cache.uncached_ids(next_ids)))
            except CacheError:  # ids past the table: refused at their own step, not this one
                continue
        by_server: dict[Label, list[tuple[str, torch.Tensor]]] = {}
        for table, ids in wanted:
            for server, positions in self.by_server(table, ids):
                by_server.setdefault(server, []).append((table, ids.index_select(0, positions)))
        for server, parts in by_server.items():
            seq = self.request(server, Op.PULL, step, [(table, [ids]) for table, ids in parts])
            self._prefetch_requests.append((server, seq, parts, step))

    def _receive_prefetched(self, tables: list[str]) -> int:
        """Take the replies of prefetch requests that hold rows of `tables`
        (their other tables' rows are kept for those tables' lookups); the
        bytes received."""
        wanted, pending, received = set(tables), [], 0
        for server, seq, parts, asked_at in self._prefetch_requests:
            if not wanted & {table for table, _ in parts}:
                pending.append((server, seq, parts, asked_at))
                continue
            replies = self.reply_parts(server, seq, [table for table, _ in parts], "prefetched")
            for (table, ids), reply in zip(parts, replies):
                self._prefetched.setdefault(table, []).append((ids, reply, asked_at))
                received += nbytes_of(reply)
        self._prefetch_requests = pending
        return received

    def drain_prefetch(self) -> None:
        """Take the replies of prefetches no step will use (the last batch's)."""
        for server, seq, _, _ in self._prefetch_requests:
            self.reply(server, seq)
        self._prefetch_requests = []
        self._prefetched.clear()
