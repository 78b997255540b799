"""A job with a dynamic table (ids any int64) for the end-to-end tests, run
by the real launcher.

    PYTHONPATH=tests/support splitrun launch --workers 1 --servers 2 \
        tests/support/scripts/dynamic_job.py --steps 12 --out r.pt

Worker 0 writes the final state (the table's live rows and their ids) to
--out; each server writes its table counters to `<out>.server<rank>.json`.
--admit-after K --expire-after T --row-budget R: the table's `DynamicTable`.
--save-at N --save DIR: a sharded checkpoint after step N (training goes on);
--resume DIR continues one (on any number of servers).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from dynamic_models import hashed_batches, make_dynamic

from splitrun.runtime.job import Job
from splitrun.splitter import DynamicTable, EmbeddingCacheMode, Role


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--admit-after", type=int, default=1)
    parser.add_argument("--expire-after", type=int)
    parser.add_argument("--row-budget", type=int)
    parser.add_argument("--out", required=True)
    parser.add_argument("--save-at", type=int)
    parser.add_argument("--save")
    parser.add_argument("--resume")
    args = parser.parse_args()

    job = Job.from_env()
    batches = hashed_batches(args.steps)
    policy = DynamicTable(args.admit_after, args.expire_after, args.row_budget)
    program = make_dynamic(args.optimizer, job.cluster.num_workers, batches, policy=policy)
    trainer = job.start(program, EmbeddingCacheMode(), num_steps=args.steps,
                        resume=args.resume)
    for _ in trainer.run(trainer.shard(batches[trainer.steps_done:])):
        if trainer.steps_done == args.save_at and job.is_worker:
            trainer.save(args.save)
    final_state = trainer.finish()
    if job.label.role is Role.SERVER:
        with open(f"{args.out}.server{job.label.rank}.json", "w") as out:
            json.dump(trainer.cache_counters, out)
    if job.is_driver:
        torch.save(final_state, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
