"""A dynamic table (ids any int64) trained by a real job: `splitrun launch
--workers 1 --servers 2` runs a sum bag over hashed ids and a linear layer,
the table declared without a row count, its rows made by their servers
(admission after k sightings, expiry after T steps, a row budget per
server). Prints JSON.

Each step: --batch lookups of Zipf(--zipf) ranks hashed into int64 (mix64:
negative ids and ids past 2^31 included), --lookups per sample. At the end
each server reports its table counters and its peak RSS (VmHWM); the
bench checks that the live rows stayed within the budget and that the
admitted and expired counts equal the plain-Python reference of the policy
(`dynamic_reference.py`) fed the same ids, server by server. The baseline,
in the same run: one process training the same model with the hashing
trick users reach for without dynamic tables (a bounded table of
servers x budget rows indexed by id mod rows; every row made at start);
step times are medians after a warm-up. The same job with a worker that
caches no row (`policy="none"`: every step pulls every row) runs too, and
must reach the same counts.

    python bench/dynamic_job.py [--steps 700] [--batch 65536] [--row-budget 30000]
        [--admit-after 2] [--expire-after 30] [--quick]

The default run sees about 20 M distinct ids (45.9 M lookups).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from splitrun.runtime.cluster.process_memory import own_memory
from splitrun.runtime.engine.embedding.dynamic_reference import ReferencePolicy
from splitrun.runtime.engine.embedding.id_sharding import IdSharding, mix64
from splitrun.splitter import (
    DynamicTable,
    RowInit,
    capture,
    optim,
    place,
    place_embedding_cache,
)

HERE = pathlib.Path(__file__).resolve()
DIM = 8
LR = 0.05
SEED = 0
SERVERS = 2
WARMUP_STEPS = 20
RUN_TIMEOUT_S = 1800
PREFIX = {"worker": "DYNAMIC_WORKER ", "server": "DYNAMIC_SERVER "}


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=700)
    parser.add_argument("--batch", type=int, default=65536, help="lookups a step")
    parser.add_argument("--lookups", type=int, default=4, help="ids per sample")
    parser.add_argument("--zipf", type=float, default=1.05)
    parser.add_argument("--row-budget", type=int, default=30_000)
    parser.add_argument("--admit-after", type=int, default=2)
    parser.add_argument("--expire-after", type=int, default=30)
    parser.add_argument("--cache-policy", default="lru", choices=["lru", "none"],
                        help=argparse.SUPPRESS)  # the job's: the worker's cache, or none
    parser.add_argument("--quick", action="store_true",
                        help="a small run for the tests (40 steps of 4096 lookups)")
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.batch, args.row_budget, args.expire_after = 40, 4096, 700, 10
    return args


class HashedBag(nn.Module):
    def __init__(self, rows: int = 1, device: str = "meta") -> None:
        super().__init__()
        self.table = nn.EmbeddingBag(rows, DIM, mode="sum", device=device)
        self.top = nn.Linear(DIM, 1)

    def forward(self, ids):
        return self.top(self.table(ids)).squeeze(1)


def click_loss(model, ids, label):
    return F.binary_cross_entropy_with_logits(model(ids), label)


def batches(args: argparse.Namespace):
    """The stream of (ids [samples, lookups], label), the same every call."""
    rng = np.random.default_rng(SEED)
    for _ in range(args.steps):
        ranks = rng.zipf(args.zipf, args.batch).astype(np.int64)
        ids = torch.from_numpy(mix64(ranks).view(np.int64)).reshape(-1, args.lookups)
        yield ids, (torch.from_numpy(ranks[::args.lookups]) % 2).float()


def policy_of(args: argparse.Namespace) -> DynamicTable:
    return DynamicTable(admit_after=args.admit_after, expire_after_steps=args.expire_after,
                        row_budget=args.row_budget)


def run_job(args: argparse.Namespace) -> None:
    """Inside `splitrun launch`: worker 0 prints its step times, each server
    its counters; every process its peak RSS."""
    from splitrun.runtime.job import Job
    from splitrun.splitter import EmbeddingCacheMode

    job = Job.from_env()
    torch.manual_seed(SEED)
    model = HashedBag()
    place(model.top, role="worker")
    place_embedding_cache(model.table, cache_rows=args.batch, dynamic=policy_of(args),
                          init=RowInit.normal(0.01, seed=SEED), policy=args.cache_policy)
    example = next(batches(argparse.Namespace(**{**vars(args), "steps": 1})))
    program = capture(model, click_loss, optim.SGD(lr=LR), example)
    trainer = job.start(program, EmbeddingCacheMode(), num_steps=args.steps)
    stamps = [time.perf_counter()]
    for _ in trainer.run(trainer.shard(batches(args) if job.is_worker else [])):
        stamps.append(time.perf_counter())
    trainer.finish()
    _, peak, _ = own_memory()
    role = "worker" if job.is_worker else "server"
    report = {"rank": job.label.rank, "peak_rss_mb": round(peak / 2**20, 1)}
    if job.is_worker:
        report["step_ms"] = [round(1e3 * (b - a), 3) for a, b in zip(stamps, stamps[1:])]
        report["cache"] = {k: v for k, v in trainer.cache_counters["table.weight"].items()
                           if k != "last_step"}
    else:
        report["counters"] = trainer.cache_counters["table.weight"]
    print(PREFIX[role] + json.dumps(report), flush=True)


def launch(args: argparse.Namespace, cache_policy: str) -> tuple[dict, list[dict]]:
    knobs = ["--steps", args.steps, "--batch", args.batch, "--lookups", args.lookups,
             "--zipf", args.zipf, "--row-budget", args.row_budget, "--admit-after",
             args.admit_after, "--expire-after", args.expire_after,
             "--cache-policy", cache_policy]
    command = [sys.executable, "-m", "splitrun.launcher", "--log-level", "WARNING", "launch",
               "--workers", "1", "--servers", str(SERVERS), "--device", "cpu", str(HERE),
               "--", "--job", *map(str, knobs)]
    out = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    found = {"worker": [], "server": []}
    for line in out.stdout.splitlines():
        for role, prefix in PREFIX.items():
            if prefix in line:
                found[role].append(json.loads(line.split(prefix, 1)[1]))
    if out.returncode or len(found["worker"]) != 1 or len(found["server"]) != SERVERS:
        raise RuntimeError(f"the job failed ({out.returncode}):\n{out.stdout[-4000:]}\n"
                           f"{out.stderr[-4000:]}")
    return found["worker"][0], sorted(found["server"], key=lambda s: s["rank"])


def reference(args: argparse.Namespace) -> tuple[list[ReferencePolicy], int]:
    """The policy in plain Python on the job's ids, per server; the distinct ids seen."""
    policy, sharding = policy_of(args), IdSharding(SERVERS)
    references = [ReferencePolicy(policy, "table.weight", s) for s in range(SERVERS)]
    distinct = []
    for step, (ids, _) in enumerate(batches(args)):
        unique = np.unique(ids.numpy())
        distinct.append(unique)
        if len(distinct) > 32:
            distinct = [np.unique(np.concatenate(distinct))]
        for server, (part,) in enumerate(sharding.split_by_server(unique)):
            references[server].step(step, part.tolist())
    return references, int(np.unique(np.concatenate(distinct)).size)


def hashing_trick(args: argparse.Namespace) -> dict:
    """The same model and stream in one process, a bounded table of
    servers x budget rows indexed by id mod rows (torch's sparse SGD)."""
    rows = SERVERS * args.row_budget
    torch.manual_seed(SEED)
    model = HashedBag(rows, device="cpu")
    model.table.sparse = True
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    stamps = [time.perf_counter()]
    for ids, label in batches(args):
        optimizer.zero_grad()
        click_loss(model, ids.remainder(rows), label).backward()
        optimizer.step()
        stamps.append(time.perf_counter())
    _, peak, _ = own_memory()
    return {"step_ms": [1e3 * (b - a) for a, b in zip(stamps, stamps[1:])],
            "peak_rss_mb": round(peak / 2**20, 1)}


def _median_ms(step_ms: list[float]) -> float:
    return round(statistics.median(step_ms[WARMUP_STEPS:] or step_ms), 3)


def run(args: argparse.Namespace) -> dict:
    worker, servers = launch(args, "lru")
    # The same job whose worker caches no row: every step pulls every row.
    uncached_worker, uncached_servers = launch(args, "none")
    baseline = hashing_trick(args)  # before the reference: its peak RSS is this process's
    references, distinct = reference(args)
    per_server = []
    for server, ref in zip(servers, references):
        c = server["counters"]
        per_server.append({
            "server": server["rank"], "peak_rss_mb": server["peak_rss_mb"],
            **{k: c[k] for k in ("live_rows", "peak_live_rows", "admitted", "expired",
                                 "expired_by_budget", "waiting", "dropped_gradients", "bytes",
                                 "index_bytes")},
            "reference": {"admitted": ref.num_admitted, "expired": ref.num_expired,
                          "live_rows": len(ref.rows)},
            "counts_match": (c["admitted"], c["expired"], c["live_rows"]) == (
                ref.num_admitted, ref.num_expired, len(ref.rows))})
    job_ms, one_ms = _median_ms(worker["step_ms"]), _median_ms(baseline["step_ms"])
    uncached_ms = _median_ms(uncached_worker["step_ms"])
    policy_counts = ("admitted", "expired", "live_rows", "waiting")
    return {
        "bench": "dynamic_job",
        "config": {"steps": args.steps, "batch": args.batch, "lookups": args.lookups,
                   "servers": SERVERS, "workers": 1, "zipf": args.zipf, "dim": DIM,
                   "admit_after": args.admit_after, "expire_after_steps": args.expire_after,
                   "row_budget": args.row_budget},
        "lookups": args.steps * args.batch,
        "distinct_ids": distinct,
        "servers": per_server,
        "live_rows_within_budget": all(p["peak_live_rows"] <= args.row_budget
                                       for p in per_server),
        "counts_match_reference": all(p["counts_match"] for p in per_server),
        "worker_peak_rss_mb": worker["peak_rss_mb"],
        "worker_cache": {k: worker["cache"][k] for k in (
            "hit_rate", "hits", "misses", "evictions", "dropped_gradients", "bytes_pulled",
            "bytes_pushed")},
        "uncached_dropped_gradients": sum(b["counters"]["dropped_gradients"]
                                          for b in uncached_servers),
        "uncached_counts_equal": all(
            {k: a["counters"][k] for k in policy_counts} ==
            {k: b["counters"][k] for k in policy_counts}
            for a, b in zip(servers, uncached_servers)),
        "step_ms_median": {"job": job_ms, "job_caching_none": uncached_ms,
                           "hashing_trick_one_process": one_ms},
        "job_speed_vs_hashing_trick": round(one_ms / job_ms, 3),
        "cache_speed_up": round(uncached_ms / job_ms, 3),
        "hashing_trick_peak_rss_mb": baseline["peak_rss_mb"],
    }


def main(argv=None) -> None:
    args = parse(argv)
    if args.job:
        run_job(args)
        return
    print(json.dumps(run(args), indent=2))


if __name__ == "__main__":
    main()
