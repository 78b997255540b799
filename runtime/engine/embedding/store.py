"""A server's slices of the cached tables, and the thread that serves the
workers' requests (see protocol.py: one request carries every table's part).

Requests are handled one at a time in arrival order, so a worker's write-back
of a row is applied before its later pull of the same row. With several
workers, gradients of a step are applied once every worker's arrived (in
worker order, averaged, as parameter-server mode does), and a pull or dump that
needs a step's updates waits, parked, until they are applied.

Lazy rows: a table with a row initializer (`CacheSettings.init`) gets no rows
at start-up; a row gets a slot in its shard's buffer (`row_slots.RowSlots`)
when a request first names it, made then from the initializer (its row-wise
optimizer state from its starting value). A table without one starts from
the model's values: the server copies its shard of them at start-up (the
caller may then free the whole table, see `attach_cache`).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from splitrun.splitter.labels import Cluster, Label
from splitrun.splitter.ops.cache import CachedTable
from splitrun.splitter.ops.row_init import RowInit
from splitrun.splitter.ops.sparse_updates import IN_PLACE

from ...cluster.process_memory import refuse_beyond_memory_cap
from ...errors import MessageRejected, SplitrunError
from ...transport.protocol import MessageKey, Transport
from .dynamic_rows import DynamicRows, check_dynamic_ids
from .huge_pages import empty_rows
from .id_sharding import IdSharding
from .protocol import Gather, Item, Op, read_request, reply_channel, request, send_message
from .row_copy import RowArray
from .row_slots import RowSlots
from .sharding import RowSharding

__all__ = ["EmbeddingStore", "ShardSnapshot", "LocalRows", "LiveSnapshot", "LiveRows"]

logger = logging.getLogger(__name__)

# How often the serving thread looks at its stop flag while idle.
_IDLE_POLL_S = 0.2


@dataclass(frozen=True)
class RowsToWrite:
    """A shard's rows (or one of its row states) in local order, made only
    when a checkpoint writes them (`make()`), one table at a time: a server
    never holds a copy of every shard at once."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[], torch.Tensor]


@dataclass(frozen=True)
class ShardSnapshot:
    """A server's rows of one table, for a sharded checkpoint: rows
    [first_row, first_row + len(ids)) of the table in hash order."""

    table: str                          # the table's state key
    num_rows: int                       # rows of the whole table
    first_row: int
    ids: torch.Tensor                   # the ids of these rows
    tensors: dict[str, RowsToWrite]     # state key -> these rows (the table, its row state)


@dataclass(frozen=True)
class LocalRows:
    """One server's rows of a table (or of one of its row states) in local
    order, as a sharded checkpoint holds them: what a resumed server starts
    from instead of the whole table."""

    first_row: int                      # its first row in hash order
    values: torch.Tensor                # [its rows, dim]


@dataclass(frozen=True)
class LiveSnapshot:
    """A server's live set of one dynamic table, for a sharded checkpoint:
    `DynamicRows.snapshot()` (ids, rows, row state, policy columns)."""

    table: str
    server: int
    tensors: dict[str, torch.Tensor]


@dataclass(frozen=True)
class LiveRows:
    """What a resumed server's dynamic table starts from: the saved live sets
    (`DynamicRows.snapshot()`s, of any number of servers), each cut to the
    ids this server owns."""

    snapshots: tuple[dict[str, torch.Tensor], ...]


# A sharded save: (directory, step, this server's shards) -> the writer's report.
SaveHandler = Callable[[str, int, list["ShardSnapshot | LiveSnapshot"]], bytes]


@dataclass
class _Group:
    """Tables whose rows one row-wise update call can train together (same
    width, dtype, optimizer and settings): their shards are consecutive row
    ranges of one buffer (and one per row state), viewed once for the
    serving thread's row copies (`arrays`: "rows", then each state's name)."""

    rows: torch.Tensor
    state: dict[str, torch.Tensor]
    arrays: dict[str, RowArray] = field(init=False)

    def __post_init__(self) -> None:
        self.arrays = {"rows": RowArray(self.rows),
                       **{name: RowArray(value) for name, value in self.state.items()}}


@dataclass
class _Shard:
    table: CachedTable
    sharding: RowSharding
    rows: torch.Tensor                      # a view of its group's rows
    state: dict[str, torch.Tensor]
    applied_step: int                       # updates of steps <= this are in
    write_back: bool                        # the worker updates rows it caches
    group: _Group
    base: int                               # its first row in the group's buffer
    size: int                               # its rows
    # Lazy rows: which buffer slot holds each local row (None: slot = local index).
    slots: RowSlots | None = None
    # Each row state's starting value (lazy rows' state starts as it).
    state_start: dict[str, float] = field(default_factory=dict)
    pending: dict[int, dict[int, tuple]] = field(default_factory=dict)  # step -> worker -> grads


@dataclass
class _DynamicShard:
    """This server's rows of a dynamic table (`DynamicRows`: made, admitted
    and expired as its policy says). A step's rows are made once every
    worker's ids of the step are in (`sightings`) and the step before is
    applied; the workers' gradients of a step are applied together."""

    table: CachedTable
    rows: DynamicRows
    sharding: IdSharding
    applied_step: int
    begun_step: int                                # the last step whose rows were made
    sightings: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)
    pending: dict[int, dict[int, tuple]] = field(default_factory=dict)
    # One worker caching its rows writes them back (else gradients come).
    write_back: bool = False
    # The workers keep its rows between steps (write-back, or stale): their
    # pulls name the step's ids seen, and replies say which have rows.
    cached: bool = False


def _group_key(table: CachedTable) -> tuple:
    return (table.dim, table.dtype, table.state_names, table.optimizer,
            tuple(sorted(table.optimizer_settings.items())))


def _pull_size(shard: _Shard | _DynamicShard) -> int:
    """Tensors per table a pull names: the ids wanted; a cached dynamic
    table's, the step's ids seen first (see protocol.py)."""
    return 2 if isinstance(shard, _DynamicShard) and shard.cached else 1


def _part_size(op: Op, shard: _Shard | _DynamicShard) -> int:
    """Tensors per table in a request (see protocol.py)."""
    if op is Op.PUSH:
        return 2 + len(shard.table.state_names)
    if op is Op.PUSH_PULL:
        return 2 + len(shard.table.state_names) + _pull_size(shard)
    return 4 if op is Op.GRADS else _pull_size(shard)


def _state_start(value: torch.Tensor | LocalRows | None) -> float:
    """A row state's starting value (the optimizer makes it uniform: Adagrad's
    initial accumulator, Adam's zeros), read off its initial tensor where
    that holds values (not on `meta`, not freed)."""
    if isinstance(value, LocalRows):
        value = value.values
    if value is None or value.device.type == "meta" or value.numel() == 0 or \
            value.untyped_storage().nbytes() == 0:
        return 0.0
    return float(value.reshape(-1)[0])


class EmbeddingStore:
    """`initial`: each table's (and row state's) starting values, whole or
    this server's `LocalRows` (a checkpoint's); a table with a row
    initializer and no `LocalRows` there starts empty, its rows lazy."""

    def __init__(self, tables: list[CachedTable], label: Label, cluster: Cluster,
                 transport: Transport, incarnation: int,
                 initial: Mapping[str, torch.Tensor | LocalRows], first_step: int = 0) -> None:
        self.label = label
        self.cluster = cluster
        self.transport = transport
        self.incarnation = incarnation
        self._tag = f"[{label.describe()}]"
        self.shards = []
        members: dict[tuple, list[CachedTable]] = {}
        shard_of: dict[str, _Shard | _DynamicShard] = {}
        for table in tables:
            if table.settings.dynamic is not None:
                shard_of[table.key] = self._dynamic_shard(table, initial, first_step)
            else:
                members.setdefault(_group_key(table), []).append(table)
        # A shard copied at start-up (no row initializer) is written whole, now.
        refuse_beyond_memory_cap(
            {table.key: RowSharding(table.num_rows, cluster.num_servers).shard_size(label.rank)
             * table.dim * table.dtype.itemsize * (1 + len(table.state_names))
             for table in tables if table.settings.dynamic is None and (
                 table.settings.init is None or isinstance(initial.get(table.key), LocalRows))},
            self._tag, "its shards of the cached tables (rows and their optimizer state)",
            "give the tables a row initializer (place_embedding_cache(..., init=RowInit."
            "normal(...)): rows get memory when first used), more memory, or more servers "
            "(each holds 1/S of every table's rows)")
        for group_tables in members.values():
            shardings = [RowSharding(t.num_rows, cluster.num_servers) for t in group_tables]
            sizes = [sharding.shard_size(label.rank) for sharding in shardings]
            first = group_tables[0]
            group = _Group(empty_rows((sum(sizes), first.dim), first.dtype),
                           {n: empty_rows((sum(sizes), first.dim), first.dtype)
                            for n in first.state_names})
            base = 0
            for table, sharding, size in zip(group_tables, shardings, sizes):
                rows = group.rows[base:base + size]
                state = {name: group.state[name][base:base + size] for name in table.state_names}
                lazy = table.settings.init is not None and \
                    not isinstance(initial.get(table.key), LocalRows)
                if not lazy:
                    self._copy_shard(table, sharding, rows, state, initial)
                shard_of[table.key] = _Shard(
                    table, sharding, rows, state, first_step - 1,
                    table.settings.write_back(cluster.num_workers), group, base, size,
                    RowSlots(size) if lazy else None,
                    {name: _state_start(initial.get(f"{table.key}.{name}"))
                     for name in table.state_names})
                base += size
        self.shards = [shard_of[table.key] for table in tables]
        # Row-wise update calls run (one per group and step with several workers).
        self.update_calls = 0
        self._inbox: queue.Queue = queue.Queue()
        self._parked: list[tuple[MessageKey, Label, list[torch.Tensor]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True,
                                        name=f"splitrun-embedding-{label}")
        self.error: BaseException | None = None
        self.requests_served = 0
        self._request_hook: Callable[[int], None] | None = None
        self._save_handler: SaveHandler | None = None

    def _dynamic_shard(self, table: CachedTable, initial: Mapping[str, torch.Tensor | LocalRows],
                       first_step: int) -> _DynamicShard:
        budget = table.settings.dynamic.row_budget
        if budget is not None:  # the most rows (with their state) it may come to hold
            refuse_beyond_memory_cap(
                {table.key: budget * table.row_bytes}, self._tag,
                f"the row budget of dynamic table {table.key!r} ({budget} rows of "
                f"{table.row_bytes} bytes with their state) would",
                "lower DynamicTable(row_budget=...), give the server more memory, or use more "
                "servers (each holds its own ids' rows)")
        rows = DynamicRows(
            table.key, table.dim, table.settings.dynamic, init=table.settings.init,
            dtype=table.dtype, optimizer=table.optimizer,
            optimizer_settings=table.optimizer_settings, state_names=table.state_names,
            server=self.label.rank,
            state_start={name: _state_start(initial.get(f"{table.key}.{name}"))
                         for name in table.state_names})
        sharding = IdSharding(self.cluster.num_servers)
        saved = initial.get(table.key)
        if isinstance(saved, LiveRows):  # resumed: the checkpoint's live set, this server's
            rows.restore(list(saved.snapshots), sharding)
        workers = self.cluster.num_workers
        return _DynamicShard(table, rows, sharding, first_step - 1, first_step - 1,
                             write_back=table.settings.write_back(workers),
                             cached=table.settings.caches_dynamic_rows(workers))

    def dynamic_counters(self) -> dict[str, dict]:
        """Per dynamic table: its counters on this server (live rows, admitted,
        expired, waiting, dropped gradients, bytes)."""
        return {shard.table.key: shard.rows.counters.as_dict() for shard in self.shards
                if isinstance(shard, _DynamicShard)}

    def _copy_shard(self, table: CachedTable, sharding: RowSharding, rows: torch.Tensor,
                    state: dict[str, torch.Tensor],
                    initial: Mapping[str, torch.Tensor | LocalRows]) -> None:
        """This server's rows of `table` (and their state) from `initial`."""
        ids = None
        for key, out in ((table.key, rows),
                         *((f"{table.key}.{n}", state[n]) for n in table.state_names)):
            value = initial[key]
            if isinstance(value, LocalRows):
                if value.first_row != sharding.bounds[self.label.rank] or \
                        tuple(value.values.shape) != tuple(out.shape):
                    raise SplitrunError(
                        f"{self._tag} table {key}: the rows given from row "
                        f"{value.first_row}, shape {list(value.values.shape)}, are not this "
                        f"server's rows (from row {sharding.bounds[self.label.rank]}, shape "
                        f"{list(out.shape)})")
                out.copy_(value.values)
            else:
                if ids is None:
                    ids = sharding.ids_of(self.label.rank)
                torch.index_select(value, 0, ids, out=out)

    def rows_made(self) -> dict[str, tuple[int, int]]:
        """Per table: (rows of this server's shard that have values now, the
        shard's rows). Lazy rows count once first used; a shard copied at
        start-up has all of them."""
        made = {}
        for shard in self.shards:
            if isinstance(shard, _DynamicShard):
                live = shard.rows.counters.live_rows
                made[shard.table.key] = (live, shard.rows.policy.row_budget or live)
            else:
                made[shard.table.key] = (shard.size if shard.slots is None else
                                         shard.slots.used, shard.size)
        return made

    def set_request_hook(self, hook: Callable[[int], None] | None) -> None:
        """Call `hook(step)` in the serving thread before each request of that
        training step is handled (a profiler of the server's work hooks in
        here: the serving thread is where it runs)."""
        self._request_hook = hook

    def set_save_handler(self, handler: SaveHandler) -> None:
        """What writes this server's rows when worker 0 asks for a sharded save."""
        self._save_handler = handler

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout=timeout_s)

    def on_message(self, key: MessageKey, src: Label, tensors: list[torch.Tensor]) -> None:
        """Called by the transport's receiving thread: queue it, never block."""
        self._inbox.put((key, src, tensors))

    # -- serving --

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                message = self._inbox.get(timeout=_IDLE_POLL_S)
            except queue.Empty:
                continue
            if not self._serve_one(*message):
                return
            # Drop the request before waiting for the next one: a message lent
            # from a shared-memory ring holds its room until its tensors are
            # gone, and the next message (a flush's write-back larger than the
            # room left) may need that room to arrive at all.
            del message

    def _serve_one(self, key: MessageKey, src: Label, tensors: list[torch.Tensor]) -> bool:
        """Handle one request; False once the store has failed (the job is told)."""
        try:
            if self._request_hook is not None:
                self._request_hook(read_request(tensors)[1])
            self._handle(key, src, tensors)
            self.requests_served += 1
            return True
        except BaseException as exc:  # noqa: BLE001 - the job must learn about it
            self.error = exc
            logger.error("%s embedding request %s from %s failed: %s", self._tag, key,
                         src.describe(), exc)
            self.transport.abort(SplitrunError(
                f"{self._tag} embedding store failed on a request from "
                f"{src.describe()}: {exc}"))
            return False

    def _handle(self, key: MessageKey, src: Label, tensors: list[torch.Tensor]) -> None:
        op, step, indices, rest = read_request(tensors)
        for index in indices:
            if not 0 <= index < len(self.shards):
                raise MessageRejected(f"{self._tag} embedding request from {src.describe()} "
                                      f"names table {index}; this job caches "
                                      f"{len(self.shards)} tables")
        shards = [self.shards[i] for i in indices]
        if op in (Op.PUSH, Op.PUSH_PULL) and any(isinstance(s, _DynamicShard)
                                                 and not s.write_back for s in shards):
            raise MessageRejected(f"{self._tag} embedding {op.name} from {src.describe()} "
                                  f"writes rows of a dynamic table back; with several "
                                  f"workers a dynamic table's workers send gradients "
                                  f"(GRADS), never rows")
        if op is Op.PUSH:
            self._push(shards, self._parts(rest, shards, op))
        elif op is Op.PUSH_PULL:
            others = [shard.table.key for shard in shards if not shard.write_back]
            if others:
                raise MessageRejected(f"{self._tag} embedding PUSH_PULL from {src.describe()} "
                                      f"names tables the workers do not write back: {others}")
            parts = self._parts(rest, shards, op)
            pulls = [tensor for shard, part in zip(shards, parts)
                     for tensor in part[len(part) - _pull_size(shard):]]
            pushes = [part[:len(part) - _pull_size(shard)] for shard, part in zip(shards, parts)]
            if any(isinstance(shard, _DynamicShard) for shard in shards):
                # Rows written back before the step's rows are made: they
                # had rows until then (an expiry may drop them now).
                self._push(shards, pushes)
                self._pull(key, src, step, indices, shards, pulls)
                return
            # One plan's misses (rows the worker does not cache) and victims
            # (rows it did) are distinct: the reply it waits for goes first.
            self._answer(key, src, Op.PULL, shards, pulls)
            self._push(shards, pushes)
        elif op is Op.GRADS:
            complete = []
            for shard, part in zip(shards, self._parts(rest, shards, op)):
                shard.pending.setdefault(step, {})[src.rank] = tuple(part)
                if len(shard.pending[step]) == self.cluster.num_workers:
                    complete.append((shard, shard.pending.pop(step)))
            if complete:
                self._apply(complete, step)
                self._retry_parked()
        elif op is Op.SAVE:
            if all(self._ready(s, op, step) for s in self.shards):
                self._save(key, src, step, rest[0])
            else:
                self._parked.append((key, src, tensors))
        elif op is Op.PULL:
            self._pull(key, src, step, indices, shards, rest)
        elif op is Op.DUMP:
            if all(self._ready(shard, op, step) for shard in shards):
                self._answer(key, src, op, shards, rest)
            else:
                self._parked.append((key, src, tensors))
        else:
            raise MessageRejected(f"unknown embedding request {op}")

    def _pull(self, key: MessageKey, src: Label, step: int, indices: list[int], shards: list,
              parts: list[torch.Tensor]) -> None:
        """Answer a pull of `step` (`parts`: each table's), or park it until
        its rows are ready."""
        self._hear_ids(src, step, shards, parts)
        began = self._begin_dynamic_steps(shards, step)
        if all(self._ready(shard, Op.PULL, step) for shard in shards):
            self._answer(key, src, Op.PULL, shards, parts)
        else:
            self._parked.append((key, src, request(Op.PULL, step, indices, [parts])))
        if began:  # the other workers' pulls of the step were waiting for it
            self._retry_parked()

    def _hear_ids(self, src: Label, step: int, shards: list, tensors: list[torch.Tensor]
                  ) -> None:
        """Keep a worker's ids of a step for each dynamic table of a pull
        (again, when the pull is handled again after waiting: the same ids)."""
        for shard, part in zip(shards, self._parts(tensors, shards, Op.PULL)):
            if not isinstance(shard, _DynamicShard) or step <= shard.begun_step:
                continue
            ids = part[0]  # the ids wanted, or (cached) the step's ids seen
            check_dynamic_ids(ids, shard.table.key)
            owners = shard.sharding.server_of(ids.numpy())
            if owners.size and bool((owners != self.label.rank).any()):
                raise MessageRejected(
                    f"{self._tag} a pull from {src.describe()} names ids of dynamic table "
                    f"{shard.table.key} that server {int(owners[owners != self.label.rank][0])} "
                    f"owns; the worker's sharding of the ids differs from this server's")
            shard.sightings.setdefault(step, {})[src.rank] = ids

    def _begin_dynamic_steps(self, shards: list, step: int) -> bool:
        """Make `step`'s rows of each dynamic table of `shards` (admission,
        expiry, the row budget) once every worker's ids of it are in and the
        step before is applied; True if some were made now."""
        began = False
        for shard in shards:
            if not isinstance(shard, _DynamicShard) or step <= shard.begun_step:
                continue
            heard = shard.sightings.get(step, {})
            if len(heard) < self.cluster.num_workers or (
                    not shard.write_back and shard.applied_step < step - 1):
                continue
            ids = torch.cat([heard[rank] for rank in sorted(heard)])
            del shard.sightings[step]
            shard.rows.begin_step(step, ids)
            shard.begun_step = step
            began = True
        return began

    def _push(self, shards: list[_Shard], parts: list[list[torch.Tensor]]) -> None:
        """Write rows (and their state) the worker wrote back into the shards."""
        for shard, (ids, *values) in zip(shards, parts):
            if isinstance(shard, _DynamicShard):
                self._check_row_shapes(shard, ids.numel(), values)
                shard.rows.write(ids, values[0], dict(zip(shard.table.state_names, values[1:])))
                continue
            where = self._group_rows(shard, ids)
            self._check_row_shapes(shard, where.size, values)
            for name, value in zip(("rows", *shard.table.state_names), values):
                shard.group.arrays[name].put(where, value)

    def _check_row_shapes(self, shard: _Shard | _DynamicShard, count: int,
                          values: list[torch.Tensor]) -> None:
        """A write-back of `count` rows carries [count, dim] rows and state."""
        for name, value in zip(("rows", *shard.table.state_names), values):
            if value.shape != (count, shard.table.dim):
                raise MessageRejected(
                    f"{self._tag} embedding write-back of {count} rows of "
                    f"{shard.table.key} carries {name} of shape {list(value.shape)}; "
                    f"expected [{count}, {shard.table.dim}]")

    def _group_rows(self, shard: _Shard, ids: torch.Tensor) -> np.ndarray:
        """Where the rows of `ids` lie in their shard's group buffer, checked
        to be this server's rows of the shard's table (lazy rows named for
        the first time get their slot and starting values here)."""
        self._check_ids(shard, ids)
        offset = shard.base if shard.slots is None else 0
        where = shard.sharding.local_rows(ids, self.label.rank, offset)
        if where.size and (where.min() < offset or where.max() >= offset + shard.size):
            raise MessageRejected(
                f"{self._tag} an embedding request names ids of {shard.table.key} this server "
                f"does not hold (its {shard.size} rows of {shard.table.num_rows}); the "
                f"worker's sharding of the table differs from this server's")
        if shard.slots is None:
            return where
        where, new = shard.slots.find(where, shard.base)
        if new is not None:
            self._make_rows(shard, new)
        return where

    def _check_ids(self, shard: _Shard, ids: torch.Tensor) -> None:
        if ids.dtype != torch.int64:
            raise MessageRejected(f"{self._tag} table {shard.table.key}: ids must be int64, "
                                  f"got {ids.dtype}")
        values = ids.numpy()
        if values.size and (values.min() < 0 or values.max() >= shard.table.num_rows):
            bad = values.min() if values.min() < 0 else values.max()
            raise MessageRejected(f"{self._tag} table {shard.table.key}: id {int(bad)} is "
                                  f"outside its rows [0, {shard.table.num_rows})")

    def _make_rows(self, shard: _Shard, new: np.ndarray) -> None:
        """Starting values of the lazy rows `new` (local, ascending), whose
        slots were just handed out: the last `len(new)` slots, in that order."""
        table, init = shard.table, shard.table.settings.init
        start = shard.base + shard.slots.used - new.size
        end = start + new.size
        ids = shard.sharding.ids_at(self.label.rank, new)
        shard.group.rows[start:end] = _init_rows(init, ids, table)
        for name in table.state_names:
            shard.group.state[name][start:end] = shard.state_start[name]

    def _local_order(self, shard: _Shard, name: str | None = None) -> torch.Tensor:
        """All of this server's rows of `shard`'s table (or of its row state
        `name`) in local order: a copy (lazy rows never used made from the
        initializer, their state from its starting value)."""
        source = shard.rows if name is None else shard.state[name]
        if shard.slots is None:
            return source.clone()
        table = shard.table
        if name is None:
            out = _init_rows(table.settings.init, shard.sharding.ids_of(self.label.rank), table)
        else:
            out = torch.full((shard.size, table.dim), shard.state_start[name], dtype=table.dtype)
        local, slots = shard.slots.present()
        out[torch.from_numpy(local)] = source[torch.from_numpy(slots)]
        return out

    def _parts(self, tensors: list[torch.Tensor], shards: list[_Shard], op: Op
               ) -> list[list[torch.Tensor]]:
        """Each table's tensors of a PUSH, PUSH_PULL, GRADS or PULL request."""
        sizes = [_part_size(op, shard) for shard in shards]
        if sum(sizes) != len(tensors):
            raise MessageRejected(f"{self._tag} embedding {op.name} for {len(shards)} tables "
                                  f"holds {len(tensors)} tensors after its header; expected "
                                  f"{sum(sizes)}")
        parts, start = [], 0
        for size in sizes:
            parts.append(tensors[start:start + size])
            start += size
        return parts

    def _ready(self, shard: _Shard | _DynamicShard, op: Op, step: int) -> bool:
        """With several workers, a pull fresh for `step` (or a dump after
        `step` steps) needs every earlier step's updates; a dynamic table's
        pull, the step's rows made."""
        if isinstance(shard, _DynamicShard) and op is Op.PULL:
            return shard.begun_step >= step
        return shard.write_back or shard.applied_step >= step - 1

    def _retry_parked(self) -> None:
        parked, self._parked = self._parked, []
        for key, src, tensors in parked:
            self._handle(key, src, tensors)

    def _answer(self, key, src, op, shards: list[_Shard], tensors) -> None:
        reply: list[Item] = []
        if op is Op.PULL:
            # Gathered straight into the reply's memory (a ring's slot) as it is sent.
            for shard, part in zip(shards, self._parts(tensors, shards, op)):
                if isinstance(shard, _DynamicShard):
                    reply += self._dynamic_reply(shard, part)
                    continue
                (ids,) = part
                where, arrays = self._group_rows(shard, ids), shard.group.arrays
                reply.append(Gather(arrays["rows"], where))
                if shard.write_back:  # the row's optimizer state travels with it
                    reply += [Gather(arrays[n], where) for n in shard.table.state_names]
        else:
            for shard in shards:
                if isinstance(shard, _DynamicShard):  # the live rows, with their ids
                    live = shard.rows.snapshot()
                    reply += [live["ids"], live["rows"],
                              *(live[f"state.{n}"] for n in shard.table.state_names)]
                    continue
                reply += [self._local_order(shard),
                          *(self._local_order(shard, n) for n in shard.table.state_names)]
        send_message(self.transport, src,
                     MessageKey(self.incarnation, key.step, reply_channel(self.label)), reply)

    def _dynamic_reply(self, shard: _DynamicShard, part: list[torch.Tensor]) -> list[Item]:
        """A dynamic table's part of a pull's reply: the rows wanted; a worker
        caching the rows also gets (write-back) their state, whether each id it
        saw this step has a row, the ids whose rows the step expired, and each
        row state's starting value (what an expired row it caches starts over
        from)."""
        if not shard.cached:
            return [shard.rows.read(part[0])]  # the step's rows only: no row state
        seen, wanted = part
        names = shard.table.state_names if shard.write_back else ()
        state = shard.rows.read_state(wanted) if names else {}
        return [shard.rows.read(wanted), *(state[n] for n in names),
                shard.rows.has_rows(seen), torch.from_numpy(shard.rows.expired_ids),
                torch.tensor([shard.rows.state_start[n] for n in shard.table.state_names],
                             dtype=torch.float64)]

    def _save(self, key: MessageKey, src: Label, step: int, directory: torch.Tensor) -> None:
        if self._save_handler is None:
            raise MessageRejected(f"{self._tag} got a sharded save request from "
                                  f"{src.describe()} but has no checkpoint writer")
        snapshots: list[ShardSnapshot | LiveSnapshot] = []
        for shard in self.shards:
            rank = self.label.rank
            if isinstance(shard, _DynamicShard):  # its live set (and ids waiting)
                snapshots.append(LiveSnapshot(shard.table.key, rank, shard.rows.snapshot()))
                continue
            # Every row of the shard (lazy rows not used yet from the initializer):
            # any server count reads the directory back. Made as written, in
            # this thread (no update runs meanwhile).
            shape = (shard.size, shard.table.dim)
            tensors = {shard.table.key: RowsToWrite(
                shape, shard.table.dtype, lambda shard=shard: self._local_order(shard))}
            tensors.update({f"{shard.table.key}.{n}": RowsToWrite(
                shape, shard.table.dtype, lambda shard=shard, n=n: self._local_order(shard, n))
                for n in shard.table.state_names})
            snapshots.append(ShardSnapshot(shard.table.key, shard.table.num_rows,
                                           shard.sharding.bounds[rank],
                                           shard.sharding.ids_of(rank), tensors))
        report = self._save_handler(bytes(directory.numpy()).decode(), step, snapshots)
        self.transport.send(src, MessageKey(self.incarnation, key.step, reply_channel(self.label)),
                            [torch.frombuffer(bytearray(report), dtype=torch.uint8)])

    def _apply(self, complete: list[tuple[_Shard, dict[int, tuple]]], step: int) -> None:
        """The step's update of these tables from every worker's gradient:
        concatenated in worker order, averaged, then the row-wise optimizer
        (as parameter-server mode), one call per group of tables trained
        alike (their rows one buffer: each table's local rows offset by its
        base). Each worker sends each id once (its gradient summed per unique
        id): with one worker the rows need no coalescing here."""
        num_workers = self.cluster.num_workers
        by_group: dict[int, list[tuple[_Shard, dict[int, tuple]]]] = {}
        for shard, grads in complete:
            if isinstance(shard, _DynamicShard):
                self._update_dynamic(shard, grads, num_workers)
                continue
            by_group.setdefault(id(shard.group), []).append((shard, grads))
        for members in by_group.values():
            rates = {(float(g[0][2]), float(g[0][3])) for _, g in members}
            calls = [members] if len(rates) == 1 else [[m] for m in members]
            for call in calls:
                self._update(call, num_workers)
        for shard, _ in complete:
            shard.applied_step = step

    def _update(self, members: list[tuple[_Shard, dict[int, tuple]]], num_workers: int) -> None:
        """One row-wise update call over the shards of `members` (one group,
        the same learning rate and step count)."""
        local, values = [], []
        for shard, grads in members:
            ordered = [grads[rank] for rank in range(num_workers)]
            ids = torch.cat([g[0] for g in ordered])
            local.append(torch.from_numpy(self._group_rows(shard, ids)))
            values.append(torch.cat([g[1] for g in ordered]))
        first, grads = members[0]
        lr, step_count = grads[0][2], grads[0][3]
        table, group = first.table, first.group
        # In place: replies and dumps send copies of the rows.
        IN_PLACE[table.optimizer](group.rows, torch.cat(local), torch.cat(values) / num_workers,
                                  lr, step_count, *(group.state[n] for n in table.state_names),
                                  is_coalesced=num_workers == 1, **table.optimizer_settings)
        self.update_calls += 1


    def _update_dynamic(self, shard: _DynamicShard, grads: dict[int, tuple],
                        num_workers: int) -> None:
        """A dynamic table's update of a step: every worker's gradients
        (each summed per id already) averaged, summed per id across workers,
        then the row-wise optimizer on the admitted rows."""
        ordered = [grads[rank] for rank in range(num_workers)]
        ids = torch.cat([g[0] for g in ordered])
        values = torch.cat([g[1] for g in ordered]) / num_workers
        if num_workers > 1:
            ids, inverse = torch.unique(ids, sorted=True, return_inverse=True)
            values = torch.zeros(ids.numel(), values.shape[1], dtype=values.dtype).index_add_(
                0, inverse, values)
        shard.rows.apply(ids, values, ordered[0][2], ordered[0][3])
        self.update_calls += 1


def _init_rows(init: RowInit, ids: torch.Tensor, table: CachedTable) -> torch.Tensor:
    return init.rows(ids, table.dim, table.key, num_rows=table.num_rows, dtype=table.dtype)
