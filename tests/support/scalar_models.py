"""A 0-dim parameter (a learnable temperature) owned by one process and read on
another: the model, its batches and the functional optimizers it trains with,
for tests/splitter/test_scalar_param.py, tests/e2e/test_scalar_param_e2e.py and
the job they launch (tests/support/scripts/scalar_job.py)."""

import torch
import torch.nn.functional as F
from torch import nn

from splitrun.splitter import capture, optim, place

NUM_STEPS = 8

OPTIMIZERS = {
    "sgd": lambda: optim.SGD(lr=0.1, momentum=0.9, weight_decay=1e-3),
    "adam": lambda: optim.Adam(lr=0.05),
    "adamw": lambda: optim.AdamW(lr=0.05, weight_decay=0.1),
    "adagrad": lambda: optim.Adagrad(lr=0.1),
}


class TemperedClassifier(nn.Module):
    """Logits divided by exp(log_temp): the scalar lives on `owner`, the
    logits (and so the read of the scalar) on worker 0."""

    def __init__(self, owner: dict) -> None:
        super().__init__()
        self.head = place(nn.Linear(6, 3), rank=0)
        self.log_temp = place(nn.Parameter(torch.tensor(0.25)), **owner)

    def forward(self, x):
        return self.head(x) / self.log_temp.exp()


def make(owner: dict, optimizer: str, shard: int):
    torch.manual_seed(0)
    model = TemperedClassifier(owner)
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 6, generator=generator),
                torch.randint(0, 3, (8,), generator=generator)) for _ in range(NUM_STEPS)]
    loss_fn = lambda m, x, y: F.cross_entropy(m(x), y)  # noqa: E731
    example = (batches[0][0][:shard], batches[0][1][:shard])
    return capture(model, loss_fn, OPTIMIZERS[optimizer](), example), batches


def feeds(batches):
    return lambda step: {"batch.0": batches[step][0], "batch.1": batches[step][1]}
