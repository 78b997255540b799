"""Shared memory between the processes of a job on one host, through the real
launcher: every peer pair chooses it (and `SPLITRUN_TRANSPORT=grpc` none), the
result equals the gRPC run bit for bit, and nothing of the job is left under
/dev/shm (nor any process) after a normal end or a SIGKILLed worker, server or
launcher. Processes started by `splitrun join` (no launcher) share memory under
the scheduler's prefix, with the same guarantees.
"""

import os
import re
import signal
import time

import pytest
import torch
from cluster import JOB_TIMEOUT_S, SCRIPTS, assert_clean_output, pid_alive, wait_exited

from splitrun.runtime.transport.shm.ring import SHM_DIR

PS_JOB = SCRIPTS / "ps_job.py"
FAULT_JOB = SCRIPTS / "fault_job.py"
FAULT_DEADLINE_S = 15.0
WORKERS, SERVERS = 2, 2
NAMES = ([f"worker {r}" for r in range(WORKERS)] + [f"server {r}" for r in range(SERVERS)])


def job_prefix(proc) -> str:
    return proc.wait_for(r"share memory under /dev/shm/(splitrun-[0-9a-f]+-)\*", 60).group(1)


def job_files(prefix: str) -> list[str]:
    return sorted(name for name in os.listdir(SHM_DIR) if name.startswith(prefix))


def chosen(output: str) -> dict[tuple[str, str], str]:
    """(process, peer) -> the transport it logged for that pair."""
    return {(a, b): kind for a, b, kind in
            re.findall(r"\[([a-z]+ \d+)\] transport to ([a-z]+ \d+): (\w+) ", output)}


def lent_in_place(output: str) -> int:
    """Messages the job's processes took without a copy, viewing their ring."""
    return sum(int(n) for n in re.findall(r"shared memory: received \d+ messages, (\d+) of "
                                          r"them lent in place", output))


def run(local_cluster, tmp_path, name, env_extra=None, job_args=()):
    out = tmp_path / f"{name}.pt"
    # Wide enough that each server's parameters (over 1 MiB) are lent in place.
    proc = local_cluster.start("launch", "--workers", WORKERS, "--servers", SERVERS, PS_JOB,
                               "--steps", 8, "--width", 640, "--out", out, *job_args,
                               env_extra=env_extra)
    prefix = job_prefix(proc)
    assert proc.wait(JOB_TIMEOUT_S) == 0, proc.output()
    assert_clean_output(proc)
    assert job_files(prefix) == [], "the job's shared-memory files outlived it"
    result = torch.load(out)
    result["joined"] = re.findall(r"joined as .*", proc.output())
    return result, chosen(proc.output()), lent_in_place(proc.output())


def differences(run: dict, reference: dict) -> str:
    """Each state entry of `run` not bit-identical to `reference`'s, with its
    largest difference, and how each run's processes computed (a failure
    report that says where to look)."""
    differ = {key: (run["state"][key] - value).abs().max().item()
              for key, value in reference["state"].items()
              if not torch.equal(run["state"][key], value)}
    return (f"{len(differ)} of {len(reference['state'])} entries differ (largest "
            f"difference each): {differ}\nthis run's processes: {run['joined']}\n"
            f"the reference's: {reference['joined']}")


def test_a_same_host_job_uses_shared_memory_and_equals_the_grpc_run(local_cluster, tmp_path):
    shm, shm_pairs, shm_lent = run(local_cluster, tmp_path, "shm")
    grpc, grpc_pairs, grpc_lent = run(local_cluster, tmp_path, "grpc",
                                      {"SPLITRUN_TRANSPORT": "grpc"})
    every_pair = {(a, b) for a in NAMES for b in NAMES if a != b}
    assert shm_pairs == {pair: "shm" for pair in every_pair}
    assert grpc_pairs == {pair: "grpc" for pair in every_pair}
    # The large parameter messages were viewed in the rings, not copied, and
    # the result is still the gRPC run's, bit for bit.
    assert shm_lent > 0 and grpc_lent == 0
    # Gradients in buckets (several messages a step from each worker, servers
    # updating in between): the 1.6 MB gradient's bucket is no longer the last
    # message of its step, and is still lent (the ring keeps room for the rest).
    buckets, _, buckets_lent = run(local_cluster, tmp_path, "buckets",
                                   job_args=("--gradient-bucket-bytes", 1 << 20))
    assert buckets_lent == shm_lent
    assert shm["steps"] == grpc["steps"] == 8
    assert shm["state"].keys() == grpc["state"].keys() == buckets["state"].keys()
    assert all(torch.equal(shm["state"][k], v) for k, v in grpc["state"].items()), (
        f"the shared-memory run differs from the gRPC run: {differences(shm, grpc)}")
    assert all(torch.equal(buckets["state"][k], v) for k, v in grpc["state"].items()), (
        f"the run with buckets differs from the gRPC run: {differences(buckets, grpc)}")


@pytest.mark.parametrize("victim", ["worker 1", "server 0"])
def test_a_sigkilled_process_leaves_no_segment_and_no_process(local_cluster, victim):
    proc = local_cluster.launch(PS_JOB, "--steps", 200000, workers=2, servers=1)
    try:
        prefix = job_prefix(proc)
        pids = {name: int(proc.wait_for(rf"started {name} \(pid (\d+)\)", 60).group(1))
                for name in ("worker 0", "worker 1", "server 0")}
        proc.wait_for(r"\[worker 0\].*step \d+/200000", JOB_TIMEOUT_S)
        assert set(chosen(proc.output()).values()) == {"shm"}
        os.kill(pids[victim], signal.SIGKILL)
        killed_at = time.monotonic()
        code = proc.wait(FAULT_DEADLINE_S + 10)
        elapsed = time.monotonic() - killed_at
    finally:
        proc.kill()
    assert code != 0 and elapsed < FAULT_DEADLINE_S
    assert f"{victim} (pid {pids[victim]}) was killed by SIGKILL" in proc.output()
    for name, pid in pids.items():
        assert not pid_alive(pid), f"{name} (pid {pid}) outlived the launcher"
    assert job_files(prefix) == [], "the job's shared-memory files outlived it"


def test_a_sigkilled_launcher_leaves_no_segment_and_no_process(local_cluster):
    """The launcher (and with it the scheduler, which runs inside it) SIGKILLed
    mid-job: its children die with it, and the janitor it started removes the
    job's files from /dev/shm, then exits."""
    proc = local_cluster.launch(PS_JOB, "--steps", 200000, workers=2, servers=1)
    try:
        prefix = job_prefix(proc)
        janitor = int(proc.wait_for(r"janitor \(pid (\d+)\)", 60).group(1))
        pids = {name: int(proc.wait_for(rf"started {name} \(pid (\d+)\)", 60).group(1))
                for name in ("worker 0", "worker 1", "server 0")}
        proc.wait_for(r"\[worker 0\].*step \d+/200000", JOB_TIMEOUT_S)
        assert set(chosen(proc.output()).values()) == {"shm"}
        assert job_files(prefix), "a running job has its markers under /dev/shm"
        os.kill(proc.process.pid, signal.SIGKILL)
        proc.process.wait(timeout=10)
        gone = not wait_exited((*pids.values(), janitor), FAULT_DEADLINE_S)
        # Every process that removes files has exited: nothing is left to wait for.
        left = job_files(prefix)
    finally:
        proc.kill()
        for pid in (*pids.values(), janitor):
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert gone, {name: pid for name, pid in pids.items() if pid_alive(pid)}
    assert left == [], "the job's shared-memory files outlived the killed launcher"


@pytest.mark.parametrize("victim", ["worker 1", "scheduler"])
def test_a_sigkilled_joined_process_or_scheduler_leaves_no_segment(local_cluster, victim):
    """Without a launcher, the survivors (and the scheduler, if it survives)
    remove the job's files: a SIGKILLed process leaves at least its marker."""
    scheduler, address, token = local_cluster.scheduler(workers=2)
    workers = [local_cluster.join(address, token, FAULT_JOB, rank=rank) for rank in range(2)]
    try:
        prefix = job_prefix(workers[0])
        workers[0].wait_for(r"step \d+/100000", JOB_TIMEOUT_S)
        assert re.search(r"transport to worker 1: shm ", workers[0].output())
        assert job_files(prefix), "a running job has its markers under /dev/shm"
        pids = {"scheduler": scheduler.process.pid, "worker 0": workers[0].process.pid,
                "worker 1": workers[1].process.pid}
        os.kill(pids[victim], signal.SIGKILL)
        codes = [proc.wait(FAULT_DEADLINE_S + 20) for proc in (scheduler, *workers)]
        # Every process that removes files has exited: nothing is left to wait for.
        left = job_files(prefix)
    finally:
        for proc in (scheduler, *workers):
            proc.kill()
    assert all(code != 0 for code in codes), codes
    for name, pid in pids.items():
        assert not pid_alive(pid), f"{name} (pid {pid}) is still running"
    assert left == [], "the job's shared-memory files outlived it"
