"""A dynamic table (ids any int64, rows made on first sight) fed a Zipf stream
of hashed ids: the servers' live rows stay within the row budget, and the
admitted and expired counts equal the plain-Python reference of the policy
(runtime/engine/embedding/dynamic_reference.py), server by server. Prints JSON.

Each step: --batch lookups of Zipf(--zipf) ranks, hashed into int64 (mix64:
negative ids and ids past 2^31 included), split by server (IdSharding), each
server's `DynamicRows` applies the policy, the worker reads the rows of the
step's ids, and an SGD step on a squared loss pulling each row towards a
target writes the admitted rows (the others' gradients are dropped). The
servers run in this process, one after the other. The baseline, in the same
run on the same ids: the reference's policy alone (dicts and a heap, one id
at a time); times are medians over the steps.

    python bench/dynamic_tables.py [--steps 700] [--batch 65536] [--servers 2]
        [--row-budget 30000] [--admit-after 2] [--expire-after 30] [--quick]

The default run (45.9 M lookups) sees about 20 M distinct ids.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from splitrun.runtime.engine.embedding.dynamic_reference import ReferencePolicy
from splitrun.runtime.engine.embedding.dynamic_rows import DynamicRows
from splitrun.runtime.engine.embedding.id_sharding import IdSharding, mix64
from splitrun.splitter import DynamicTable, RowInit

DIM = 8
LR = 0.05
SEED = 0


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=700)
    parser.add_argument("--batch", type=int, default=65536)
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--zipf", type=float, default=1.05)
    parser.add_argument("--row-budget", type=int, default=30_000)
    parser.add_argument("--admit-after", type=int, default=2)
    parser.add_argument("--expire-after", type=int, default=30)
    parser.add_argument("--quick", action="store_true",
                        help="a small run for the tests (40 steps of 4096 lookups)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.batch, args.row_budget, args.expire_after = 40, 4096, 700, 10
    return args


def run(args: argparse.Namespace) -> dict:
    policy = DynamicTable(admit_after=args.admit_after, expire_after_steps=args.expire_after,
                          row_budget=args.row_budget)
    init = RowInit.normal(std=0.01, seed=SEED)
    sharding = IdSharding(args.servers)
    stores = [DynamicRows("user", DIM, policy, init=init, server=s)
              for s in range(args.servers)]
    references = [ReferencePolicy(policy, "user", s) for s in range(args.servers)]
    rng = np.random.default_rng(SEED)
    policy_s, rows_s, reference_s = [], [], []
    peak_live, distinct = [0] * args.servers, []
    mismatches = 0
    for step in range(args.steps):
        ids = mix64(rng.zipf(args.zipf, args.batch).astype(np.int64)).view(np.int64)
        distinct.append(np.unique(ids))
        parts = sharding.split_by_server(ids)
        uniques = [np.unique(part) for part, in parts]
        start = time.perf_counter()
        for store, unique in zip(stores, uniques):
            store.begin_step(step, unique)
            peak_live[store.server] = max(peak_live[store.server], store.counters.live_rows)
        policy_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        for store, unique in zip(stores, uniques):
            rows = store.read(unique)
            target = torch.from_numpy((unique % 7).astype(np.float32)).reshape(-1, 1)
            store.apply(unique, 2 * (rows - target), LR, step + 1)
        rows_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        for server, (part,) in enumerate(parts):
            outcome = references[server].step(step, part.tolist())
            mismatches += sorted(outcome.expired) != stores[server].expired_ids.tolist()
        reference_s.append(time.perf_counter() - start)
        if len(distinct) > 32:  # keep the distinct ids seen so far in one array
            distinct = [np.unique(np.concatenate(distinct))]
    num_distinct = int(np.unique(np.concatenate(distinct)).size)
    per_server = []
    for store, reference, peak in zip(stores, references, peak_live):
        c = store.counters
        per_server.append({
            "server": store.server, **c.as_dict(), "peak_live_rows": peak,
            "reference": {"admitted": reference.num_admitted, "expired": reference.num_expired,
                          "live_rows": len(reference.rows)},
            "counts_match": (c.admitted, c.expired, c.live_rows) == (
                reference.num_admitted, reference.num_expired, len(reference.rows))})
    lookups = args.steps * args.batch
    return {
        "bench": "dynamic_tables",
        "config": {"steps": args.steps, "batch": args.batch, "servers": args.servers,
                   "zipf": args.zipf, "dim": DIM, "admit_after": args.admit_after,
                   "expire_after_steps": args.expire_after, "row_budget": args.row_budget},
        "lookups": lookups,
        "distinct_ids": num_distinct,
        "servers": per_server,
        "live_rows_within_budget": all(p["peak_live_rows"] <= args.row_budget
                                       for p in per_server),
        "counts_match_reference": all(p["counts_match"] for p in per_server),
        "steps_with_different_expired_ids": mismatches,
        # Per step, all servers: the policy (DynamicRows.begin_step), the rows
        # (read, including the initializer's rows of ids not admitted, and the
        # SGD update), and the reference's policy on the same ids.
        "step_ms_median": {"policy": _ms(policy_s), "rows_read_and_update": _ms(rows_s),
                           "reference_policy": _ms(reference_s)},
        "policy_speedup_over_reference": round(sum(reference_s) / sum(policy_s), 2),
    }


def _ms(seconds: list[float]) -> float:
    return round(1e3 * statistics.median(seconds), 3)


def main(argv=None) -> None:
    print(json.dumps(run(parse(argv)), indent=2))


if __name__ == "__main__":
    main()
