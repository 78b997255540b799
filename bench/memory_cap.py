"""Tables bigger than the workers' memory: embedding-cache mode trains with a
memory cap on its worker below the size of its tables, where TorchRec's
DistributedModelParallel, under the same cap per process, cannot. Prints JSON.

The job is examples/recsys_cache.py's DLRM with large tables (8 tables of 1
M rows x 64 by default: 2.05 GB of float32 rows), plain SGD (`--optimizer
adagrad`: its sums beside every row), LRU caches of 5 % on the worker, the
MLPs on the worker. A memory cgroup is made for each capped process (cgroup
v2 `memory.max` where the memory controller is on the unified hierarchy,
else v1 `memory.limit_in_bytes`; needs root), the process enters it before
it starts (`sh -c 'echo $$ > cgroup.procs; exec ...'`), and the cgroups are
removed at the end.

- splitrun: `splitrun scheduler`, 2 servers (`--servers`) and 1 worker
  through `splitrun join`, the worker capped (the servers too with
  `--server-cap-mb`). It leaves the tables' starting values to the servers
  (`build(..., tables_here=False)`: never written, never paged in) and
  caches rows. Each server prints its peak RSS (VmHWM) and the rows its
  store made.
- TorchRec DMP: 2 processes (gloo; bench/torchrec_anchors.py dmp), the
  tables sharded table-wise, each process capped the same: each must hold
  its shard (half the tables) and builds the model first.

`--final-state gather views` adds a run each in which the worker ends with
`finish()` gathering the whole state (as examples/recsys_cache.py does) or
with `finish(save_to=..., gather_tables_up_to=0)`: the tables as views of a
sharded checkpoint the servers write, never whole on the worker.

`--servers 4 --server-cap-mb M` caps every server too (each in its cgroup),
and prints the bound each server's peak should stay within (1.2 x its share
of the rows and their state + 400 MB); TorchRec DMP then runs one process per
server, each capped at M. With `--row-init` no process writes a whole table
(each server makes its rows from the row initializer when first used):

    sudo python bench/memory_cap.py [--cap-mb 1024] [--rows 1000000] [--steps 40]
    sudo python bench/memory_cap.py --tables 16 --optimizer adagrad --row-init \
        --servers 4 --server-cap-mb 2600 --cap-mb 2048
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

HERE = pathlib.Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

from joined_job import run_joined_job  # noqa: E402

CAP_MB = 1024
TABLES = 8
ROWS = 1_000_000
DIM = 64
STEPS = 40
WARMUP_STEPS = 10
BATCH = 1024
# Bounds each job (start, steps, shutdown) on 2 cores.
RUN_TIMEOUT_S = 1200
_CGROUP_ROOT = pathlib.Path("/sys/fs/cgroup")


def job_args(args) -> list[str]:
    return ["--tables", str(args.tables), "--rows", str(args.rows), "--dim", str(args.dim),
            "--batch-size", str(BATCH), "--ids-per-table", "16", "--bottom", "64", "--top", "64",
            "--zipf", "1.05", "--optimizer", args.optimizer, "--policy", "lru",
            "--cache-fraction", "0.05",
            "--steps", str(args.steps), *(["--row-init"] if args.row_init else [])]


def tables_bytes(args) -> int:
    """The declared tables' rows (float32)."""
    return args.tables * args.rows * args.dim * 4


def rows_and_state_bytes(args) -> int:
    """The declared tables' rows and their optimizer state (Adagrad: one sum
    per element, as many bytes again)."""
    return tables_bytes(args) * (2 if args.optimizer == "adagrad" else 1)


# -- memory cgroups --------------------------------------------------------------------

class MemoryCgroup:
    """A memory cgroup of our own with a hard limit; `wrap(command)` starts a
    command inside it. v2 where the unified hierarchy has the memory
    controller, else v1."""

    def __init__(self, name: str, limit_bytes: int) -> None:
        self.version, parent = _memory_hierarchy()
        self.path = parent / name
        self.path.mkdir()
        self.limit_bytes = limit_bytes
        limit_file = "memory.max" if self.version == 2 else "memory.limit_in_bytes"
        (self.path / limit_file).write_text(str(limit_bytes))

    def wrap(self, command: list[str]) -> list[str]:
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.path / "cgroup.procs"),
                *command]

    def report(self) -> dict:
        if self.version == 2:
            peak = self.path / "memory.peak"
            events = dict(line.split() for line in
                          (self.path / "memory.events").read_text().splitlines())
            return {"cgroup": "v2 memory.max", "limit_mb": self.limit_bytes / 2**20,
                    "peak_mb": int(peak.read_text()) / 2**20 if peak.exists() else None,
                    "oom_kills": int(events.get("oom_kill", 0))}
        oom = dict(line.split() for line in
                   (self.path / "memory.oom_control").read_text().splitlines())
        return {"cgroup": "v1 memory.limit_in_bytes", "limit_mb": self.limit_bytes / 2**20,
                "peak_mb": int((self.path / "memory.max_usage_in_bytes").read_text()) / 2**20,
                "limit_hits": int((self.path / "memory.failcnt").read_text()),
                "oom_kills": int(oom.get("oom_kill", 0))}

    def remove(self) -> None:
        """Remove the cgroup (its processes have exited; a straggler of ours is
        killed first)."""
        procs = self.path / "cgroup.procs"
        for pid in procs.read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), 9)
        deadline = time.monotonic() + 30
        while procs.read_text().split() and time.monotonic() < deadline:
            time.sleep(0.1)  # the kernel empties it as they exit: no event to wait on
        self.path.rmdir()


def _memory_hierarchy() -> tuple[int, pathlib.Path]:
    """(version, the cgroup of this process on that hierarchy)."""
    lines = pathlib.Path("/proc/self/cgroup").read_text().splitlines()
    unified = next((line.split(":", 2)[2] for line in lines if line.startswith("0::")), None)
    for root in (_CGROUP_ROOT, _CGROUP_ROOT / "unified"):
        controllers = root / "cgroup.controllers"
        if unified is not None and controllers.exists() and (
                "memory" in controllers.read_text().split()):
            return 2, root / unified.lstrip("/")
    for line in lines:
        _, names, path = line.split(":", 2)
        if "memory" in names.split(","):
            return 1, _CGROUP_ROOT / "memory" / path.lstrip("/")
    raise SystemExit("no memory cgroup controller (v1 or v2) on this machine")


# -- the two jobs --------------------------------------------------------------------

class LocalHost:
    address = "127.0.0.1"

    def __init__(self, cgroup: MemoryCgroup | None = None) -> None:
        self.cgroup = cgroup

    def popen(self, command, **kwargs):
        return subprocess.Popen(command if self.cgroup is None else self.cgroup.wrap(command),
                                **kwargs)


def run_splitrun(args, workdir: pathlib.Path, cap_bytes: int, final_state: str) -> dict:
    """`final_state`: none (the job keeps no final state), gather (worker 0
    receives it whole at finish) or views (finish saves a sharded checkpoint
    and hands the tables back as views of it)."""
    cgroup = MemoryCgroup(f"splitrun-memcap-{os.getpid()}-worker-{final_state}", cap_bytes)
    server_cgroups = [] if args.server_cap_mb is None else [
        MemoryCgroup(f"splitrun-memcap-{os.getpid()}-server{rank}-{final_state}",
                     args.server_cap_mb * 2**20) for rank in range(args.servers)]
    # Here, not at the top: embedding_cache imports the example and with it
    # scikit-learn, which sets KMP_* variables in whatever process imports it
    # (a test importing MemoryCgroup from here would pass them to its launches).
    from embedding_cache import BENCH_PREFIX, MEMORY_PREFIX
    try:
        hosts = SimpleNamespace(a=LocalHost(), b=LocalHost(cgroup))
        run_dir = workdir / f"splitrun-{final_state}"
        run_dir.mkdir()
        command = [str(HERE.parent / "embedding_cache.py"), "--job", "--final-state",
                   final_state, "--final-dir", str(run_dir / "final"), "--", *job_args(args)]
        result = {"finished": False}
        try:
            logs = run_joined_job(hosts, run_dir, workers=1, servers=args.servers,
                                  job_command=command, what="splitrun under the caps",
                                  timeout_s=RUN_TIMEOUT_S,
                                  server_hosts=[LocalHost(c) for c in server_cgroups] or None)
            bench = _prefixed_line(logs[args.servers].read_text(errors="replace"),
                                   BENCH_PREFIX)
            stamps = bench["stamps"]
            result = {"finished": True, "steps": len(stamps) - 1,
                      "samples_per_s_after_warmup": round(
                          (len(stamps) - 1 - WARMUP_STEPS) * BATCH
                          / (stamps[-1] - stamps[WARMUP_STEPS]), 1),
                      "hit_rate_per_unique_id": round(bench["hits"] / bench["unique_ids"], 4),
                      "mb_pulled_per_step": round(bench["bytes_pulled"] / len(stamps) / 1e6, 2),
                      "finish_s": round(bench["finish_s"], 1),
                      "final_state_mb_on_worker0": bench["final_state_mb"],
                      "final_state_views": len(bench["views"]),
                      # Each server's peak RSS (VmHWM) and the rows its store made.
                      "servers": [_prefixed_line(log.read_text(errors="replace"),
                                                 MEMORY_PREFIX)
                                  for log in logs[:args.servers]]}
        except RuntimeError as exc:
            result["error"] = str(exc)[-2000:]
        result["worker_memory"] = cgroup.report()
        if server_cgroups:
            # The goal: each server's peak within 1.2 x its share of the rows
            # and their state + 400 MB (an idle process with torch is ~400).
            share_mb = rows_and_state_bytes(args) / args.servers / 2**20
            result["server_rows_and_state_mb_each"] = round(share_mb, 1)
            result["server_peak_bound_mb"] = round(1.2 * share_mb + 400, 1)
            result["server_memory"] = [c.report() for c in server_cgroups]
        return result
    finally:
        cgroup.remove()
        for server_cgroup in server_cgroups:
            server_cgroup.remove()


def run_dmp(args, cap_bytes: int, world_size: int) -> dict:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True,
                          wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=RUN_TIMEOUT_S))
    cgroups = [MemoryCgroup(f"splitrun-memcap-{os.getpid()}-dmp{rank}", cap_bytes)
               for rank in range(world_size)]
    # The anchor builds TorchRec's model from the plain one (whole tables in
    # every process, as examples/recsys_cache.py's TorchRec form does) and
    # trains its tables with FBGEMM's exact SGD (no state) whatever --optimizer:
    # less memory than an Adagrad job needs.
    dmp_args = [a for a in job_args(args) if a != "--row-init"]
    try:
        processes = [subprocess.Popen(cgroup.wrap(
            [sys.executable, str(HERE.parent / "torchrec_anchors.py"), "dmp", "--rank",
             str(rank), "--world-size", str(world_size), "--store",
             f"127.0.0.1:{store.port}", "--", *dmp_args]),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for rank, cgroup in enumerate(cgroups)]
        outputs = []
        for process in processes:
            try:
                outputs.append(process.communicate(timeout=RUN_TIMEOUT_S)[0])
            except subprocess.TimeoutExpired:
                process.kill()
                outputs.append(process.communicate()[0])
        codes = [process.returncode for process in processes]
        finished = all(code == 0 for code in codes)
        return {"finished": finished, "exit_codes": codes,
                "killed_by_signal": [-code for code in codes if code < 0],
                "output_tails": [] if finished else [o[-600:] for o in outputs],
                "process_memory": [cgroup.report() for cgroup in cgroups]}
    finally:
        for cgroup in cgroups:
            cgroup.remove()
        del store


def _prefixed_line(text: str, prefix: str) -> dict:
    for line in text.splitlines():
        if prefix in line:
            return json.loads(line.split(prefix, 1)[1])
    raise RuntimeError(f"no {prefix.strip()} line:\n{text[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap-mb", type=int, default=CAP_MB,
                        help="memory cap of each capped process (MiB)")
    parser.add_argument("--tables", type=int, default=TABLES)
    parser.add_argument("--rows", type=int, default=ROWS)
    parser.add_argument("--dim", type=int, default=DIM)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--server-cap-mb", type=int,
                        help="cap each server too (MiB; default: servers uncapped); TorchRec "
                             "DMP then runs as many processes as servers, each under this cap")
    parser.add_argument("--row-init", action="store_true",
                        help="the tables start from a row initializer: each server makes its "
                             "own rows as they are first used, no process writes a whole table")
    parser.add_argument("--skip-dmp", action="store_true")
    parser.add_argument("--optimizer", choices=["sgd", "adagrad"], default="sgd",
                        help="adagrad: every row carries its sums too (twice the bytes)")
    parser.add_argument("--final-state", nargs="+", choices=["none", "gather", "views"],
                        default=["none"], help="what the splitrun job's finish() hands "
                        "worker 0, one capped run each: none, the whole state gathered, or "
                        "the tables as views of a sharded checkpoint")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("memory cgroups need root: run with sudo")
    cap = args.cap_mb * 2**20
    started = time.perf_counter()
    report = {"benchmark": "memory_cap", "job": " ".join(job_args(args)),
              "tables_mb": round(tables_bytes(args) / 2**20, 1), "cap_mb_per_process": args.cap_mb,
              "tables_over_cap": round(tables_bytes(args) / cap, 2), "servers": args.servers}
    if args.server_cap_mb is not None:
        state_bytes = rows_and_state_bytes(args)
        report.update({"server_cap_mb": args.server_cap_mb,
                       "rows_and_state_mb": round(state_bytes / 2**20, 1),
                       "rows_and_state_over_server_cap": round(
                           state_bytes / (args.server_cap_mb * 2**20), 2)})
    with tempfile.TemporaryDirectory(prefix="splitrun-bench-memcap-") as workdir:
        for final_state in args.final_state:
            key = "splitrun_cache_mode" + ("" if final_state == "none" else
                                           f"_final_state_{final_state}")
            report[key] = run_splitrun(args, pathlib.Path(workdir), cap, final_state)
    if not args.skip_dmp:
        if args.server_cap_mb is None:
            report["torchrec_dmp_2_processes"] = run_dmp(args, cap, 2)
        else:
            report[f"torchrec_dmp_{args.servers}_processes"] = run_dmp(
                args, args.server_cap_mb * 2**20, args.servers)
    report["total_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
