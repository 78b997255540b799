"""A wrong advertise address is found when the process joins: the scheduler
dials the address back and refuses that process, naming it and the address;
the job goes on waiting for a process it can reach."""

from __future__ import annotations

from cluster import JOB_TIMEOUT_S, SCRIPTS

TRAIN_JOB = SCRIPTS / "train_job.py"


def test_a_wrong_advertise_address_is_refused_at_join_and_the_job_waits(local_cluster,
                                                                       tmp_path):
    scheduler, address, token = local_cluster.scheduler(workers=1)
    # The tensor server binds 127.0.0.1 but tells its peers 127.0.0.2.
    joined = local_cluster.start("join", "--scheduler", address, "--token-file", token,
                                 "--advertise", "127.0.0.2", TRAIN_JOB, "--steps", 3,
                                 "--out", tmp_path / "never.pt")
    assert joined.wait(JOB_TIMEOUT_S) != 0
    output = joined.output()
    assert "worker 0 (pid" in output and "advertises 127.0.0.2:" in output, output
    assert "scheduler cannot connect" in output and "--advertise" in output
    # Only that process was refused: the same join, fixed, runs the job.
    fixed = local_cluster.start("join", "--scheduler", address, "--token-file", token,
                                TRAIN_JOB, "--steps", 3, "--out", tmp_path / "done.pt")
    assert fixed.wait(JOB_TIMEOUT_S) == 0, fixed.output()
    assert scheduler.wait(60) == 0, scheduler.output()
    assert (tmp_path / "done.pt").exists()
