"""A learnable temperature (a 0-dim float32 parameter) trained across processes,
run by the real launcher (tests/support/scalar_models.py has the model):

    splitrun launch --workers 2 tests/support/scripts/scalar_job.py --optimizer adam --out r.pt
    splitrun launch --workers 2 --servers 1 tests/support/scripts/scalar_job.py --mode ps

In general mode the scalar lives on worker 1 and is read on worker 0; in
parameter-server mode it lives on the server. Worker 0 saves the final state
gathered from every process to --out.
"""

from __future__ import annotations

import argparse
import sys

import torch
from scalar_models import NUM_STEPS, OPTIMIZERS, make

from splitrun.runtime.job import Job
from splitrun.splitter import ParameterServerMode

# Where the scalar lives, and the batch each worker captures with, per mode.
OWNER = {"general": {"rank": 1}, "ps": {"role": "server"}}
SHARD = {"general": 8, "ps": 4}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", default="general", choices=sorted(OWNER))
    parser.add_argument("--optimizer", default="adam", choices=sorted(OPTIMIZERS))
    parser.add_argument("--out")
    args = parser.parse_args()

    job = Job.from_env()
    program, batches = make(OWNER[args.mode], args.optimizer, SHARD[args.mode])
    mode = ParameterServerMode() if args.mode == "ps" else None
    trainer = job.start(program, mode, num_steps=NUM_STEPS)
    for batch in trainer.shard(batches):
        trainer.step(batch)
    final_state = trainer.finish()
    if job.is_driver and args.out:
        torch.save({"state": final_state, "steps": trainer.steps_done}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
