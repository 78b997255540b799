"""A parameter-server job for the end-to-end tests, run by the real launcher.

    PYTHONPATH=tests/support splitrun launch --workers 2 --servers 2 \
        tests/support/scripts/ps_job.py --steps 20 --out r.pt

Worker 0 saves the final state gathered from every process to --out. With
--stop-after N it trains only up to step N (and --save writes a checkpoint
there); --save-at N writes the checkpoint after step N instead and trains on
(each --save one: a .pt file, or else a sharded directory); --resume
continues from a checkpoint. --staleness S runs
ParameterServerMode(staleness=S); --slow-worker R makes worker R take
--slow-step-s longer over each step (a deliberately slow worker), and
--versions-out DIR has every worker write, per step, the parameter version
it read (DIR/worker<R>.json) and, per step, the version of each state key it
read and its loss (DIR/worker<R>-read.json).
"""

from __future__ import annotations

import argparse
import itertools
import json
import pathlib
import sys
import time

import torch
from ps_models import keys_read, make

from splitrun.runtime.job import Job
from splitrun.splitter import ParameterServerMode


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kind", default="dense", choices=["dense", "sparse", "indexed"])
    parser.add_argument("--dense", choices=["server", "worker"], default="server")
    parser.add_argument("--optimizer", default="adam")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--stop-after", type=int)
    parser.add_argument("--width", type=int, default=24)
    parser.add_argument("--save", action="append", default=[])
    parser.add_argument("--save-at", type=int)
    parser.add_argument("--resume")
    parser.add_argument("--out")
    parser.add_argument("--gradient-bucket-bytes", type=int)
    parser.add_argument("--staleness", type=int, default=0)
    parser.add_argument("--slow-worker", type=int)
    parser.add_argument("--slow-step-s", type=float, default=0.05)
    parser.add_argument("--versions-out")
    args = parser.parse_args()

    job = Job.from_env()
    program, batches = make(args.kind, args.optimizer, job.cluster.num_workers, args.steps,
                            width=args.width, lazy=True)
    mode = ParameterServerMode(gradient_bucket_bytes=args.gradient_bucket_bytes,
                               staleness=args.staleness, dense=args.dense)
    trainer = job.start(program, mode, num_steps=args.steps, resume=args.resume)
    stop = args.stop_after or args.steps
    slow = job.is_worker and job.rank == args.slow_worker
    losses = []
    for batch in trainer.shard(itertools.islice(batches, trainer.steps_done, stop)):
        if slow:
            time.sleep(args.slow_step_s)  # the slowness under test, not a synchronisation
        loss = trainer.step(batch).get("loss")
        losses.append(None if loss is None else loss.item())
        if trainer.steps_done == args.save_at and job.is_worker:
            for path in args.save:
                trainer.save(path)
    if args.versions_out and job.is_worker:
        versions = trainer.stats.versions_read
        path = pathlib.Path(args.versions_out) / f"worker{job.rank}.json"
        path.write_text(json.dumps({str(step): v for step, v in sorted(versions.items())}))
        read = keys_read(trainer.plan, job.label, trainer.stats.channel_versions_read)
        (path.parent / f"worker{job.rank}-read.json").write_text(json.dumps(
            {"keys": {str(step): keys for step, keys in sorted(read.items())},
             "losses": losses}))
    if args.save_at is None and job.is_worker:
        for path in args.save:
            trainer.save(path)
    final_state = trainer.finish()
    if job.is_driver and args.out:
        torch.save({"state": final_state, "steps": trainer.steps_done,
                    "device": str(job.device)}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
