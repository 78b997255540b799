"""A `splitrun join` too many, or mistyped, while a job runs: each is refused
with one line naming the rank and the fix, and the running job finishes
untouched (the same losses as the unsplit step). A real standalone scheduler,
real `splitrun join` processes, real gRPC on 127.0.0.1."""

from __future__ import annotations

import re

import grpc
import torch
from cluster import JOB_TIMEOUT_S, SCRIPTS
from train_job import build

from splitrun.runtime.rpc.service import TOKEN_METADATA_KEY
from splitrun.runtime.rpc.wire import splitrun_pb2 as pb
from splitrun.runtime.rpc.wire import splitrun_pb2_grpc as pb_grpc

FAULT_JOB = SCRIPTS / "fault_job.py"
STEPS, PAUSE_AT = 12, 6
# Bounds one refused `splitrun join` (start, import torch, register, exit).
REFUSED_JOIN_S = 120


def raw_register(address: str, token: str, role: str, rank: int, advertise: str):
    """One Register with the job's token, as any program could send it."""
    with grpc.insecure_channel(address) as channel:
        try:
            pb_grpc.SchedulerStub(channel).Register(
                pb.RegisterRequest(role=role, rank=rank, address=advertise, host="elsewhere",
                                   pid=1), timeout=60, metadata=((TOKEN_METADATA_KEY, token),))
        except grpc.RpcError as error:
            return error.code(), error.details()
    return grpc.StatusCode.OK, ""


def test_surplus_and_mistyped_joins_leave_a_running_job_untouched(local_cluster, tmp_path):
    scheduler, address, token_file = local_cluster.scheduler(workers=2)
    token = open(token_file).read().strip()
    # Before anyone joined: a Register advertising an address nobody listens on
    # (port 9 on 127.0.0.1: nothing there), a role that is not one, and ranks
    # out of range. None of them fails the job.
    code, details = raw_register(address, token, "worker", 1, "127.0.0.1:9")
    assert code is grpc.StatusCode.FAILED_PRECONDITION and "cannot connect" in details
    assert raw_register(address, token, "scheduler", 0, "127.0.0.1:9")[0] is \
        grpc.StatusCode.INVALID_ARGUMENT
    assert raw_register(address, token, "worker", -3, "127.0.0.1:9")[0] is \
        grpc.StatusCode.OUT_OF_RANGE

    pause = tmp_path / "go"
    args = ("--steps", STEPS, "--pause-at", PAUSE_AT, "--pause-file", pause)
    workers = [local_cluster.join(address, token_file, FAULT_JOB, *args, "--out",
                                  tmp_path / "out.pt", rank=0),
               local_cluster.join(address, token_file, FAULT_JOB, *args, rank=1)]
    workers[0].wait_for(rf"paused at step {PAUSE_AT}", JOB_TIMEOUT_S)

    # The job is running: a surplus join, a taken rank, a rank out of range.
    refusals = {
        "surplus": (local_cluster.join(address, token_file, FAULT_JOB, *args),
                    r"ALREADY_EXISTS: every worker rank is taken: this job has 2 workers "
                    r"\(ranks 0 to 1\), all registered; this process is one too many"),
        "taken": (local_cluster.join(address, token_file, FAULT_JOB, *args, rank=1),
                  r"ALREADY_EXISTS: worker 1 is already registered \(pid \d+ on \S+\)"),
        "out of range": (local_cluster.join(address, token_file, FAULT_JOB, *args, rank=5),
                         r"OUT_OF_RANGE: worker rank 5 is out of range: this job has 2 "
                         r"workers \(ranks 0 to 1\); ask for --rank 0 to 1"),
        "no servers": (local_cluster.join(address, token_file, FAULT_JOB, *args,
                                          role="server"),
                       r"OUT_OF_RANGE: server cannot join: this job has no servers; join as a "
                       r"worker \(--role worker\)"),
    }
    for what, (proc, pattern) in refusals.items():
        assert proc.wait(REFUSED_JOIN_S) != 0, what
        errors = [line for line in proc.output().splitlines() if line.startswith("splitrun error")]
        assert len(errors) == 1 and re.search(pattern, errors[0]), (what, proc.output())
        assert "Traceback" not in proc.output(), what
    assert raw_register(address, token, "worker", 0, "127.0.0.1:9")[0] is \
        grpc.StatusCode.ALREADY_EXISTS

    pause.touch()
    for worker in workers:
        assert worker.wait(JOB_TIMEOUT_S) == 0, worker.output()
    assert scheduler.wait(60) == 0, scheduler.output()
    assert "every process is done" in scheduler.output()
    # Untouched: worker 0's losses are the unsplit step's.
    program, batches = build("mlp", "adam", 2, 8)
    history, _ = program.train_unsplit(
        STEPS, lambda step: {"batch.0": batches[step % 8][0], "batch.1": batches[step % 8][1]})
    losses = torch.load(tmp_path / "out.pt")["losses"]
    torch.testing.assert_close(torch.stack(losses), torch.stack([h["loss"] for h in history]))
