"""TorchRec's DLRM (a table pooled by two features) trained through
`TorchRecInput` by the real launcher, for the end-to-end tests.

    PYTHONPATH=tests/support splitrun launch --workers 2 --servers 1 \
        tests/support/scripts/torchrec_job.py --mode cache --dense worker --steps 8 --out r.pt

--save PATH (each one: a .pt file, or else a sharded directory) saves after the
last step; --torchrec-batches feeds TorchRec's `Batch` objects to
`trainer.shard`, which cuts and converts them itself.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torchrec.datasets.utils import Batch
from torchrec_models import converted

from splitrun.runtime.job import Job
from splitrun.splitter import EmbeddingCacheMode, ParameterServerMode


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["cache", "ps"], default="cache")
    parser.add_argument("--optimizer", choices=["sgd", "adagrad"], default="sgd")
    parser.add_argument("--dense", choices=["worker", "server"], default="worker")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--save", action="append", default=[])
    parser.add_argument("--torchrec-batches", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()

    job = Job.from_env()
    _, rec, program, batches = converted(args.optimizer, job.cluster.num_workers,
                                         cache=args.mode == "cache", dense=args.dense,
                                         num_steps=args.steps)
    mode = (EmbeddingCacheMode(dense=args.dense) if args.mode == "cache"
            else ParameterServerMode(dense=args.dense))
    trainer = job.start(program, mode, num_steps=args.steps)
    if args.torchrec_batches:
        batches = [Batch(dense_features=d, sparse_features=f, labels=y) for d, f, y in batches]
    for _ in trainer.run(trainer.shard(batches)):
        pass
    if job.is_worker:
        for path in args.save:
            trainer.save(path)
    final_state = trainer.finish()
    if job.is_driver and args.out:
        torch.save({"state": final_state, "counters": trainer.cache_counters}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
