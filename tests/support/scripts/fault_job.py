"""A long-running job for the fault tests, run by the real launcher: it trains a
small model over a few batches in a cycle, and can fail on purpose.

    splitrun launch --workers 2 tests/support/scripts/fault_job.py --crash-rank 1 --crash-at 5

--crash-rank R --crash-at N: worker R raises before its step N.
--busy-rank R --busy-at N: worker R spins forever before its step N (its
    heartbeat thread stays alive); with --busy-blocks it blocks forever there
    instead (a deadlock: to its peers and the scheduler the same stall, and
    no CPU spent).
--stuck-in-receive-rank R --stuck-in-receive-at N --release-file F: worker R
    gets stuck in user code while inside a receive of its step N (a signal
    handler that never returns, run by the receiving thread while it waits);
    the other workers wait before their step N until the handler created F, so
    worker R is inside that receive when the signal comes.
--kill-rank R --kill-at N: worker R SIGKILLs itself before its step N, unless
    the job was resumed (a restart under --max-restarts).
--pause-at N --pause-file F: every worker waits (up to 120 s) before its step N
    until file F exists (between steps: no peer waits on another meanwhile).
--slow-start NAME --slow-start-s S: process NAME ("server 0") takes S seconds
    longer to set up (as a large model's capture or a checkpoint's load would).
--bad-optimizer: capture with an optimizer splitrun cannot split (a CaptureError).
--raise-after-finish: worker 0 raises its own error after trainer.finish().
--mode ps: parameter-server mode (run with --servers 1 or more).
--out PATH: worker 0 saves the losses and the final state there.

The batch of step s is batch s % 8, so a resumed run sees the batches an
uninterrupted one sees.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time

import torch

from splitrun.runtime.job import Job

NUM_BATCHES = 8


def wait_for_file(path: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s} s")
        time.sleep(0.05)


def get_stuck_in_the_next_receive(trainer, step: int, release_file: str) -> None:
    """Once this process waits in a receive (its peers wait for `release_file`
    first, so it does), its main thread gets a signal whose handler releases
    the peers and never returns: stuck in user code inside the receive."""
    def handler(signum, frame):
        logging.getLogger("fault_job").warning("stuck inside a receive at step %d", step)
        with open(release_file, "w"):
            pass
        threading.Event().wait()  # never set

    def signal_once_waiting():
        deadline = time.monotonic() + 120.0
        while trainer.process.executor.waiting_on is None:
            if time.monotonic() > deadline:
                return
            time.sleep(0.005)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)

    signal.signal(signal.SIGUSR1, handler)
    threading.Thread(target=signal_once_waiting, daemon=True).start()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", default="general", choices=["general", "ps"])
    parser.add_argument("--steps", type=int, default=100000)
    parser.add_argument("--crash-rank", type=int, default=-1)
    parser.add_argument("--crash-at", type=int, default=-1)
    parser.add_argument("--busy-rank", type=int, default=-1)
    parser.add_argument("--busy-at", type=int, default=-1)
    parser.add_argument("--busy-blocks", action="store_true")
    parser.add_argument("--stuck-in-receive-rank", type=int, default=-1)
    parser.add_argument("--stuck-in-receive-at", type=int, default=-1)
    parser.add_argument("--release-file")
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--pause-at", type=int, default=-1)
    parser.add_argument("--pause-file")
    parser.add_argument("--slow-start", default="")
    parser.add_argument("--slow-start-s", type=float, default=0.0)
    parser.add_argument("--bad-optimizer", action="store_true")
    parser.add_argument("--raise-after-finish", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()

    job = Job.from_env()
    # Joined first, then the model code: a refused join (tests/e2e/test_register_e2e.py
    # has four) exits without importing the splitter (~1 CPU-s each).
    from ps_models import make
    from train_job import build

    from splitrun.splitter import ParameterServerMode, capture

    if args.mode == "ps":
        program, batches = make("dense", "adam", job.cluster.num_workers, NUM_BATCHES)
        mode = ParameterServerMode()
    else:
        program, batches = build("mlp", "adam", job.cluster.num_workers, NUM_BATCHES)
        mode = None
    if args.bad_optimizer:
        model = torch.nn.Linear(12, 5)
        capture(model, lambda m, x, y: m(x).sum(), torch.optim.LBFGS(model.parameters()),
                batches[0])
    if job.label.describe() == args.slow_start:
        logging.getLogger("fault_job").warning("setting up slowly")
        time.sleep(args.slow_start_s)
    trainer = job.start(program, mode, num_steps=args.steps)
    logging.getLogger("fault_job").warning("training started")
    shards = list(trainer.shard(batches))
    resumed = trainer.steps_done > 0
    losses = []
    if job.is_worker:
        for step in range(trainer.steps_done, args.steps):
            if job.rank == args.kill_rank and step == args.kill_at and not resumed:
                os.kill(os.getpid(), signal.SIGKILL)
            if step == args.pause_at:
                logging.getLogger("fault_job").warning("paused at step %d", step)
                wait_for_file(args.pause_file, 120.0)
            if job.rank == args.crash_rank and step == args.crash_at:
                raise ValueError(f"injected failure at step {step}")
            if step == args.stuck_in_receive_at:
                if job.rank == args.stuck_in_receive_rank:
                    get_stuck_in_the_next_receive(trainer, step, args.release_file)
                else:
                    wait_for_file(args.release_file, 120.0)
            if job.rank == args.busy_rank and step == args.busy_at:
                if args.busy_blocks:
                    logging.getLogger("fault_job").warning("blocked at step %d", step)
                    threading.Event().wait()  # never set
                logging.getLogger("fault_job").warning("spinning at step %d", step)
                while True:
                    pass
            outputs = trainer.step(shards[step % len(shards)])
            if "loss" in outputs:
                losses.append(outputs["loss"])
    final_state = trainer.finish()
    if job.is_driver and args.raise_after_finish:
        raise ValueError("the script's own error, after finish")
    if job.is_driver and args.out:
        torch.save({"losses": losses, "first_step": 0 if not resumed else args.steps - len(losses),
                    "state": final_state}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
