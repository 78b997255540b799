"""`--log-dir` and `--metrics-dir` through the real launcher: one log file and
one TensorBoard event file per process, and the event file holds the loss curve;
a library that logs as it loads leaves a launched process's log lines alone.
(The metrics' own arithmetic and the log lines' setup:
tests/launcher/test_launcher_logs.py.)"""

from __future__ import annotations

import math

import pytest
from cluster import SCRIPTS
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from splitrun.runtime.job.metrics import channel_tag

# examples/ps_train.py, one epoch: 1437 training digits in global batches of 64.
NUM_STEPS = 1437 // 64
PROCESSES = ("worker0", "worker1", "server0")


def scalars(directory) -> EventAccumulator:
    events = EventAccumulator(str(directory))
    events.Reload()
    return events


def test_log_dir_and_metrics_dir_write_one_file_per_process(main_job_one_epoch):
    # The main job, one epoch, `splitrun --log-dir DIR launch --metrics-dir DIR`:
    # the global options before the subcommand and after it (conftest.py).
    logs, metrics = main_job_one_epoch.logs, main_job_one_epoch.metrics
    output = main_job_one_epoch.output

    assert sorted(p.name for p in logs.iterdir()) == sorted(
        [f"{name}.log" for name in PROCESSES] + ["launcher.log"])
    for name, label in zip(PROCESSES, ("worker 0", "worker 1", "server 0")):
        text = (logs / f"{name}.log").read_text()
        assert f"joined as {label} " in text, text  # its own lines, without the prefix
        assert not any(line.startswith(f"[{label}] ") for line in text.splitlines())
        assert f"[{label}] " in output  # the console keeps the prefixed lines
    assert "held-out accuracy" in (logs / "worker0.log").read_text()
    assert "held-out accuracy" not in (logs / "worker1.log").read_text()
    assert "all 3 processes finished" in (logs / "launcher.log").read_text()

    assert sorted(p.name for p in metrics.iterdir()) == sorted(PROCESSES)
    for name in PROCESSES:
        files = list((metrics / name).iterdir())
        assert len(files) == 1 and files[0].name.startswith("events.out.tfevents."), files

    worker = scalars(metrics / "worker0")
    losses = worker.Scalars("loss")
    assert [event.step for event in losses] == list(range(NUM_STEPS))
    assert all(math.isfinite(event.value) for event in losses)
    assert losses[-1].value < losses[0].value < 2.6  # ln(10) = 2.30 at the start
    assert len(worker.Scalars("steps_per_s")) == NUM_STEPS - 1
    # In parameter-server mode each worker has the loss of its own shard.
    assert len(scalars(metrics / "worker1").Scalars("loss")) == NUM_STEPS

    server = scalars(metrics / "server0")
    tags = server.Tags()["scalars"]
    received = [tag for tag in tags if tag.startswith("received_bytes/")]
    assert f"received_bytes/{channel_tag('w0->s0#0')}" in received, tags
    for tag in received:
        per_step = server.Scalars(tag)
        assert len(per_step) == NUM_STEPS and all(e.value > 0 for e in per_step), tag
    assert any(tag.startswith("recv_wait_s/") for tag in tags)
    assert any(tag.startswith("sent_bytes/") for tag in tags)


@pytest.mark.parametrize("template", ["standing", "own"])
def test_a_library_that_logs_as_it_loads_leaves_the_log_lines_alone(local_cluster, request,
                                                                     template):
    # fbgemm_gpu logs while it loads, which gives logging a default handler;
    # the template imports it before forking, and a process's bootstrap must
    # still configure its log lines and the driver's progress.
    if template == "own":
        request.getfixturevalue("own_template")
    proc = local_cluster.run(SCRIPTS / "loads_a_logging_library.py", "--steps", 3, workers=3)
    lines = proc.lines
    assert any("template (pid" in line and "imported" in line and "fbgemm_gpu" in line
               for line in lines), proc.output()
    assert any(line.startswith("[worker 2] INFO ") and "joined as worker 2 " in line
               for line in lines), proc.output()
    assert any(line.startswith("[worker 0] step 3/3 ") for line in lines), proc.output()
