"""Parameter-server mode end to end: real launcher, real processes, real gRPC.

Tolerance 1e-5 against one process on the global batch (the mean of the shard
gradients sums in another order); a resumed run equals the uninterrupted one
to 1e-6.
"""

import os
import signal

import pytest
import torch
from cluster import JOB_TIMEOUT_S, SCRIPTS, pid_alive
from ps_models import feeds, make

PS_JOB = SCRIPTS / "ps_job.py"
FAULT_DEADLINE_S = 15.0


@pytest.fixture
def launch(local_cluster, tmp_path):
    """Runs PS_JOB through the launcher; returns what worker 0 wrote to --out."""
    def launch(name, workers, servers, *args):
        out = tmp_path / f"{name}.pt"
        local_cluster.run(PS_JOB, *args, "--out", out, workers=workers, servers=servers)
        return torch.load(out)
    return launch


def single_process(kind, optimizer, steps):
    full, batches = make(kind, optimizer, 1, steps)
    return full.train_unsplit(steps, feeds(batches))[1]


@pytest.mark.parametrize("kind, optimizer", [("dense", "adam"), ("sparse", "adagrad")])
def test_two_workers_two_servers_equal_one_process(uninterrupted_ps_job, kind, optimizer):
    result = uninterrupted_ps_job(kind, optimizer, steps=20, workers=2, servers=2)
    expected = single_process(kind, optimizer, 20)
    assert result["steps"] == 20
    assert result["state"].keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(result["state"][key], value, rtol=0, atol=1e-5)


def test_checkpoint_resumes_with_another_number_of_servers(launch, uninterrupted_ps_job,
                                                           ps_saved_at_ten):
    # Saved after step 10 by the uninterrupted job (2 servers, launched once for
    # this test and the one above), which trained on to step 20.
    checkpoint, _ = ps_saved_at_ten
    saved = torch.load(checkpoint, weights_only=True)
    assert saved["step"] == 10 and "body.0.weight" in saved["model"]
    resumed = launch("resumed", 2, 1, "--steps", 20, "--resume", checkpoint)
    straight = uninterrupted_ps_job("dense", "adam", steps=20, workers=2, servers=2)
    assert resumed["steps"] == straight["steps"] == 20
    for key, value in straight["state"].items():
        torch.testing.assert_close(resumed["state"][key], value, rtol=0, atol=1e-6)


def test_killed_server_stops_the_job_naming_it(local_cluster):
    proc = local_cluster.launch(PS_JOB, "--steps", 200000, workers=2, servers=1)
    server_pid = int(proc.wait_for(r"started server 0 \(pid (\d+)\)", 60).group(1))
    worker_pids = [int(proc.wait_for(rf"started worker {r} \(pid (\d+)\)", 60).group(1))
                   for r in range(2)]
    proc.wait_for(r"\[worker 0\].*step \d+/200000", JOB_TIMEOUT_S)
    os.kill(server_pid, signal.SIGKILL)
    code = proc.wait(FAULT_DEADLINE_S)  # fails the test if the launcher is still running
    assert code != 0
    assert f"server 0 (pid {server_pid}) was killed by SIGKILL" in proc.output()
    for pid in (server_pid, *worker_pids):
        assert not pid_alive(pid)


def test_worker_with_another_model_is_refused_at_join(local_cluster):
    scheduler, address, token = local_cluster.scheduler(workers=1, servers=1)
    procs = [local_cluster.join(address, token, PS_JOB, "--steps", 5, "--width", width,
                                role=role)
             for role, width in (("server", 24), ("worker", 32))]
    codes = [p.wait(JOB_TIMEOUT_S) for p in procs]
    assert scheduler.wait(30) == 1
    assert codes != [0, 0]
    text = "\n".join(p.output() for p in procs) + scheduler.output()
    assert "plan mismatch" in text
