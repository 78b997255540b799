"""End to end through the real launcher on 127.0.0.1: real processes, real
gRPC. Results equal the unsplit run (torch.equal: the same ops on the same
values; each process runs them in the same order)."""

import os
import signal

import pytest
import torch
from cluster import JOB_TIMEOUT_S, REPO, SCRIPTS, assert_clean_output, pid_alive
from train_job import build

from splitrun.launcher import cli

TRAIN_JOB = SCRIPTS / "train_job.py"
# The launcher must notice a dead process and stop the rest within this long.
FAULT_DEADLINE_S = 15.0


def unsplit_reference(model, optimizer, num_workers, steps, hidden=32):
    program, batches = build(model, optimizer, num_workers, steps, hidden)
    history, state = program.train_unsplit(
        steps, lambda s: {"batch.0": batches[s][0], "batch.1": batches[s][1]})
    return torch.stack([h["loss"] for h in history]), state


def assert_same_as_unsplit(result_path, model, optimizer, num_workers, steps):
    result = torch.load(result_path)
    losses, state = unsplit_reference(model, optimizer, num_workers, steps)
    assert torch.equal(result["losses"], losses)
    assert result["state"].keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(result["state"][key], value), f"{key} differs from the unsplit run"


@pytest.mark.parametrize("num_workers, model, optimizer", [
    (2, "mlp", "sgd"),
    (3, "mlp", "adagrad"),
    (3, "lm", "adam"),
])
def test_launched_split_equals_unsplit(local_cluster, tmp_path, num_workers, model,
                                       optimizer):
    out = tmp_path / "result.pt"
    steps = 12
    proc = local_cluster.run(TRAIN_JOB, "--model", model, "--optimizer", optimizer,
                             "--steps", steps, "--out", out, workers=num_workers)
    assert f"all {num_workers} processes finished" in proc.output()
    assert_clean_output(proc)
    for rank in range(num_workers):
        assert f"[worker {rank}]" in proc.output()
    assert_same_as_unsplit(out, model, optimizer, num_workers, steps)


def test_killed_process_stops_the_job_and_leaves_no_child(local_cluster, tmp_path):
    proc = local_cluster.launch(TRAIN_JOB, "--steps", 200000, "--out", tmp_path / "never.pt",
                                workers=3)
    pids = {}
    for rank in range(3):
        match = proc.wait_for(rf"started worker {rank} \(pid (\d+)\)", 60)
        pids[rank] = int(match.group(1))
    proc.wait_for(r"\[worker 1\].*training started", JOB_TIMEOUT_S)
    proc.wait_for(r"\[worker 0\].*step \d+/200000", JOB_TIMEOUT_S)
    os.kill(pids[1], signal.SIGKILL)
    code = proc.wait(FAULT_DEADLINE_S)  # fails the test if the launcher is still running
    assert code != 0
    assert "worker 1 (pid" in proc.output() and "killed by SIGKILL" in proc.output()
    for rank, pid in pids.items():
        assert not pid_alive(pid), f"worker {rank} (pid {pid}) outlived the launcher"


def test_join_runs_a_job_without_the_launcher(local_cluster, tmp_path):
    """Joined processes on one host share memory under the scheduler's prefix
    (tests/e2e/test_shm_e2e.py has the same after SIGKILLs)."""
    from test_shm_e2e import job_files, job_prefix

    out = tmp_path / "result.pt"
    scheduler, address, token = local_cluster.scheduler(workers=2)
    workers = [local_cluster.join(address, token, TRAIN_JOB, "--steps", 10, "--out", out,
                                  rank=rank)
               for rank in range(2)]
    for worker in workers:
        assert worker.wait(JOB_TIMEOUT_S) == 0, worker.output()
        assert_clean_output(worker)
    assert scheduler.wait(30) == 0, scheduler.output()
    assert "every process is done" in scheduler.output()
    assert_same_as_unsplit(out, "mlp", "adam", 2, 10)
    prefix = job_prefix(workers[0])
    assert job_prefix(workers[1]) == prefix, "both use the scheduler's prefix"
    assert "transport to worker 1: shm " in workers[0].output(), workers[0].output()
    assert "transport to worker 0: shm " in workers[1].output(), workers[1].output()
    assert job_files(prefix) == [], "the job's shared-memory files outlived it"


def test_plan_mismatch_is_refused_at_join(local_cluster):
    scheduler, address, token = local_cluster.scheduler(workers=2)
    workers = [local_cluster.join(address, token, TRAIN_JOB, "--hidden", hidden, "--steps", 5,
                                  rank=rank)
               for rank, hidden in ((0, 32), (1, 48))]  # a different model on worker 1
    codes = [w.wait(JOB_TIMEOUT_S) for w in workers]
    assert scheduler.wait(30) == 1
    assert codes != [0, 0]
    text = "\n".join(w.output() for w in workers) + scheduler.output()
    assert "plan mismatch" in text and "same script" in text


def test_plan_command_writes_the_plan(local_cluster, tmp_path):
    # Both forms from one run of the script, each by its suffix.
    out, dot = tmp_path / "plan.txt", tmp_path / "plan.dot"
    proc = local_cluster.start("plan", "--workers", 3, "--out", out, "--out", dot, TRAIN_JOB)
    assert proc.wait(120) == 0, proc.output()
    text = out.read_text()
    assert text.startswith("splitrun-plan 1") and "process w2" in text
    assert dot.read_text().startswith("digraph") and "w2" in dot.read_text()
    assert f"plan written to {out}, {dot}" in proc.output()
    assert proc.output().count("started worker 0") == 1, "one run of the script"


def test_plan_refuses_an_unknown_suffix_before_running_the_script(tmp_path, capsys):
    script = tmp_path / "never_run.py"
    script.write_text("import pathlib\npathlib.Path(__file__).with_name('ran').touch()\n")
    png = tmp_path / "plan.png"
    assert cli.main(["plan", "--out", str(tmp_path / "plan.txt"), "--out", str(png),
                     str(script)]) == 2
    err = capsys.readouterr().err
    assert f"cannot write the plan to {png}: its suffix '.png'" in err, err
    assert "use .dot or .gv (DOT), .svg (a picture, needs graphviz) or .txt" in err, err
    assert not (tmp_path / "ran").exists() and not (tmp_path / "plan.txt").exists()


def test_launch_help_shows_the_defaults_and_how_to_use_ray(capsys):
    with pytest.raises(SystemExit):
        cli.main(["launch", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for shown in ("number of worker processes (default 1)",
                  "number of server processes (default 0)",
                  "counts as stalled (default 20)", "counts as lost (default 3;",
                  "splitrun launch --backend ray --workers 2 --servers 1 examples/ps_train.py",
                  "or Ray actors on a Ray cluster with --backend ray", "-v, --verbose"):
        assert shown in text, shown


def test_help_has_an_example(capsys):
    # The command's own parser, in this process (`python -m splitrun ... --help` as
    # a process is tests/launcher/test_cli_options.py's).
    for command in ("launch", "plan", "join", "scheduler"):
        with pytest.raises(SystemExit) as exited:
            cli.main([command, "--help"])
        assert exited.value.code == 0
        assert "example" in capsys.readouterr().out, command


def test_by_default_the_main_job_shows_progress_results_and_warnings_only(local_cluster):
    # The main job without -v: no INFO line of any process or the launcher,
    # no lifecycle line; the driver's progress, what the script prints and the
    # launcher's last line.
    proc = local_cluster.start("launch", "--workers", 2, "--servers", 1,
                               REPO / "examples" / "ps_train.py", "--epochs", 1, verbose=False)
    assert proc.wait(JOB_TIMEOUT_S) == 0, proc.output()
    lines = proc.lines
    assert not [line for line in lines if " INFO " in line or "INFO splitrun" in line], \
        proc.output()
    assert not [line for line in lines if line.startswith("[splitrun] started ")]
    assert any(line.startswith("[worker 0] step ") and "loss" in line for line in lines)
    assert any(line.startswith("[worker 0] held-out accuracy: ") for line in lines)
    assert lines[-1].startswith("[splitrun] all 3 processes finished in "), proc.output()
    assert len(lines) < 12, proc.output()
