"""Start-up and end-to-end time of the main job (examples/ps_train.py, 2 workers
+ 1 server): `splitrun launch` (local backend) against `splitrun launch
--backend ray` on a one-node Ray cluster started once beforehand (as a cluster
users submit to already runs; its start is reported apart).

Per run, seconds from starting the launcher to:
- ``ready_s``: worker 0 logs its plan (every process joined, the plan agreed:
  the next thing is the first step);
- ``end_to_end_s``: the launcher exited;
and, for Ray, ``actors_s``: every actor started (as the launcher reports it).
The backends take turns, so a machine that slows down mid-run biases neither.
Medians over the runs, and Ray's over the local backend's.

    python bench/startup.py [--runs 3] [--epochs 1]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import re
import statistics
import subprocess
import sys
import time

from ray_head import RAY_ENV, RayHead

REPO = pathlib.Path(__file__).resolve().parents[1]
JOB_TIMEOUT_S = 600.0
_READY = re.compile(r"^\[worker 0\] .*\bplan [0-9a-f]+:")
_ACTORS = re.compile(r"every actor started ([0-9.]+) s after start")


def _one_run(backend: str, address: str | None, epochs: int) -> dict:
    argv = [sys.executable, "-m", "splitrun.launcher", "launch", "--workers", "2",
            "--servers", "1"]
    if backend == "ray":
        argv += ["--backend", "ray", "--address", address,
                 "--worker-resources", '{"CPU": 0.5}', "--server-resources", '{"CPU": 0.5}']
    argv += [str(REPO / "examples" / "ps_train.py"), "--epochs", str(epochs)]
    env = dict(os.environ)
    env.update(RAY_ENV)
    started = time.monotonic()
    process = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, start_new_session=True, text=True)
    result: dict = {"backend": backend}
    lines = []
    try:
        for line in process.stdout:  # ends when the launcher exits (bounded by wait below)
            lines.append(line)
            if "ready_s" not in result and _READY.search(line):
                result["ready_s"] = time.monotonic() - started
            actors = _ACTORS.search(line)
            if actors:
                result["actors_s"] = float(actors.group(1))
        code = process.wait(timeout=JOB_TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
    result["end_to_end_s"] = time.monotonic() - started
    if code != 0:
        raise RuntimeError(f"{backend} run exited with {code}:\n{''.join(lines[-40:])}")
    return result


def _median(runs: list[dict], key: str) -> float | None:
    values = [run[key] for run in runs if key in run]
    return round(statistics.median(values), 2) if values else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=1, help="of ps_train.py (22 steps each)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cluster_started = time.monotonic()
    head = RayHead(num_cpus=2, resources={})
    try:
        head.wait_up()
        ray_start_s = time.monotonic() - cluster_started
        runs: dict[str, list[dict]] = {"local": [], "ray": []}
        for _ in range(args.runs):
            for backend in ("local", "ray"):
                runs[backend].append(_one_run(backend, head.address, args.epochs))
    finally:
        head.close()
    summary = {backend: {key: _median(results, key)
                         for key in ("ready_s", "actors_s", "end_to_end_s")}
               for backend, results in runs.items()}
    local, ray = summary["local"], summary["ray"]
    print(json.dumps({
        "benchmark": "startup", "job": "examples/ps_train.py, 2 workers + 1 server",
        "epochs": args.epochs, "runs": args.runs, "machine": platform.machine(),
        "cpus": os.cpu_count(), "load_average": os.getloadavg(),
        "ray_cluster_start_s": round(ray_start_s, 2),
        "median": summary,
        "ray_over_local": {key: round(ray[key] / local[key], 2)
                           for key in ("ready_s", "end_to_end_s") if ray[key] and local[key]},
        "ray_adds_s": {key: round(ray[key] - local[key], 2)
                       for key in ("ready_s", "end_to_end_s") if ray[key] and local[key]},
        "runs_detail": runs,
    }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
