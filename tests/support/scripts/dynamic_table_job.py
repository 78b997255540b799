"""A job with a dynamic table (ids any int64) for the end-to-end tests, run
by the real launcher.

    PYTHONPATH=tests/support splitrun launch --workers 1 --servers 2 \
        tests/support/scripts/dynamic_table_job.py --steps 12 --out r.pt

Worker 0 writes the final state (the table's live rows and their ids) to
--out; each server writes its table counters to `<out>.server<rank>.json`.
--admit-after K --expire-after T --row-budget R: the table's `DynamicTable`.
--save-at N --save DIR: a sharded checkpoint after step N (training goes on);
--resume DIR continues one (on any number of servers).
--finish-to DIR --gather-up-to BYTES: `finish(save_to=DIR, gather_tables_up_to=BYTES)`;
worker 0 writes each `LiveTable` handed back loaded whole, the table's live ids
(`view.ids`) and, under `probed.<key>`, the rows of PROBE read through the view.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from dynamic_models import TABLE, hashed_batches, make_dynamic

from splitrun.runtime import LiveTable
from splitrun.runtime.job import Job
from splitrun.splitter import DynamicTable, EmbeddingCacheMode, Role

# Positions among the live ids whose rows are read through a view: repeats, any shape.
PROBE = torch.tensor([[3, 0, 3], [-1, 1, 2]])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--admit-after", type=int, default=1)
    parser.add_argument("--expire-after", type=int)
    parser.add_argument("--row-budget", type=int)
    parser.add_argument("--max-staleness", type=int, default=0)
    parser.add_argument("--out", required=True)
    parser.add_argument("--save-at", type=int)
    parser.add_argument("--save")
    parser.add_argument("--resume")
    parser.add_argument("--finish-to")
    parser.add_argument("--gather-up-to", type=int)
    args = parser.parse_args()

    job = Job.from_env()
    batches = hashed_batches(args.steps)
    policy = DynamicTable(args.admit_after, args.expire_after, args.row_budget)
    program = make_dynamic(args.optimizer, job.cluster.num_workers, batches, policy=policy,
                           max_staleness=args.max_staleness)
    trainer = job.start(program, EmbeddingCacheMode(), num_steps=args.steps,
                        resume=args.resume)
    for _ in trainer.run(trainer.shard(batches[trainer.steps_done:])):
        if trainer.steps_done == args.save_at and job.is_worker:
            trainer.save(args.save)
    final_state = trainer.finish(save_to=args.finish_to, gather_tables_up_to=args.gather_up_to)
    if job.label.role is Role.SERVER:
        with open(f"{args.out}.server{job.label.rank}.json", "w") as out:
            json.dump(trainer.cache_counters, out)
    if job.is_driver:
        out = dict(final_state)
        for key, view in final_state.items():
            if isinstance(view, LiveTable):
                out[key] = view.load()
                out[f"{TABLE}.ids"] = view.ids
                out[f"probed.{key}"] = view[view.ids[PROBE]]
        torch.save(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
