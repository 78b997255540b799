"""What one or two steps of delay cost in steps, apart from any runtime: the
time-to-target tasks of bench/time_to_target.py trained in one process with
every step's gradient taken at the parameters `delay` updates old (the
gradient of x_{c-d} applied to x_c, the worst case of ParameterServerMode(
staleness=d)), for a few optimizers. Prints JSON: steps to each task's target
per optimizer and delay (null: not reached within the steps).

    python bench/delay_replay.py [--delays 0 1 2] [--tasks digits bench]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys

import torch
import torch.nn.functional as F
from ps_throughput import model
from time_to_target import bench_task, digits_task

DIGITS_OPTIMIZERS = {
    "adam_1e-2 (the job's)": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adam_3e-3": lambda p: torch.optim.Adam(p, lr=3e-3),
    "adam_1e-2_beta1_0": lambda p: torch.optim.Adam(p, lr=1e-2, betas=(0.0, 0.999)),
    "sgd_0.5": lambda p: torch.optim.SGD(p, lr=0.5),
    "sgd_0.1_momentum_0.9": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
}


def steps_to_target(task, make_optimizer, delay: int) -> int | None:
    """Train `task` with every gradient taken `delay` updates late; the first
    step whose model reaches the target (None: none did)."""
    net = task.make_model()
    optimizer = make_optimizer(net.parameters())
    # x_{c-delay} .. x_c (fewer at the start): the oldest is read.
    versions = collections.deque([{k: p.detach().clone() for k, p in net.named_parameters()}],
                                 maxlen=delay + 1)
    losses = []
    for step, (x, y) in enumerate(task.batches):
        read = {k: t.clone().requires_grad_() for k, t in versions[0].items()}
        loss = F.cross_entropy(torch.func.functional_call(net, read, (x,)), y)
        for p, grad in zip(net.parameters(), torch.autograd.grad(loss, list(read.values()))):
            p.grad = grad
        optimizer.step()
        versions.append({k: p.detach().clone() for k, p in net.named_parameters()})
        losses.append(loss.item())
        if task.reached(net, None, losses):
            return step + 1
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delays", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--tasks", nargs="+", choices=["digits", "bench"],
                        default=["digits", "bench"])
    parser.add_argument("--digits-steps", type=int, default=300)
    parser.add_argument("--bench-steps", type=int, default=120)
    args = parser.parse_args()
    torch.set_num_threads(1)
    report = {"benchmark": "delay_replay", "delays": args.delays, "results": {}}
    if "digits" in args.tasks:
        task = digits_task(args.digits_steps)
        report["results"]["digits"] = {
            "target": "held-out accuracy 0.95", "max_steps": args.digits_steps,
            "steps": {name: {str(d): steps_to_target(task, make, d) for d in args.delays}
                      for name, make in DIGITS_OPTIMIZERS.items()}}
    if "bench" in args.tasks:
        task = bench_task(model, 1700, 128, args.bench_steps)
        report["results"]["bench"] = {
            "target": "training loss 1.6 (mean of 5 steps)", "max_steps": args.bench_steps,
            "steps": {"sgd_0.1_momentum_0.9 (the job's)": {
                str(d): steps_to_target(task, task.make_optimizer, d) for d in args.delays}}}
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
