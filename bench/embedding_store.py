"""A server's CPU per request of the embedding cache's throughput job, next to
the copies it cannot avoid. Prints JSON.

The requests are those `bench/embedding_cache.py --part throughput` sends
each step (LRU 20 %, 1 worker, 2 servers, write-back): one PUSH_PULL per
server for 8 tables of 250 000 x 128 float32 rows, each table's part about
900 evicted rows written back and 1 150 misses pulled (the job moves 7.2 and
9.4 MB a step). Server 0's `EmbeddingStore` handles them in this process,
its reply filled straight into a reused buffer (as into a shared-memory
ring's slot, `Transport.send_filled`). The baseline, in the same run on the
same buffers and rows: the copies alone (per table, one whole-row gather of
the pulled rows and one scatter of the written-back rows by numpy index),
what no handling of the request can go below without moving fewer rows.
CPU time of this thread (`time.thread_time`), medians of --repeats rounds
of --requests requests each.

--lazy-rows: the tables have a row initializer (their rows lazy: a row gets its
slot when first named, issue 40); the first round makes the rows, reported
apart (`first_round_cpu_ms`), the median over the others.

    python bench/embedding_store.py [--requests 40] [--repeats 5]
        [--optimizer sgd|adagrad] [--lazy-rows]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch

from splitrun.runtime.engine.embedding.protocol import Op, request
from splitrun.runtime.engine.embedding.row_copy import RowArray
from splitrun.runtime.engine.embedding.sharding import RowSharding
from splitrun.runtime.engine.embedding.store import EmbeddingStore
from splitrun.runtime.transport.buffers import MessageLayout
from splitrun.runtime.transport.protocol import MessageKey
from splitrun.splitter import CachedTable, CacheSettings, Cluster, EvictionPolicy, Label, RowInit

TABLES, ROWS, DIM = 8, 250_000, 128
PUSHED, PULLED = 900, 1_150  # rows per table and request (see the docstring)
STATE = {"sgd": (), "adagrad": ("sum",)}
SEED = 0
# Bounds one round of requests (~0.2 s of CPU each on this machine).
RUN_TIMEOUT_S = 120


class _FilledReplies:
    """The transport's side the store uses: replies filled into one reused buffer."""

    def __init__(self) -> None:
        self.wire = torch.empty(0, dtype=torch.uint8)

    def send_filled(self, dst, key, specs, fill) -> None:
        layout = MessageLayout(specs)
        if self.wire.numel() < layout.total_bytes:
            self.wire = torch.empty(layout.total_bytes, dtype=torch.uint8)
        fill(layout.views_on_wire(self.wire[:layout.total_bytes]))

    def send(self, dst, key, tensors) -> None:
        pass

    def abort(self, error: BaseException) -> None:
        raise error


def _requests(count: int, state_names: tuple[str, ...]) -> list[list[torch.Tensor]]:
    """PUSH_PULLs to server 0: per table, distinct ids of its rows, sorted."""
    generator = torch.Generator().manual_seed(SEED)
    ids = RowSharding(ROWS, 2).ids_of(0)
    requests = []
    for _ in range(count):
        parts = []
        for _ in range(TABLES):
            chosen = ids[torch.randperm(ids.numel(), generator=generator)[:PUSHED + PULLED]]
            pushed, pulled = chosen[:PUSHED].sort().values, chosen[PUSHED:].sort().values
            parts.append([pushed, *(torch.randn(PUSHED, DIM, generator=generator)
                                    for _ in range(1 + len(state_names))), pulled])
        requests.append(request(Op.PUSH_PULL, len(requests), list(range(TABLES)), parts))
    return requests


def _copies_only(arrays: list[RowArray], sharding: RowSharding, parts, out: torch.Tensor):
    """The baseline: per table, the pulled rows gathered into `out` and the
    written-back rows scattered in, by numpy index (no request handling)."""
    for array, (pushed, *rows, pulled) in zip(arrays, parts):
        array.take_into(out[:pulled.numel()], sharding.local_rows(pulled, 0))
        where = sharding.local_rows(pushed, 0)
        array.put(where, rows[0])


def _served_ms(store: EmbeddingStore, clock: int, requests) -> float:
    """CPU ms of the serving thread per request of `requests`, all queued at
    once; an empty pull after them tells when they are done."""
    worker, done = Label.worker(0), threading.Event()
    last = len(requests)
    store.set_request_hook(lambda step: done.set() if step == last else None)
    started = time.clock_gettime(clock)
    for step, tensors in enumerate(requests):
        store.on_message(MessageKey(0, step, "bench"), worker, tensors)
    store.on_message(MessageKey(0, last, "bench"), worker,
                     request(Op.PULL, last, [0], [[torch.empty(0, dtype=torch.int64)]]))
    if not done.wait(timeout=RUN_TIMEOUT_S) or store.error is not None:
        raise RuntimeError(f"the store did not serve the requests: {store.error}")
    return 1e3 * (time.clock_gettime(clock) - started) / len(requests)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--optimizer", choices=sorted(STATE), default="sgd")
    parser.add_argument("--lazy-rows", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    state_names = STATE[args.optimizer]
    init = RowInit.normal(seed=SEED) if args.lazy_rows else None
    tables = [CachedTable(f"tables.{i}.weight", ROWS, DIM, torch.float32,
                          CacheSettings(ROWS // 5, EvictionPolicy.LRU, init=init),
                          args.optimizer, {}, state_names, f"batch.{i + 1}")
              for i in range(TABLES)]
    generator = torch.Generator().manual_seed(SEED)
    initial = {}
    for table in tables:
        initial[table.key] = torch.empty(ROWS, DIM, device="meta") if init else \
            torch.randn(ROWS, DIM, generator=generator)
        initial.update({f"{table.key}.{n}": torch.rand(ROWS, DIM, generator=generator)
                        for n in state_names})
    server = Label.server(0)
    store = EmbeddingStore(tables, server, Cluster(1, 2), _FilledReplies(), 0, initial)
    del initial
    requests = _requests(args.requests, state_names)
    # The baseline copies into and out of a buffer of the same size and layout.
    baseline = RowArray(torch.randn(TABLES * (ROWS // 2), DIM, generator=generator))
    arrays = [RowArray(baseline.rows[i * (ROWS // 2):(i + 1) * (ROWS // 2)])
              for i in range(TABLES)]
    sharding = RowSharding(ROWS, 2)
    out = torch.empty(PULLED, DIM)
    parts_of = [[r[2 + i * 3:5 + i * 3] for i in range(TABLES)] for r in requests] if (
        not state_names) else None
    store.start()
    serving = next(t for t in threading.enumerate() if t.name == f"splitrun-embedding-{server}")
    clock = time.pthread_getcpuclockid(serving.ident)
    store_ms, copies_ms = [], []
    try:
        for _ in range(args.repeats):
            store_ms.append(_served_ms(store, clock, requests))
            if parts_of is not None:
                started = time.thread_time()
                for parts in parts_of:
                    _copies_only(arrays, sharding, parts, out)
                copies_ms.append(1e3 * (time.thread_time() - started) / len(requests))
    finally:
        store.stop()
    first_round = None
    if args.lazy_rows and len(store_ms) > 1:  # the first round made the rows
        first_round, store_ms = store_ms[0], store_ms[1:]
    report = {"benchmark": "embedding_store", "optimizer": args.optimizer,
              "lazy_rows": args.lazy_rows,
              "request": f"PUSH_PULL, {TABLES} tables x ({PUSHED} rows written back + "
                         f"{PULLED} pulled), rows of {DIM} float32",
              "requests": args.requests, "repeats": args.repeats,
              "store_cpu_ms_per_request": round(statistics.median(store_ms), 3),
              "runs_store_cpu_ms": [round(v, 3) for v in store_ms]}
    if first_round is not None:
        report["first_round_cpu_ms"] = round(first_round, 3)
    if copies_ms:
        floor = statistics.median(copies_ms)
        report.update({"copies_only_cpu_ms_per_request": round(floor, 3),
                       "runs_copies_only_cpu_ms": [round(v, 3) for v in copies_ms],
                       "store_over_copies_only": round(statistics.median(store_ms) / floor, 3)})
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
