"""A training job for the end-to-end tests, run by the real launcher.

    PYTHONPATH=examples splitrun launch --workers 3 tests/support/scripts/train_job.py \
        --steps 12 --out result.pt [--microbatches 4 --schedule 1f1b]

Worker 0 saves the losses and the final state gathered from every process to
--out (a file this test suite reads back; nothing from the network is loaded).
`build()` is imported by the tests to compute the unsplit reference.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import pathlib
import sys
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from models import TiedBigramLM, lm_loss, markov_batches
from torch import nn

from splitrun.splitter import GeneralMode, capture, optim, place, region

OPTIMIZERS = {
    "sgd": lambda: optim.SGD(lr=0.05, momentum=0.9, weight_decay=1e-3),
    "adam": lambda: optim.Adam(lr=0.01),
    "adagrad": lambda: optim.Adagrad(lr=0.05),
}


class Pipeline(nn.Module):
    def __init__(self, num_workers: int, width: int = 32) -> None:
        super().__init__()
        self.stages = nn.ModuleList([nn.Sequential(nn.Linear(12, width), nn.ReLU()),
                                     nn.Sequential(nn.Linear(width, width), nn.Tanh()),
                                     nn.Linear(width, 5)])
        for index, stage in enumerate(self.stages):
            place(stage, rank=min(index, num_workers - 1))

    def forward(self, x):
        for stage in self.stages:
            x = stage(x)
        return x


class Chunks(nn.Module):
    """2 pieces per worker, placed in turn (rank = piece % workers), the head
    with the last: the chunks of an interleaved pipeline."""

    def __init__(self, num_workers: int, width: int = 32) -> None:
        super().__init__()
        self.pieces = nn.ModuleList([
            place(nn.Sequential(nn.Linear(12 if i == 0 else width, width), nn.Tanh()),
                  rank=i % num_workers) for i in range(2 * num_workers)])
        self.head = place(nn.Linear(width, 5), rank=num_workers - 1)

    def forward(self, x):
        for piece in self.pieces:
            x = piece(x)
        return self.head(x)


def _loss_on_last_worker(num_workers: int):
    def loss_fn(model, x, y):
        logits = model(x)
        with region(rank=num_workers - 1):
            return F.cross_entropy(logits, y)
    return loss_fn


def mlp_batches(steps: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The batches of the models other than "lm", drawn one at a time in step
    order from one seeded generator: the same values listed or drawn lazily."""
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        yield (torch.randn(16, 12, generator=generator),
               torch.randint(0, 5, (16,), generator=generator))


def build(model_name: str, optimizer: str, num_workers: int, steps: int, hidden: int = 32,
          *, lazy: bool = False):
    """The program and its batches; every process builds the same ones.
    `lazy`: the batches as an iterator that draws each when reached (a job
    killed long before its last step draws only those it ran)."""
    torch.manual_seed(0)
    if model_name == "lm":
        model, loss_fn = TiedBigramLM(num_workers=num_workers), lm_loss
        batches = iter(markov_batches(steps, batch=8))
    else:
        model = (Chunks if model_name == "chunks" else Pipeline)(num_workers, hidden)
        loss_fn = lambda m, x, y: F.cross_entropy(m(x), y)  # noqa: E731
        if model_name in ("stages", "chunks"):  # the loss on the last worker, after the pipeline
            loss_fn = _loss_on_last_worker(num_workers)
        batches = mlp_batches(steps)
    first = next(batches)
    program = capture(model, loss_fn, OPTIMIZERS[optimizer](), first)
    batches = itertools.chain([first], batches)
    return program, (batches if lazy else list(batches))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="mlp", choices=["mlp", "stages", "chunks", "lm"])
    parser.add_argument("--optimizer", default="adam", choices=sorted(OPTIMIZERS))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--out", type=pathlib.Path)
    parser.add_argument("--microbatches", type=int, default=1)
    parser.add_argument("--schedule", default="1f1b")
    args = parser.parse_args()

    from splitrun.runtime.job import Job
    job = Job.from_env()
    program, batches = build(args.model, args.optimizer, job.cluster.num_workers, args.steps,
                             args.hidden, lazy=True)
    mode = GeneralMode(microbatches=args.microbatches, schedule=args.schedule)
    trainer = job.start(program, mode, num_steps=args.steps)
    logging.getLogger("train_job").warning("training started")
    losses = []
    if job.is_worker:
        for batch in batches:
            outputs = trainer.step(batch)
            if "loss" in outputs:
                losses.append(outputs["loss"])
    final_state = trainer.finish()
    if job.is_driver and args.out:
        torch.save({"losses": torch.stack(losses), "state": final_state}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
