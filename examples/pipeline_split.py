"""Train a model split three ways across real processes, next to the unsplit step.

    splitrun launch --workers 3 examples/pipeline_split.py [--steps 60]
    splitrun plan --workers 3 examples/pipeline_split.py --out plan.dot
    python examples/pipeline_split.py --local     # every process as a thread, no sockets

The embedding runs on worker 0, the MLP on worker 1, the tied output head on
worker 2 (it reads worker 0's embedding table by data-sync every step), the loss
on worker 0. Worker 0 also trains the unsplit step on the same data and prints
both losses; the run fails unless the final parameters are identical.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from models import TiedBigramLM, lm_loss, markov_batches  # noqa: E402

from splitrun.runtime import Job, run_threaded  # noqa: E402
from splitrun.runtime.job import ENV  # noqa: E402
from splitrun.splitter import Cluster, Program, capture, optim, split_program  # noqa: E402

# Largest difference allowed between a run on CUDA and the unsplit run on the CPU.
CUDA_TOLERANCE = 1e-4


def build(num_workers: int, steps: int, lr: float):
    torch.manual_seed(0)  # every process builds the same model and data
    model = TiedBigramLM(num_workers=num_workers)
    batches = markov_batches(steps)
    program = capture(model, lm_loss, optim.Adam(lr=lr), batches[0])
    return program, batches


def compare(program: Program, batches, losses: list[float],
            final_state: dict[str, torch.Tensor], elapsed_s: float,
            device_type: str = "cpu") -> int:
    started = time.perf_counter()
    history, expected = program.train_unsplit(
        len(batches), lambda s: {"batch.0": batches[s][0], "batch.1": batches[s][1]})
    unsplit_s = time.perf_counter() - started
    every = max(1, len(batches) // 10)
    print(f"{'step':>5}  {'split loss':>11}  {'unsplit loss':>12}")
    for step in range(0, len(batches), every):
        print(f"{step:>5}  {losses[step]:>11.6f}  {history[step]['loss'].item():>12.6f}")
    print(f"final  {losses[-1]:>11.6f}  {history[-1]['loss'].item():>12.6f}")
    print(f"split: {len(batches) / elapsed_s:.1f} steps/s; unsplit in one process: "
          f"{len(batches) / unsplit_s:.1f} steps/s")
    if device_type == "cpu":
        differ = {key: (final_state[key] - value).abs().max().item()
                  for key, value in expected.items() if not torch.equal(final_state[key], value)}
        print(f"final parameters identical to the unsplit run: {not differ}")
        if differ:
            first = next((step for step, h in enumerate(history)
                          if h["loss"].item() != losses[step]), None)
            print(f"first step whose loss differs: {first}; largest difference by "
                  f"parameter: {differ}")
        return 1 if differ else 0
    # The unsplit reference runs on the CPU; CUDA's kernels sum in another order.
    error = max((final_state[key].cpu() - value).abs().max().item()
                for key, value in expected.items())
    print(f"final parameters within {error:.1e} of the unsplit run on the CPU "
          f"(tolerance {CUDA_TOLERANCE:g})")
    return 0 if error <= CUDA_TOLERANCE else 1


def run_launched(args) -> int:
    job = Job.from_env()
    program, batches = build(job.cluster.num_workers, args.steps, args.lr)
    trainer = job.start(program, num_steps=args.steps)
    started = time.perf_counter()
    losses = []
    if job.is_worker:
        for tokens, targets in batches:
            outputs = trainer.step((tokens, targets))
            if "loss" in outputs:
                losses.append(outputs["loss"].item())
    final_state = trainer.finish()
    if not job.is_driver:
        return 0
    return compare(program, batches, losses, final_state, time.perf_counter() - started,
                   job.device.type)


def run_local(args) -> int:
    program, batches = build(args.workers, args.steps, args.lr)
    split_prog = split_program(program, Cluster(num_workers=args.workers))
    split_prog.lint()
    print(split_prog.plan.summary())
    started = time.perf_counter()
    run = run_threaded(split_prog, args.steps,
                       lambda s: {"batch.0": batches[s][0], "batch.1": batches[s][1]})
    losses = [h["loss"].item() for h in run.history]
    return compare(program, batches, losses, run.state, time.perf_counter() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--local", action="store_true",
                        help="run every process as a thread of this one (loopback)")
    parser.add_argument("--workers", type=int, default=3, choices=(1, 2, 3),
                        help="with --local: how many workers to split across")
    args = parser.parse_args()
    if args.local:
        return run_local(args)
    if not (os.environ.get(ENV.SCHEDULER) or os.environ.get(ENV.PLAN_OUT)):
        print("not started by splitrun; run `splitrun launch --workers 3 "
              "examples/pipeline_split.py`, or pass --local", file=sys.stderr)
        return 2
    return run_launched(args)


if __name__ == "__main__":
    sys.exit(main())
