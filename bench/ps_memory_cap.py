"""Dense parameters and Adam's moments larger than one server's memory:
parameter-server mode trains them on 2 servers, each in a memory cgroup below
the whole, where one process training the same model under the same cap is
killed. Prints JSON.

The model: `--layers` x Linear(`--width`, `--width`) (32 x 4096 by default:
2 048 MB of parameters, 6 146 MB with Adam's two moments), every parameter
on a server (`place(model, role="server")`, spread by size), Adam, a
regression loss on random batches, the gradients sent in buckets of
`--gradient-bucket-mb` (64; 0: one message a step), so a server holds one
bucket's gradients at a time. `splitrun scheduler`, 2 servers and 1
worker through `splitrun join` (bench/joined_job.py), each server in a memory
cgroup of its own (`--server-cap-mb`; bench/memory_cap.py's `MemoryCgroup`),
the worker uncapped. Each process prints its peak RSS (VmHWM) after building
the model and at the end, and the bytes of state it owns; the servers write
their parameters and moments into a sharded checkpoint at the end
(`finish(save_to=...)`), each its own.

The baseline is what a user would run instead on one machine of that size:
the same model, batch and `torch.optim.Adam` in one process, capped the same.

    sudo python bench/ps_memory_cap.py [--layers 32] [--width 4096] [--server-cap-mb 4400]

Measured here (2 cores, 24 GiB): each server peaked at 4 146-4 274 MB and
trained under its 4 400 MB cap (the whole is 1.40x the cap); the one process
was OOM-killed. With the gradients in one message (`--gradient-bucket-mb 0`) a
server peaked at 4 786 MB. Beyond its share of parameters and moments a server
holds a bucket of gradients, one layer's new values and the runtime.
"""

from __future__ import annotations

import argparse
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

LAYERS = 32
WIDTH = 4096
SERVER_CAP_MB = 4400
GRADIENT_BUCKET_MB = 64
STEPS = 3
BATCH = 16
SERVERS = 2
# Bounds each job (start, steps, shutdown) on 2 cores.
RUN_TIMEOUT_S = 900
MEMORY_PREFIX = "PS_MEMORY "


def build(args):
    """The model, its optimizer and a batch: the same in every process and in
    the one-process baseline."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(args.width, args.width) for _ in range(args.layers)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(1)
    batch = (torch.randn(BATCH, args.width, generator=generator),
             torch.randn(BATCH, args.width, generator=generator))
    return model, optimizer, batch


def loss_fn(model, x, y):
    import torch.nn.functional as F

    return F.mse_loss(model(x), y)


def peak_rss_mb() -> float:
    """This process's peak RSS so far, VmHWM (not ru_maxrss: that one carries
    over an exec from the process before it)."""
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)
    raise RuntimeError("no VmHWM in /proc/self/status")


def run_job(args) -> None:
    """Runs inside `splitrun join`: every process runs this and prints one
    PS_MEMORY line."""
    import torch

    from splitrun.runtime.job import Job
    from splitrun.splitter import ParameterServerMode, capture, place

    torch.set_num_threads(1)
    job = Job.from_env()
    model, optimizer, (x, y) = build(args)
    built_mb = peak_rss_mb()
    place(model, role="server")
    shard = BATCH // job.cluster.num_workers
    program = capture(model, loss_fn, optimizer, (x[:shard], y[:shard]))
    bucket = None if not args.gradient_bucket_mb else args.gradient_bucket_mb << 20
    trainer = job.start(program, ParameterServerMode(gradient_bucket_bytes=bucket),
                        num_steps=args.steps, gather_state=False)
    started_mb = peak_rss_mb()
    owned = trainer.process.state
    owned_mb = round(sum(v.nbytes for v in owned.values()) / 2**20, 1)
    started = time.perf_counter()
    losses = []
    for batch in trainer.shard([(x, y)] * args.steps):
        outputs = trainer.step(batch)
        if outputs and "loss" in outputs:
            losses.append(float(outputs["loss"]))
    seconds = time.perf_counter() - started
    trainer.finish(save_to=args.save_to)
    model_mb = round(sum(p.untyped_storage().nbytes() for p in model.parameters()) / 2**20, 1)
    print(MEMORY_PREFIX + json.dumps({
        "process": job.label.describe(), "peak_rss_mb_after_build": built_mb,
        "peak_rss_mb_after_start": started_mb,
        "peak_rss_mb": peak_rss_mb(), "owned_state_mb": owned_mb,
        "model_parameters_mb_left_here": model_mb, "steps": trainer.steps_done,
        "step_s": round(seconds / max(trainer.steps_done, 1), 2), "losses": losses}),
        flush=True)


def run_one_process(args) -> None:
    """The baseline's body: the same steps in one process with torch alone."""
    import torch

    torch.set_num_threads(2)
    model, optimizer, (x, y) = build(args)
    for _ in range(args.steps):
        optimizer.zero_grad()
        loss_fn(model, x, y).backward()
        optimizer.step()
    print(MEMORY_PREFIX + json.dumps({"process": "one process", "peak_rss_mb": peak_rss_mb()}),
          flush=True)


def _memory_lines(text: str) -> list[dict]:
    return [json.loads(line.split(MEMORY_PREFIX, 1)[1]) for line in text.splitlines()
            if MEMORY_PREFIX in line]


def run_splitrun(args, workdir: pathlib.Path, cap_bytes: int) -> dict:
    from joined_job import run_joined_job
    from memory_cap import LocalHost, MemoryCgroup

    cgroups = [MemoryCgroup(f"splitrun-psmemcap-{os.getpid()}-server{rank}", cap_bytes)
               for rank in range(SERVERS)]
    result: dict = {"finished": False}
    try:
        command = [str(HERE), "--job", "--layers", str(args.layers), "--width",
                   str(args.width), "--steps", str(args.steps), "--save-to",
                   str(workdir / "final"), "--gradient-bucket-mb",
                   str(args.gradient_bucket_mb)]
        try:
            logs = run_joined_job(SimpleNamespace(a=LocalHost(), b=LocalHost()), workdir,
                                  workers=1, servers=SERVERS, job_command=command,
                                  what="splitrun's servers under the caps",
                                  timeout_s=RUN_TIMEOUT_S,
                                  server_hosts=[LocalHost(c) for c in cgroups])
            lines = [line for log in logs for line in _memory_lines(log.read_text())]
            result = {"finished": True, "processes": lines,
                      "checkpoint_files": sorted(p.name for p in (workdir / "final").glob("*"))}
        except RuntimeError as exc:
            result["error"] = str(exc)[-2000:]
        result["server_memory"] = [c.report() for c in cgroups]
        return result
    finally:
        for cgroup in cgroups:
            cgroup.remove()


def run_baseline(args, cap_bytes: int) -> dict:
    from memory_cap import MemoryCgroup

    cgroup = MemoryCgroup(f"splitrun-psmemcap-{os.getpid()}-one", cap_bytes)
    try:
        process = subprocess.run(cgroup.wrap(
            [sys.executable, str(HERE), "--one-process", "--layers", str(args.layers),
             "--width", str(args.width), "--steps", str(args.steps)]),
            capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        return {"finished": process.returncode == 0, "exit_code": process.returncode,
                "killed_by_signal": -process.returncode if process.returncode < 0 else None,
                "processes": _memory_lines(process.stdout), "memory": cgroup.report()}
    finally:
        cgroup.remove()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--width", type=int, default=WIDTH)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--server-cap-mb", type=int, default=SERVER_CAP_MB,
                        help="each server's memory cap, and the baseline's (MiB)")
    parser.add_argument("--gradient-bucket-mb", type=int, default=GRADIENT_BUCKET_MB,
                        help="send the gradients in buckets of this many MiB (0: one "
                             "message): a server then holds one bucket's gradients at a time")
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--one-process", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--save-to", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        return run_job(args)
    if args.one_process:
        return run_one_process(args)
    if os.geteuid() != 0:
        raise SystemExit("memory cgroups need root: run with sudo")
    params_mb = args.layers * (args.width + 1) * args.width * 4 / 2**20
    cap = args.server_cap_mb * 2**20
    report = {"benchmark": "ps_memory_cap", "layers": args.layers, "width": args.width,
              "batch": BATCH, "steps": args.steps, "servers": SERVERS,
              "gradient_bucket_mb": args.gradient_bucket_mb,
              "parameters_mb": round(params_mb, 1),
              "parameters_and_adam_mb": round(3 * params_mb, 1),
              "server_cap_mb": args.server_cap_mb,
              "parameters_and_adam_over_server_cap": round(3 * params_mb / args.server_cap_mb, 2),
              # The bound a server's peak should stay within: 1.2 x its share + 400 MB.
              "server_peak_bound_mb": round(1.2 * 3 * params_mb / SERVERS + 400, 1)}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="splitrun-bench-psmemcap-") as workdir:
        report["splitrun_ps_2_servers"] = run_splitrun(args, pathlib.Path(workdir), cap)
    if not args.skip_baseline:
        report["one_process_torch_adam"] = run_baseline(args, cap)
    report["total_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
