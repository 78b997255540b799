"""Tensor-parallel training of a small transformer-style block, next to the unsplit step.

    splitrun launch --workers 2 examples/tp_train.py [--steps 40]
    splitrun launch --workers 4 examples/tp_train.py
    splitrun launch --workers 2 examples/tp_train.py --backend torch_distributed
    python examples/tp_train.py --local --workers 4   # every process as a thread

The block: a vocabulary-parallel embedding, an MLP with a column-parallel then
a row-parallel linear (Megatron's layout), a residual and a layer norm, a
column-parallel output head and a parallel cross-entropy whose class dimension
stays sharded. Only those layers are marked; propagation places everything
else (the layer norm, the optimizer's state, the backward). Worker 0 prints the
loss, the bytes each step sends (plan and executor counters), the collectives,
and checks the final parameters against the unsplit step (tolerance 1e-4).
`--backend torch_distributed` runs the collectives on a gloo process group
(NCCL on CUDA) instead of splitrun channels.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

import torch
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from models import markov_batches  # noqa: E402

from splitrun.runtime import Job, run_threaded  # noqa: E402
from splitrun.runtime.job import ENV  # noqa: E402
from splitrun.splitter import (  # noqa: E402  # noqa: E402
    Cluster,
    ParallelCrossEntropyLoss,
    ParallelEmbedding,
    ParallelLayout,
    ParallelLinear,
    ParallelMode,
    Program,
    capture,
    optim,
    split_program,
)

VOCAB, DIM, HIDDEN = 32, 16, 64
# Shards add their partial products in another order than the whole matrix
# product (float32), and Adam divides by the square root of small second
# moments: over tens of steps the difference grows to a few 1e-5 (10 steps of
# the tests' models stay within 1e-5).
TOLERANCE = 1e-4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = ParallelEmbedding(VOCAB, DIM, dim=0)     # rows of the vocabulary
        self.up = ParallelLinear(DIM, HIDDEN, dim=-1)          # column-parallel
        self.down = ParallelLinear(HIDDEN, DIM, dim=0)         # row-parallel
        self.norm = nn.LayerNorm(DIM)                          # left to propagation
        self.head = ParallelLinear(DIM, VOCAB, dim=-1)         # logits split by class
        self.loss = ParallelCrossEntropyLoss()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        x = self.norm(x + self.down(nn.functional.gelu(self.up(x))))
        return self.head(x)


def block_loss(model: Block, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return model.loss(model(tokens).reshape(-1, VOCAB), targets.reshape(-1))


def build(steps: int, lr: float) -> tuple[Program, list]:
    torch.manual_seed(0)  # every process builds the same model and data
    batches = markov_batches(steps, batch=8, length=8, vocab=VOCAB)
    program = capture(Block(), block_loss, optim.Adam(lr=lr), batches[0])
    return program, batches


def feeds(batches):
    return lambda step: {"batch.0": batches[step][0], "batch.1": batches[step][1]}


def describe(layout: ParallelLayout, plan_bytes: int) -> None:
    print("placements: " + ", ".join(f"{k}={v}" for k, v in layout.state.items()
                                      if "." in k and not k.endswith(("exp_avg", "exp_avg_sq"))))
    print(f"collectives per step ({len(layout.collectives)}):")
    for collective in layout.collectives:
        print(f"  {collective}")
    print(f"bytes per step: {layout.bytes_per_step} predicted by the layout, "
          f"{plan_bytes} by the plan's channels")


def compare(program: Program, batches, losses: list[float], final_state, sent_per_step: float,
            elapsed_s: float) -> int:
    started = time.perf_counter()
    history, expected = program.train_unsplit(len(batches), feeds(batches))
    unsplit_s = time.perf_counter() - started
    every = max(1, len(batches) // 8)
    print(f"{'step':>5}  {'split loss':>11}  {'unsplit loss':>12}")
    for step in range(0, len(batches), every):
        print(f"{step:>5}  {losses[step]:>11.6f}  {history[step]['loss'].item():>12.6f}")
    print(f"final  {losses[-1]:>11.6f}  {history[-1]['loss'].item():>12.6f}")
    worst = max((final_state[k] - v).abs().max().item() for k, v in expected.items())
    print(f"bytes sent per step (executor counters, all processes): {sent_per_step:.0f}")
    print(f"split: {len(batches) / elapsed_s:.1f} steps/s; unsplit in one process: "
          f"{len(batches) / unsplit_s:.1f} steps/s (2 shared cores: no speed-up expected)")
    ok = worst <= TOLERANCE
    print(f"final parameters equal the unsplit run within {TOLERANCE}: {ok} "
          f"(largest difference {worst:.2e})")
    return 0 if ok else 1


def run_launched(args) -> int:
    job = Job.from_env()
    program, batches = build(args.steps, args.lr)
    trainer = job.start(program, ParallelMode(policy=args.policy, backend=args.backend),
                        num_steps=args.steps)
    if job.is_driver:
        describe(trainer.split.artifacts, trainer.plan.bytes_per_step())
    started = time.perf_counter()
    losses = []
    for tokens, targets in trainer.shard(batches):
        outputs = trainer.step((tokens, targets))
        if "loss" in outputs:
            losses.append(outputs["loss"].item())
    sent = trainer.stats.bytes_sent
    collectives = trainer.process.collective_stats
    final_state = trainer.finish()  # collected: full tensors, as in the unsplit model
    if not job.is_driver:
        return 0
    if collectives is not None:
        print(f"torch.distributed collectives: {collectives.calls / args.steps:.0f} per step "
              f"per process, {collectives.input_bytes / args.steps:.0f} B of inputs per step "
              f"per process")
    # Worker 0 sees its own counters; every member sends the same amount.
    return compare(program, batches, losses, final_state,
                   sent * job.cluster.num_workers / args.steps, time.perf_counter() - started)


def run_local(args) -> int:
    program, batches = build(args.steps, args.lr)
    split = split_program(program, Cluster(num_workers=args.workers),
                          ParallelMode(policy=args.policy, backend=args.backend))
    split.lint()
    print(split.plan.summary())
    describe(split.artifacts, split.plan.bytes_per_step())
    started = time.perf_counter()
    run = run_threaded(split, args.steps, feeds(batches))
    elapsed = time.perf_counter() - started
    losses = [h["loss"].item() for h in run.history]
    sent = sum(s.bytes_sent for s in run.stats.values()) / args.steps
    return compare(program, batches, losses, run.state, sent,
                   elapsed)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--policy", default="global", choices=("first", "greedy", "global"))
    parser.add_argument("--backend", default="channels",
                        choices=("channels", "torch_distributed"),
                        help="collectives as splitrun channels, or on a torch.distributed "
                             "process group (gloo on CPU, NCCL on CUDA)")
    parser.add_argument("--local", action="store_true",
                        help="run every process as a thread of this one (loopback)")
    parser.add_argument("--workers", type=int, default=2, choices=(1, 2, 4),
                        help="with --local: the size of the tensor-parallel group")
    args = parser.parse_args()
    if args.local:
        return run_local(args)
    if not (os.environ.get(ENV.SCHEDULER) or os.environ.get(ENV.PLAN_OUT)):
        print("not started by splitrun; run `splitrun launch --workers 2 "
              "examples/tp_train.py`, or pass --local", file=sys.stderr)
        return 2
    return run_launched(args)


if __name__ == "__main__":
    sys.exit(main())
