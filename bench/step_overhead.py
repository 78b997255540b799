"""What a split step costs against the same work unsplit, on the CPU. Prints JSON.

Three jobs, each split (a real `splitrun launch`) and unsplit in the same run,
the median of `--repeats` runs each:

- the main job: examples/ps_train.py on 2 workers + 1 server, against its
  model, batches and Adam in one process (bench/gpu.py's `main_job` and
  `one_process`; samples/s);
- the PS bench model: bench/ps_throughput.py's job (6.7 M parameters, global
  batch 128, SGD with momentum) on 2 workers + 1 server, against one process
  with torch's default threads (steps/s);
- the pipeline example: `make run-pipeline` (examples/pipeline_split.py, 3
  stages), which prints its split and its unsplit steps/s itself.

Each split process's busy milliseconds a step (its step's time less its waits
in receives, from its closing line) sit beside the same work eager in this
process with one intra-op thread: a main-job worker's half batch (forward,
backward, Adam: what a worker and its server do between them) and a PS-bench
worker's half batch.

    python bench/step_overhead.py [--repeats 3] [--epochs 20]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import statistics
import subprocess
import sys
import time

import torch

HERE = pathlib.Path(__file__).resolve()
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(REPO / "examples"))

import gpu  # noqa: E402  (bench/gpu.py: the launched jobs and their busy times)

PS_STEPS = 40
EAGER_STEPS = 300
JOB_TIMEOUT_S = 900


def _eager_ms_per_step(model, loss_fn, optimizer, batch, steps: int = EAGER_STEPS) -> float:
    """The median ms of one eager step (zero_grad, forward, backward, update)
    with one intra-op thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = []
        for _ in range(steps):
            started = time.perf_counter()
            optimizer.zero_grad()
            loss_fn(model, *batch).backward()
            optimizer.step()
            times.append(time.perf_counter() - started)
        return round(statistics.median(times[steps // 5:]) * 1e3, 3)
    finally:
        torch.set_num_threads(threads)


def main_job_half_batch_ms() -> float:
    import torch.nn.functional as F
    from ps_train import digits, mlp

    torch.manual_seed(0)
    model = mlp(128)
    x, y, _, _ = digits()
    return _eager_ms_per_step(model, lambda m, a, b: F.cross_entropy(m(a), b),
                              torch.optim.Adam(model.parameters(), lr=1e-2), (x[:32], y[:32]))


def ps_model_half_batch_ms() -> float:
    import ps_bench_model as ps_throughput

    net = ps_throughput.model(1700)
    x, y = ps_throughput.batches(1, 128)[0]
    return _eager_ms_per_step(net, ps_throughput.loss_fn,
                              torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9),
                              (x[:64], y[:64]), steps=60)


def ps_model_one_process(steps: int = PS_STEPS) -> float:
    """bench/ps_throughput.py's model in one process, torch's default threads:
    steps/s after its warm-up."""
    import ps_bench_model as ps_throughput

    net = ps_throughput.model(1700)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    data = ps_throughput.batches(steps + ps_throughput.WARMUP_STEPS, 128)
    started = None
    for index, (x, y) in enumerate(data):
        if index == ps_throughput.WARMUP_STEPS:
            started = time.perf_counter()
        optimizer.zero_grad()
        ps_throughput.loss_fn(net, x, y).backward()
        optimizer.step()
    return steps / (time.perf_counter() - started)


PIPELINE_LINE = re.compile(r"split: ([0-9.]+) steps/s; unsplit in one process: ([0-9.]+) steps/s")


def pipeline_example() -> dict:
    argv = [sys.executable, "-m", "splitrun.launcher", "--log-level", "INFO", "launch",
            "--workers", "3", str(REPO / "examples" / "pipeline_split.py")]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    output = done.stdout + done.stderr
    match = PIPELINE_LINE.search(output)
    if done.returncode != 0 or match is None:
        raise RuntimeError(f"{' '.join(argv)} exited with {done.returncode}:\n{output[-3000:]}")
    busy = {name: round((float(total) - float(waited)) * 1e3 / int(steps), 2)
            for name, steps, total, waited in gpu.PROCESS_LINE.findall(output)}
    return {"split_steps_s": float(match.group(1)), "unsplit_steps_s": float(match.group(2)),
            "busy_ms_per_step": busy}


def _median(values) -> float:
    return round(statistics.median(values), 2)


def _against_one_process(runs: list[dict], single: list[float], rate: str,
                         half_batch_ms: float, goal: str) -> dict:
    """Split runs (2 workers + 1 server) against one process, medians."""
    split = statistics.median(r[rate] for r in runs)
    return {f"split_2w_1s_{rate}": round(split, 2),
            f"one_process_{rate}": _median(single),
            "split_vs_one_process": round(split / statistics.median(single), 3),
            "busy_ms_per_step": [r["busy_ms_per_step"] for r in runs],
            "worker_half_batch_eager_1_thread_ms": half_batch_ms, "goal": goal}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=20,
                        help="the main job's epochs (its own default)")
    args = parser.parse_args()
    started = time.perf_counter()
    report: dict = {"benchmark": "step_overhead", "repeats": args.repeats,
                    "threads_of_this_process": torch.get_num_threads()}

    report["main_job"] = _against_one_process(
        [gpu.main_job("cpu", args.epochs) for _ in range(args.repeats)],
        [gpu.one_process("cpu", args.epochs) for _ in range(args.repeats)], "samples_s",
        main_job_half_batch_ms(),
        "split >= 0.7x one process; a worker's busy ms <= 1.3x the eager half batch")
    report["ps_bench_model"] = _against_one_process(
        [gpu.ps_bench_model("cpu", PS_STEPS) for _ in range(args.repeats)],
        [ps_model_one_process() for _ in range(args.repeats)], "steps_s",
        ps_model_half_batch_ms(), "split >= 0.7x one process with 2 threads")

    runs = [pipeline_example() for _ in range(args.repeats)]
    split = _median(r["split_steps_s"] for r in runs)
    unsplit = _median(r["unsplit_steps_s"] for r in runs)
    report["pipeline_example"] = {
        "split_3_stages_steps_s": split, "unsplit_steps_s": unsplit,
        "split_vs_unsplit": round(split / unsplit, 3),
        "busy_ms_per_step": [r["busy_ms_per_step"] for r in runs],
        "goal": "split >= 0.5x unsplit"}
    report["total_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
