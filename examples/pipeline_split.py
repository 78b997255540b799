"""Split a model three ways and train it next to the unsplit step.

Every process of the split program runs as a thread of this process over the
loopback transport; the losses of both runs are printed side by side and must
be identical.

    python examples/pipeline_split.py [--steps 30] [--workers 3] [--plan plan.dot]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from models import TiedBigramLM, lm_loss, markov_batches  # noqa: E402

from splitrun.runtime import run_threaded  # noqa: E402
from splitrun.splitter import Cluster, capture, optim, split  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--workers", type=int, default=3, choices=(2, 3))
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--plan", type=pathlib.Path, help="write the plan as DOT here")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = TiedBigramLM(num_workers=args.workers)
    batches = markov_batches(args.steps)
    feeds = lambda step: {"batch.0": batches[step][0], "batch.1": batches[step][1]}  # noqa: E731

    program = capture(model, lm_loss, optim.Adam(lr=args.lr), batches[0])
    plan = split(program, Cluster(num_workers=args.workers))
    plan.lint(program)
    print(plan.summary())
    if args.plan:
        args.plan.write_text(plan.to_dot())
        print(f"plan written to {args.plan}")

    started = time.perf_counter()
    unsplit_history, unsplit_state = program.train_unsplit(args.steps, feeds)
    unsplit_s = time.perf_counter() - started
    started = time.perf_counter()
    run = run_threaded(plan, args.steps, feeds)
    split_s = time.perf_counter() - started

    print(f"{'step':>4}  {'unsplit loss':>12}  {'split loss':>12}")
    for step in range(args.steps):
        print(f"{step:>4}  {unsplit_history[step]['loss'].item():>12.6f}  "
              f"{run.history[step]['loss'].item():>12.6f}")
    same = all(torch.equal(run.state[key], unsplit_state[key]) for key in unsplit_state)
    same &= all(torch.equal(run.history[s]["loss"], unsplit_history[s]["loss"])
                for s in range(args.steps))
    messages = sum(stats.messages_sent for stats in run.stats.values()) / args.steps
    print(f"split run: {messages:.0f} messages per step, {args.steps / split_s:.1f} steps/s "
          f"(unsplit {args.steps / unsplit_s:.1f} steps/s)")
    print("final parameters and losses identical to the unsplit step:", same)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
