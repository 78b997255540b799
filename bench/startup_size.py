"""Start-up against the tables' declared size: the DLRM of
examples/recsys_cache.py (1 worker, 2 servers, `splitrun launch`), its tables
declared at several sizes, timed from starting the launcher to worker 0's
first step. With the row initializer (`--row-init`: each server makes its
rows when first used) start-up should not grow with the declared size; with
tables initialised by plain torch (each server builds the whole tables, then
copies its shard) it does. Prints JSON.

Per run, seconds from starting the launcher to:
- ``ready_s``: worker 0's `job.start()` returned (every process joined, the
  plan agreed, the servers' stores made);
- ``first_step_s``: worker 0's first step ended.
The job draws uniform ids on the worker (no hidden model whose size would
grow with the rows), one step of 1 024 samples, 16 ids per table. The sizes
take turns, so a machine that slows down mid-run biases none; medians over
--runs.

    python bench/startup_size.py [--runs 3] [--declared-gb 1 8] [--plain-gb 1 2]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent.parent / "examples"))

TABLES = 8
DIM = 64
BATCH = 1024
IDS_PER_TABLE = 16
STEPS = 3
PREFIX = "STARTUP "
# Bounds one launch (start, three steps, shutdown) on a loaded 2-core machine.
RUN_TIMEOUT_S = 900


def job_args(rows: int, row_init: bool) -> list[str]:
    return ["--tables", str(TABLES), "--rows", str(rows), "--dim", str(DIM),
            "--batch-size", str(BATCH), "--ids-per-table", str(IDS_PER_TABLE),
            "--optimizer", "sgd", "--policy", "lru", "--cache-rows", str(BATCH * IDS_PER_TABLE),
            "--steps", str(STEPS), *(["--row-init"] if row_init else [])]


def rows_for(gigabytes: float) -> int:
    return int(gigabytes * 2**30 / (TABLES * DIM * 4))


def run_job(argv: list[str]) -> None:
    """Inside `splitrun launch`: every process runs this; worker 0 prints
    when its start returned and its steps ended (time.monotonic, the clock the
    bench started the launcher by)."""
    import recsys_cache
    import torch

    from splitrun.runtime.job import Job

    args = recsys_cache.parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    job = Job.from_env()
    _, program, spec, _, _ = recsys_cache.build(args, job.cluster.num_workers,
                                                tables_here=not job.is_worker)
    # No final state: gathering the tables is no part of start-up.
    trainer = job.start(program, recsys_cache.cache_mode(args), gather_state=False)
    stamps = [time.monotonic()]
    if job.is_worker:
        generator = torch.Generator().manual_seed(0)
        for _ in range(args.steps):
            ids = [torch.randint(0, rows, (args.batch_size, args.ids_per_table),
                                 generator=generator) for rows in spec.rows]
            trainer.step((torch.rand(args.batch_size, recsys_cache.NUM_DENSE, generator=generator),
                          *ids, torch.randint(0, 2, (args.batch_size,), generator=generator)
                          .float()))
            stamps.append(time.monotonic())
    trainer.finish()
    if job.is_driver:
        print(PREFIX + json.dumps({"stamps": stamps}), flush=True)


def launch(rows: int, row_init: bool) -> dict:
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "splitrun.launcher", "launch", "--workers", "1", "--servers",
         "2", str(HERE), "--job", *job_args(rows, row_init)],
        capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    line = next((line for line in proc.stdout.splitlines() if PREFIX in line), None)
    if proc.returncode != 0 or line is None:
        return {"finished": False, "exit_code": proc.returncode,
                "output_tail": (proc.stdout + proc.stderr)[-1500:]}
    stamps = json.loads(line.split(PREFIX, 1)[1])["stamps"]
    return {"finished": True, "ready_s": stamps[0] - started,
            "first_step_s": stamps[1] - started}


def main() -> None:
    if "--job" in sys.argv:
        run_job(sys.argv[sys.argv.index("--job") + 1:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--declared-gb", type=float, nargs="+", default=[1.0, 8.0],
                        help="declared table sizes with the row initializer")
    parser.add_argument("--plain-gb", type=float, nargs="*", default=[1.0, 2.0],
                        help="declared sizes with tables initialised by plain torch (each "
                             "server builds them whole: keep them within memory)")
    args = parser.parse_args()
    cases = [(gb, True) for gb in args.declared_gb] + [(gb, False) for gb in args.plain_gb]
    runs: dict[str, list[dict]] = {}
    for _ in range(args.runs):
        for gb, row_init in cases:
            key = f"{'row_init' if row_init else 'plain_torch'}_{gb:g}_gb"
            runs.setdefault(key, []).append(launch(rows_for(gb), row_init))
    report = {"benchmark": "startup_size",
              "job": " ".join(job_args(0, True)).replace("--rows 0", "--rows <per size>"),
              "rows_per_table": {f"{gb:g}_gb": rows_for(gb) for gb, _ in cases},
              "processes": "1 worker, 2 servers (splitrun launch)", "runs": runs}
    for key, results in runs.items():
        done = [r for r in results if r["finished"]]
        if done:
            report[key] = {f"median_{what}": round(statistics.median(r[what] for r in done), 2)
                           for what in ("ready_s", "first_step_s")}
    smallest, largest = (f"row_init_{gb:g}_gb" for gb in (min(args.declared_gb),
                                                           max(args.declared_gb)))
    if smallest in report and largest in report and smallest != largest:
        report["row_init_largest_over_smallest"] = {
            what: round(report[largest][f"median_{what}"] / report[smallest][f"median_{what}"],
                        3) for what in ("ready_s", "first_step_s")}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
