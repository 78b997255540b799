"""Time to a target, for bench/ps_throughput.py: a task (model, data,
optimizer, target) and a clock that stops at the first step reaching it.

Two tasks:
- `digits`: examples/ps_train.py's MLP on scikit-learn's handwritten digits
  (global batch 64, Adam 1e-2), target 0.95 held-out accuracy;
- `bench`: the throughput benchmark's MLP (6.7 M parameters, global batch
  128, SGD 0.1 with momentum 0.9) on inputs labelled by a fixed random linear
  teacher (learnable, fresh batches every step), target a training loss of
  1.6 (mean of the last 5 steps' losses on the measuring process's shard).

What is evaluated: the parameters a step read (a splitrun worker's view of
the servers, `Executor.synced_state()`, which under a staleness bound may be
older than the servers'), or the model after the step (one process, DDP).
`steps` is the number of updates in the model that reached the target (the
loss task: the steps run). Evaluation time is left off the clock.
"""

from __future__ import annotations

import math
import pathlib
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
LOSS_WINDOW = 5


@dataclass
class Task:
    name: str
    batches: list            # global batches, as many as the run may take
    make_model: object       # () -> nn.Module, seeded: the same start everywhere
    make_optimizer: object   # (params) -> torch.optim.Optimizer
    test: tuple | None       # held-out (x, y) for accuracy targets
    target_accuracy: float | None = None
    target_loss: float | None = None

    def loss(self, model, x, y):
        return F.cross_entropy(model(x), y)

    def reached(self, model: nn.Module, state: dict | None, losses: list[float]) -> bool:
        """Whether the model (with `state` swapped in, when given) or the
        recent losses reach the target."""
        if self.target_loss is not None:
            recent = losses[-LOSS_WINDOW:]
            return len(recent) == LOSS_WINDOW and sum(recent) / LOSS_WINDOW <= self.target_loss
        x, y = self.test
        with torch.no_grad():
            logits = (model(x) if state is None
                      else torch.func.functional_call(model, state, (x,)))
        # Counted, not a float32 mean: 342 of 360 right is 0.95, which a
        # float32 mean gives as 0.94999999 (the target then missed).
        correct = (logits.argmax(1) == y).sum().item()
        return correct >= math.ceil(self.target_accuracy * len(y) - 1e-9)


def digits_task(max_steps: int) -> Task:
    sys.path.insert(0, str(EXAMPLES))
    from ps_train import digits, global_batches, mlp
    train_x, train_y, test_x, test_y = digits()
    batch_size = 64
    epochs = -(-max_steps * batch_size // len(train_x)) + 1
    batches = global_batches(train_x, train_y, batch_size, epochs)[:max_steps]

    def make_model():
        torch.manual_seed(0)
        return mlp(128)
    return Task("digits", batches, make_model,
                lambda params: torch.optim.Adam(params, lr=1e-2), (test_x, test_y),
                target_accuracy=0.95)


def bench_task(make_bench_model, width: int, batch_size: int, max_steps: int) -> Task:
    generator = torch.Generator().manual_seed(1)
    teacher = torch.randn(512, 10, generator=generator)
    batches = []
    for _ in range(max_steps):
        x = torch.randn(batch_size, 512, generator=generator)
        batches.append((x, (x @ teacher).argmax(1)))
    return Task("bench", batches, lambda: make_bench_model(width),
                lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9), None,
                target_loss=1.6)


class TargetClock:
    """Training time (evaluation left out) until the first step reaching the
    target; `result()` is what the benchmark reports."""

    def __init__(self) -> None:
        self.training_s = 0.0
        self.losses: list[float] = []
        self.seconds: float | None = None
        self.steps: int | None = None
        self._since = time.perf_counter()

    def step_done(self, task: Task, model, state, loss: float | None, updates: int) -> None:
        now = time.perf_counter()
        self.training_s += now - self._since
        if loss is not None:
            self.losses.append(loss)
        if self.seconds is None and task.reached(model, state, self.losses):
            self.seconds = self.training_s
            self.steps = updates if task.target_loss is None else len(self.losses)
        self._since = time.perf_counter()

    def result(self) -> dict:
        return {"reached": self.seconds is not None, "seconds": self.seconds,
                "steps": self.steps, "steps_run": len(self.losses),
                "final_loss": self.losses[-1] if self.losses else None}
