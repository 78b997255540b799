"""Micro-batched pipelines: splitrun's GPipe, 1F1B and interleaved 1F1B next
to torch.distributed.pipelining's ScheduleGPipe, Schedule1F1B and
ScheduleInterleaved1F1B, splitrun's split without micro-batches, and the
unsplit step in one process.

The model: 8 blocks of Linear(1024, 1024) + GELU, an MSE loss, batch 256,
SGD. Split over 2 processes, blocks 0-3 on the first and 4-7 plus the loss on
the second (the same split for torch's stages); interleaved, 4 chunks of 2
blocks, the first process holding blocks 0-1 and 4-5, the second 2-3 and 6-7
plus the loss (torch: 2 PipelineStages per process, stage indices rank and
rank + 2). Each process runs one intra-op thread (the launcher shares the 2
cores out; torch's workers set it). splitrun runs as a real job under
`splitrun launch --workers 2` (payloads over shared memory); torch's
pipelining as 2 spawned processes on gloo (127.0.0.1). The unsplit step is
plain eager PyTorch in one process with 2 intra-op threads (all the cores).
Every row records the intra-op threads its processes ran (`threads`).

The ceiling rows (`--part ceiling`): the unmicro-batched split with 2
threads per process (the active stage may use both cores while the other
waits, which a pipeline cannot do), and the unsplit step on 1 thread: the
comparison a user with one device per stage sees is 1 thread per stage.

Per configuration, the median of `--repeats` runs of: steps/s (one over the
median step time of the steps after `--warmup`, on the first process),
per process the idle fraction (bubble), and the peak activation memory.

- bubble: `1 - main thread CPU time / wall time` over the measured steps, for
  every configuration alike (the compute runs on the main thread; a process
  idles when it waits for a peer, and when the machine's other work preempts
  it). For splitrun also `recv_wait`, the executor's time blocked in receives
  over its step time, which counts only the waits for a peer.
  `busy_ms_per_step` is the main thread's CPU time per step.
- activations: splitrun's executor counts the bytes of the forward's values
  alive at once (`peak_activation_bytes`, each storage once); torch's side
  counts the bytes autograd keeps for the backward (saved-tensor hooks, each
  storage once, parameters excluded). Not the same counter: compare each
  schedule with its own kind, and GPipe with 1F1B within one system.

The theory: bubble (P-1)/(V*M+P-1) with P processes, V chunks each (1 but
interleaved) and M micro-batches, when every stage does the same work: the
GPipe paper's (P-1)/(M+P-1), its time cut by V when interleaved (Narayanan
et al. 2021, Megatron-LM, section 2.2.2).

    flock /tmp/splitrun-cpu.lock python bench/pipeline.py [--microbatches 8] \\
        [--steps 8] [--warmup 2] [--repeats 3] [--part main|ceiling|all]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

WIDTH, DEPTH, BATCH, STAGES = 1024, 8, 256, 2
CHUNKS = 2  # interleaved: chunks per process
LR = 0.01
# Bounds one launched or spawned run (start, a dozen steps, teardown) on a
# loaded 2-core machine.
RUN_TIMEOUT_S = 300


def _set_width(width: int) -> None:
    global WIDTH
    WIDTH = width


def blocks(first: int, last: int) -> nn.Sequential:
    torch.manual_seed(0)  # every process and every system starts from the same weights
    layers = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(DEPTH)]
    return nn.Sequential(*layers[first:last])


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return (torch.randn(BATCH, WIDTH, generator=generator),
            torch.randn(BATCH, WIDTH, generator=generator))


class _Timer:
    """Wall and main-thread CPU time over the measured steps."""

    def __init__(self) -> None:
        self.step_s: list[float] = []

    def start(self) -> None:
        self._wall, self._cpu = time.perf_counter(), time.thread_time()

    def stop(self) -> dict:
        wall = time.perf_counter() - self._wall
        cpu = time.thread_time() - self._cpu
        return {"wall_s": wall, "cpu_s": cpu, "bubble": max(0.0, 1 - cpu / wall)}


# -- splitrun, launched -----------------------------------------------------------

def chunk_bounds(num_chunks: int) -> list[tuple[int, int]]:
    """The blocks of each piece, in forward order: piece i on rank i % STAGES."""
    size = DEPTH // (STAGES * num_chunks)
    return [(i * size, (i + 1) * size) for i in range(STAGES * num_chunks)]


class SplitModel(nn.Module):
    def __init__(self, num_chunks: int = 1) -> None:
        super().__init__()
        from splitrun.splitter import place
        self.pieces = nn.ModuleList([place(blocks(first, last), rank=i % STAGES)
                                     for i, (first, last) in enumerate(chunk_bounds(num_chunks))])

    def forward(self, x):
        for piece in self.pieces:
            x = piece(x)
        return x


def split_loss(model, x, y):
    from splitrun.splitter import region
    out = model(x)
    with region(rank=STAGES - 1):  # the loss on the last stage
        return F.mse_loss(out, y)


def run_job(args) -> int:
    """`--job` under `splitrun launch`: each process writes its numbers."""
    from splitrun.runtime import Job
    from splitrun.splitter import GeneralMode, capture, optim

    job = Job.from_env()
    x, y = batch()
    chunks = CHUNKS if args.schedule == "interleaved" else 1
    program = capture(SplitModel(chunks), split_loss, optim.SGD(lr=LR), (x, y))
    mode = GeneralMode(microbatches=args.microbatches, schedule=args.schedule)
    trainer = job.start(program, mode)
    timer, times = _Timer(), []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            stats = trainer.stats
            waited, busy = stats.recv_wait_s, stats.step_s
            timer.start()
        started = time.perf_counter()
        trainer.step((x, y))
        times.append(time.perf_counter() - started)
    result = timer.stop()
    stats = trainer.stats
    result.update(step_s=times[args.warmup:],
                  recv_wait=(stats.recv_wait_s - waited) / (stats.step_s - busy),
                  peak_activation_bytes=stats.peak_activation_bytes,
                  threads=torch.get_num_threads())
    trainer.finish()
    pathlib.Path(args.out, f"rank{job.label.rank}.json").write_text(json.dumps(result))
    return 0


def splitrun_run(microbatches: int, schedule: str, args, threads: int | None = None
                 ) -> list[dict]:
    """`threads`: intra-op threads per process; None leaves the launcher's
    share (the cores over the processes: 1 here)."""
    with tempfile.TemporaryDirectory() as workdir:
        launcher = pathlib.Path(sys.executable).with_name("splitrun")
        budget = [] if threads is None else ["--threads-per-process", str(threads)]
        proc = subprocess.run(
            [str(launcher), "launch", "--workers", str(STAGES), *budget, __file__, "--job",
             "--microbatches", str(microbatches), "--schedule", schedule,
             "--steps", str(args.steps), "--warmup", str(args.warmup), "--width",
             str(args.width), "--out", workdir],
            capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        if proc.returncode != 0:
            raise RuntimeError(f"splitrun job failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        return [json.loads(pathlib.Path(workdir, f"rank{r}.json").read_text())
                for r in range(STAGES)]


# -- torch.distributed.pipelining ------------------------------------------------------

class _SavedBytes:
    """The most bytes autograd keeps for the backward at once: saved-tensor
    hooks count each storage once, parameters excluded."""

    def __init__(self, params) -> None:
        self._skip = {p.untyped_storage().data_ptr() for p in params}
        self._refs: dict[int, list[int]] = {}
        self.live = self.peak = 0

    def hooks(self):
        counter = self

        class Held:
            def __init__(self, tensor):
                self.tensor = tensor
                storage = tensor.untyped_storage()
                self.pointer = storage.data_ptr()
                if self.pointer in counter._skip:
                    self.pointer = None
                    return
                entry = counter._refs.setdefault(self.pointer, [0, storage.nbytes()])
                if entry[0] == 0:
                    counter.live += entry[1]
                    counter.peak = max(counter.peak, counter.live)
                entry[0] += 1

            def __del__(self):
                if self.pointer is not None:
                    entry = counter._refs[self.pointer]
                    entry[0] -= 1
                    if not entry[0]:
                        counter.live -= entry[1]
                        del counter._refs[self.pointer]

        return torch.autograd.graph.saved_tensors_hooks(Held, lambda held: held.tensor)


def _torch_worker(rank: int, port: int, microbatches: int, schedule: str, args, out: str):
    import torch.distributed as dist

    _set_width(args.width)
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=STAGES)
    chunks = CHUNKS if schedule == "interleaved" else 1
    bounds = chunk_bounds(chunks)
    indices = range(rank, STAGES * chunks, STAGES)  # this rank's stages
    modules = [blocks(*bounds[i]) for i in indices]
    stages = [PipelineStage(m, i, STAGES * chunks, torch.device("cpu"))
              for m, i in zip(modules, indices)]
    if schedule == "interleaved":
        pipe = ScheduleInterleaved1F1B(stages, n_microbatches=microbatches, loss_fn=F.mse_loss)
    else:
        kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
        pipe = kind(stages[0], n_microbatches=microbatches, loss_fn=F.mse_loss)
    params = [p for m in modules for p in m.parameters()]
    optimizer = torch.optim.SGD(params, lr=LR)
    saved = _SavedBytes(params)
    x, y = batch()
    timer, times = _Timer(), []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            timer.start()
        started = time.perf_counter()
        with saved.hooks():
            if rank == 0:
                pipe.step(x)
            else:
                pipe.step(target=y, losses=[])
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - started)
    result = timer.stop()
    result.update(step_s=times[args.warmup:], saved_activation_bytes=saved.peak,
                  threads=torch.get_num_threads())
    pathlib.Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def torch_run(microbatches: int, schedule: str, args) -> list[dict]:
    import torch.multiprocessing as mp
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as workdir:
        context = mp.start_processes(_torch_worker, args=(port, microbatches, schedule, args,
                                                          workdir),
                                     nprocs=STAGES, join=False, start_method="spawn")
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not context.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                raise RuntimeError("torch pipelining run did not finish in time")
        return [json.loads(pathlib.Path(workdir, f"rank{r}.json").read_text())
                for r in range(STAGES)]


# -- the unsplit step ------------------------------------------------------------------

def unsplit_run(args, threads: int = 2) -> list[dict]:
    torch.set_num_threads(threads)
    model = blocks(0, DEPTH)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    saved = _SavedBytes(model.parameters())
    x, y = batch()
    timer, times = _Timer(), []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            timer.start()
        started = time.perf_counter()
        with saved.hooks():
            F.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - started)
    result = timer.stop()
    # Two threads on the main thread's account: CPU time may exceed wall time.
    result["bubble"] = None
    result.update(step_s=times[args.warmup:], saved_activation_bytes=saved.peak,
                  threads=torch.get_num_threads())
    return [result]


# -- the table -------------------------------------------------------------------------

def summarise(runs: list[list[dict]]) -> dict:
    """Medians over repeats: steps/s (first process), per process bubble and memory."""
    steps_per_s = [1 / statistics.median(run[0]["step_s"]) for run in runs]
    row = {"steps_per_s": round(statistics.median(steps_per_s), 3),
           "steps_per_s_runs": [round(s, 3) for s in steps_per_s],
           # Main-thread CPU per step: the work, apart from waiting and preemption.
           "busy_ms_per_step": [round(statistics.median(
               1000 * run[p]["cpu_s"] / len(run[p]["step_s"]) for run in runs), 1)
               for p in range(len(runs[0]))]}
    for key in ("bubble", "recv_wait", "peak_activation_bytes", "saved_activation_bytes",
                "threads"):
        if key in runs[0][0] and runs[0][0][key] is not None:
            row[key] = [round(statistics.median(run[p][key] for run in runs), 3)
                        for p in range(len(runs[0]))]
    return row


def _ratio(speed: dict, a: str, b: str) -> float | None:
    return round(speed[a] / speed[b], 3) if a in speed and b in speed else None


def ceiling(table: dict, theory: float) -> dict:
    """What pipelining could give over the unmicro-batched split here, from
    the measured work: a pipeline's step takes at least its busiest
    process's CPU per step (micro-batched) over 1 - the theory's bubble."""
    out = {}
    for schedule, bubble in theory.items():
        row = table.get(f"splitrun_{schedule}")
        base = table.get("splitrun_no_microbatches")
        if row is None or base is None:
            continue
        best_step_ms = max(row["busy_ms_per_step"]) / (1 - bubble)
        out[schedule] = {
            "best_step_ms": round(best_step_ms, 1),
            "no_microbatches_step_ms": round(1000 / base["steps_per_s"], 1),
            "best_vs_no_microbatches": round(1000 / base["steps_per_s"] / best_step_ms, 3),
            # The same with the unmicro-batched split's work per step, i.e. if
            # micro-batches cost no more per row than the whole batch.
            "no_overhead_vs_no_microbatches": round(
                (1000 / base["steps_per_s"]) * (1 - bubble) / max(base["busy_ms_per_step"]), 3),
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--part", choices=["main", "ceiling", "all"], default="main",
                        help="main: the schedules next to torch's; ceiling: the thread rows "
                             "(2 threads per process unmicro-batched, the unsplit step on 1)")
    parser.add_argument("--width", type=int, default=WIDTH,
                        help="a smaller width checks the script quickly (not for numbers)")
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    _set_width(args.width)
    if args.job:
        return run_job(args)

    m = args.microbatches
    configs = {"splitrun_no_microbatches": lambda: splitrun_run(1, "1f1b", args)}
    if args.part in ("main", "all"):
        configs.update({
            "splitrun_gpipe": lambda: splitrun_run(m, "gpipe", args),
            "splitrun_1f1b": lambda: splitrun_run(m, "1f1b", args),
            "splitrun_interleaved": lambda: splitrun_run(m, "interleaved", args),
            "torch_gpipe": lambda: torch_run(m, "gpipe", args),
            "torch_1f1b": lambda: torch_run(m, "1f1b", args),
            "torch_interleaved": lambda: torch_run(m, "interleaved", args),
        })
    if args.part in ("ceiling", "all"):
        configs.update({
            "splitrun_1f1b": lambda: splitrun_run(m, "1f1b", args),
            "splitrun_no_microbatches_2_threads": lambda: splitrun_run(1, "1f1b", args, 2),
            "unsplit_one_process_1_thread": lambda: unsplit_run(args, 1),
        })
    configs["unsplit_one_process"] = lambda: unsplit_run(args)
    runs: dict[str, list] = {name: [] for name in configs}
    for _ in range(args.repeats):  # alternate, so a slow spell hits every configuration
        for name, run in configs.items():
            runs[name].append(run())
    table = {name: summarise(r) for name, r in runs.items()}
    speed = {name: row["steps_per_s"] for name, row in table.items()}
    from splitrun.splitter.plan import theoretical_bubble
    theory = {"gpipe": theoretical_bubble(STAGES, m), "1f1b": theoretical_bubble(STAGES, m),
              "interleaved": theoretical_bubble(STAGES, m, CHUNKS)}
    ratios = {
        "splitrun_1f1b_vs_torch_1f1b": _ratio(speed, "splitrun_1f1b", "torch_1f1b"),
        "splitrun_gpipe_vs_torch_gpipe": _ratio(speed, "splitrun_gpipe", "torch_gpipe"),
        "splitrun_interleaved_vs_torch_interleaved":
            _ratio(speed, "splitrun_interleaved", "torch_interleaved"),
        "splitrun_1f1b_vs_no_microbatches":
            _ratio(speed, "splitrun_1f1b", "splitrun_no_microbatches"),
        "splitrun_interleaved_vs_no_microbatches":
            _ratio(speed, "splitrun_interleaved", "splitrun_no_microbatches"),
        "splitrun_interleaved_vs_1f1b": _ratio(speed, "splitrun_interleaved", "splitrun_1f1b"),
        "splitrun_1f1b_vs_unsplit": _ratio(speed, "splitrun_1f1b", "unsplit_one_process"),
        "splitrun_1f1b_vs_no_microbatches_2_threads":
            _ratio(speed, "splitrun_1f1b", "splitrun_no_microbatches_2_threads"),
        "no_microbatches_2_threads_vs_1_thread":
            _ratio(speed, "splitrun_no_microbatches_2_threads", "splitrun_no_microbatches"),
        "splitrun_1f1b_vs_unsplit_1_thread":
            _ratio(speed, "splitrun_1f1b", "unsplit_one_process_1_thread"),
    }
    report = {
        "model": f"{DEPTH} x (Linear({WIDTH}, {WIDTH}) + GELU), MSE, SGD, batch {BATCH}",
        "processes": STAGES, "chunks_interleaved": CHUNKS, "microbatches": m,
        "steps": args.steps, "warmup": args.warmup, "part": args.part,
        "repeats": args.repeats, "cpu_count": os.cpu_count(), "torch": torch.__version__,
        "results": table,
        "theory_bubble": round(theory["1f1b"], 3),
        "theory_bubble_by_schedule": {k: round(v, 3) for k, v in theory.items()},
        "ratios": {k: v for k, v in ratios.items() if v is not None},
        "ceiling": ceiling(table, theory),
    }
    goals = {}
    if ratios["splitrun_1f1b_vs_torch_1f1b"] is not None:
        goals["1f1b_at_least_torch_1f1b"] = ratios["splitrun_1f1b_vs_torch_1f1b"] >= 1.0
    if ratios["splitrun_1f1b_vs_no_microbatches"] is not None:
        goals["1f1b_at_least_1.6x_no_microbatches"] = \
            ratios["splitrun_1f1b_vs_no_microbatches"] >= 1.6
    for schedule in ("1f1b", "interleaved"):
        row = table.get(f"splitrun_{schedule}")
        if row is not None:
            goals[f"{schedule}_bubble_within_10pct_of_theory"] = all(
                abs(b - theory[schedule]) <= 0.10 for b in row["bubble"])
    report["goals"] = goals
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
