"""Parameter-server training of an MLP on the handwritten digits (scikit-learn's
copy, no download): workers train on their shard of each global batch, the
parameters and Adam's moments live on the servers.

    splitrun launch --workers 2 --servers 1 examples/ps_train.py
    splitrun launch --workers 2 --servers 2 examples/ps_train.py --epochs 5 --save ckpt.pt
    splitrun launch --workers 2 --servers 1 examples/ps_train.py --resume ckpt.pt

Worker 0 prints the held-out accuracy and the time taken at the end.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

from splitrun.runtime.job import Job
from splitrun.splitter import ParameterServerMode, capture, place


def digits(seed: int = 0):
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    train_x, test_x, train_y, test_y = train_test_split(x, y, test_size=0.2, random_state=seed,
                                                        stratify=y)
    return train_x, train_y, test_x, test_y


def global_batches(x, y, batch_size: int, epochs: int, seed: int = 0):
    """The same shuffled global batches on every process (full batches only)."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=generator)
        for start in range(0, len(x) - batch_size + 1, batch_size):
            index = order[start:start + batch_size]
            batches.append((x[index], y[index]))
    return batches


def mlp(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, 10))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--save", help="write a checkpoint here at the end")
    parser.add_argument("--resume", help="start from this checkpoint")
    parser.add_argument("--min-accuracy", type=float, default=0.0,
                        help="exit 1 when the held-out accuracy is below this")
    args = parser.parse_args()

    job = Job.from_env()
    torch.manual_seed(0)
    model = mlp(args.hidden)
    place(model, role="server")  # every parameter on a server, spread by size
    train_x, train_y, test_x, test_y = digits()
    batches = global_batches(train_x, train_y, args.batch_size, args.epochs)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=len(batches))
    shard = args.batch_size // job.cluster.num_workers
    program = capture(model, lambda m, x, y: F.cross_entropy(m(x), y), optimizer,
                      (train_x[:shard], train_y[:shard]))
    trainer = job.start(program, ParameterServerMode(), num_steps=len(batches),
                        resume=args.resume)
    for _ in range(trainer.steps_done):
        schedule.step()  # a resumed run continues the schedule where it stopped

    started = time.perf_counter()
    first = trainer.steps_done
    for batch in trainer.shard(batches[first:]):
        trainer.step(batch)
        schedule.step()
    if args.save and job.is_worker:
        trainer.save(args.save)
    final_state = trainer.finish()
    if not job.is_driver:
        return 0

    elapsed = time.perf_counter() - started
    model.load_state_dict({k: v for k, v in final_state.items() if k in model.state_dict()})
    with torch.no_grad():
        accuracy = (model(test_x).argmax(1) == test_y).float().mean().item()
    steps = trainer.steps_done - first
    samples = steps * args.batch_size
    workers, servers = job.cluster.num_workers, job.cluster.num_servers
    print(f"trained {steps} steps ({samples} samples) on {workers} "
          f"worker{'' if workers == 1 else 's'} and {servers} "
          f"server{'' if servers == 1 else 's'} in {elapsed:.1f} s "
          f"({samples / elapsed:.0f} samples/s)")
    print(f"held-out accuracy: {accuracy:.4f} on {len(test_y)} digits")
    if args.save:
        print(f"checkpoint written to {args.save}")
    if accuracy < args.min_accuracy:
        print(f"accuracy {accuracy:.4f} is below --min-accuracy {args.min_accuracy}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
