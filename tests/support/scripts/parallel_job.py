"""A tensor-parallel training job for the end-to-end tests, run by the real launcher.

    splitrun launch --workers 2 tests/support/scripts/parallel_job.py --steps 10 --out result.pt
    splitrun launch --workers 4 tests/support/scripts/parallel_job.py --steps 5 --save ckpt.pt
    splitrun launch --workers 4 tests/support/scripts/parallel_job.py --steps 5 --save ckpt.pt \
        --save ckpt
    splitrun launch --workers 2 tests/support/scripts/parallel_job.py --steps 10 --resume ckpt.pt
    splitrun launch --workers 2 tests/support/scripts/parallel_job.py \
        --backend torch_distributed ...

The column- then row-parallel MLP of the parallel-mode tests. Worker 0 saves
the losses, the final state (collected: full tensors) and its send counters to
--out; --save writes a checkpoint after the last step (each --save one: a .pt
file, or else a sharded directory); --resume continues one (at any group size).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from parallel_models import capture_mlp, mlp_batches  # noqa: E402

from splitrun.splitter import ParallelMode  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--optimizer", default="adam")
    parser.add_argument("--out", type=pathlib.Path)
    parser.add_argument("--save", type=pathlib.Path, action="append", default=[])
    parser.add_argument("--resume", type=pathlib.Path)
    parser.add_argument("--backend", default="channels")
    args = parser.parse_args()

    from splitrun.runtime.job import Job
    job = Job.from_env()
    program = capture_mlp(args.optimizer)
    batches = mlp_batches(args.steps)
    trainer = job.start(program, ParallelMode(backend=args.backend), num_steps=args.steps,
                        resume=args.resume)
    losses = []
    for step in range(trainer.steps_done, args.steps):
        outputs = trainer.step(batches(step))
        if "loss" in outputs:
            losses.append(outputs["loss"])
    for path in args.save:
        trainer.save(path)
    sent = trainer.stats.bytes_sent
    predicted = trainer.split.artifacts.bytes_per_step
    collectives = trainer.process.collective_stats
    calls = 0 if collectives is None else collectives.calls
    final_state = trainer.finish()
    if job.is_driver and args.out:
        torch.save({"losses": torch.stack(losses) if losses else torch.zeros(0),
                    "state": final_state, "sent": sent, "predicted": predicted,
                    "collective_calls": calls, "device": str(job.device)}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
