"""Time to split synthetic graphs of 10k, 100k and 200k nodes with 8 labels.

Capture is excluded: the graph is built first, then `GraphSplitter.split()` is
timed. Each size runs in a fresh subprocess (so one size's garbage does not
slow the next), several times; the JSON reports medians and the
200k/100k ratio (linear scaling would be 2.0).

    python bench/splitter_scale.py [--repeats 5] [--sizes 10000 100000 200000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

GOAL_100K_S = 2.0
GOAL_RATIO = 2.2


def _time_one(num_nodes: int, repeats: int, run_length: float) -> dict:
    from splitrun.splitter import split
    from splitrun.splitter.labels import Cluster, Label
    from splitrun.splitter.testing import random_program

    labels = [Label.worker(rank) for rank in range(8)]
    program = random_program(num_nodes, labels, seed=1, run_length=run_length)
    times, plan = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        plan = split(program, Cluster(num_workers=8))
        times.append(time.perf_counter() - started)
    return {"nodes": num_nodes, "labels": 8, "median_s": statistics.median(times),
            "min_s": min(times), "runs_s": [round(t, 4) for t in times],
            "channels": len(plan.channels),
            "ops_per_s": round(num_nodes / statistics.median(times))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 200_000])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--run-length", type=float, default=8.0,
                        help="mean run of consecutive ops on one label")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(_time_one(args.one, args.repeats, args.run_length)))
        return
    results = []
    for size in args.sizes:
        out = subprocess.run(
            [sys.executable, __file__, "--one", str(size), "--repeats", str(args.repeats),
             "--run-length", str(args.run_length)],
            check=True, capture_output=True, text=True, timeout=1800)
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    by_size = {r["nodes"]: r for r in results}
    report = {"benchmark": "splitter_scale", "results": results}
    if 100_000 in by_size:
        report["goal_100k_under_s"] = GOAL_100K_S
        report["meets_100k_goal"] = by_size[100_000]["median_s"] < GOAL_100K_S
    if 100_000 in by_size and 200_000 in by_size:
        ratio = by_size[200_000]["median_s"] / by_size[100_000]["median_s"]
        report["ratio_200k_over_100k"] = round(ratio, 3)
        report["goal_ratio_at_most"] = GOAL_RATIO
        report["meets_ratio_goal"] = ratio <= GOAL_RATIO
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
