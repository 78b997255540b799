"""An embedding-cache job for the end-to-end tests, run by the real launcher.

    PYTHONPATH=tests/support splitrun launch --workers 1 --servers 2 \
        tests/support/scripts/cache_job.py --steps 20 --out r.pt

--stop-after N trains only up to step N (and --save writes a checkpoint there);
--save-at N writes the checkpoint after step N instead and trains on (each
--save one: a .pt file, or else a sharded directory); --resume continues one.
--lazy-rows: the tables' rows come from a row initializer, made by the servers
as first used (the model's own tables are NaN; with --meta-tables, on `meta`).
--finish-to DIR --gather-up-to BYTES: `finish(save_to=DIR, gather_tables_up_to=BYTES)`;
worker 0 writes each table handed back as a view loaded whole, the keys that
were views, and the rows of PROBE_IDS read through each view.
--bad-batch-at N --bad-batch KIND: the batch of step N is bad: `ids`, one id
past its table; `type`, a string; `raises`, the batches' iterator raises there.
"""

from __future__ import annotations

import argparse
import sys

import torch
from cache_models import make, make_sum_bags

from splitrun.runtime import ShardedTable
from splitrun.runtime.job import Job
from splitrun.splitter import EmbeddingCacheMode

# Rows read through a table's view (`--gather-up-to`): repeats, any shape.
PROBE_IDS = torch.tensor([[3, 0, 3], [17, 1, 2]])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--optimizer", default="adagrad")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--cache-rows", type=int, default=48)
    parser.add_argument("--policy", default="lru")
    parser.add_argument("--max-staleness", type=int, default=0)
    parser.add_argument("--stop-after", type=int)
    parser.add_argument("--save", action="append", default=[])
    parser.add_argument("--save-at", type=int)
    parser.add_argument("--resume")
    parser.add_argument("--out")
    parser.add_argument("--model", choices=["embeddings", "sum_bags"], default="embeddings")
    parser.add_argument("--dense", choices=["server", "worker"], default="server")
    parser.add_argument("--bad-batch-at", type=int)
    parser.add_argument("--bad-batch", choices=["ids", "type", "raises"], default="ids")
    parser.add_argument("--finish-to")
    parser.add_argument("--gather-up-to", type=int)
    parser.add_argument("--lazy-rows", action="store_true",
                        help="tables from cache_models.LAZY_INIT, their rows made lazily")
    parser.add_argument("--meta-tables", action="store_true",
                        help="with --lazy-rows: the model's tables on the meta device")
    args = parser.parse_args()

    job = Job.from_env()
    options = {"dense_on_servers": args.dense == "server"} if args.model == "sum_bags" else {}
    if args.lazy_rows:
        options["lazy_rows"] = True
    if args.meta_tables:
        options["meta_tables"] = True
    program, batches = (make_sum_bags if args.model == "sum_bags" else make)(
        args.optimizer, job.cluster.num_workers, args.steps, cache_rows=args.cache_rows,
        policy=args.policy, max_staleness=args.max_staleness, **options)
    trainer = job.start(program, EmbeddingCacheMode(dense=args.dense), num_steps=args.steps,
                        resume=args.resume)
    stop = args.stop_after or args.steps
    mine = trainer.shard(batches[trainer.steps_done:stop])
    if args.bad_batch_at is not None:
        mine = spoiled(mine, args.bad_batch_at - trainer.steps_done, args.bad_batch)
    for _ in trainer.run(mine):
        if trainer.steps_done == args.save_at and job.is_worker:
            for path in args.save:
                trainer.save(path)
    if args.save_at is None and job.is_worker:
        for path in args.save:
            trainer.save(path)
    final_state = trainer.finish(save_to=args.finish_to, gather_tables_up_to=args.gather_up_to)
    if job.is_driver and args.out:
        views = {key: value for key, value in final_state.items()
                 if isinstance(value, ShardedTable)}
        torch.save({"state": {**final_state, **{key: view.load() for key, view in views.items()}},
                    "views": sorted(views), "probed": {key: view[PROBE_IDS]
                                                       for key, view in views.items()},
                    "counters": trainer.cache_counters, "device": str(job.device)}, args.out)
    return 0


def spoiled(batches, at: int, kind: str):
    """`batches` with the one at index `at` bad (see the module docstring)."""
    for index, batch in enumerate(batches):
        if index == at:
            if kind == "raises":
                raise ValueError(f"the data of batch {index} cannot be read")
            if kind == "type":
                batch = "not a batch"
            else:
                dense, ids, *rest = batch
                ids = ids.clone()
                ids[0, 0] = 10 ** 6  # past the table's rows
                batch = (dense, ids, *rest)
        yield batch


if __name__ == "__main__":
    sys.exit(main())
