"""Micro-batched general mode through the real launcher: the step cut into M
micro-batches that flow through the stages on a schedule (GPipe, 1F1B,
interleaved), each stage its own process, equal to the unsplit step.
(Threaded, every schedule and refusal: tests/splitter/test_pipeline_schedules.py.)

Tolerance: the micro-batched step sums each gradient over micro-batches (and
scales a mean loss's by 1/M) where the unsplit step sums over the whole batch
at once, so the float rounding differs: losses and parameters are compared
with `torch.testing.assert_close` at rtol = atol = 1e-5 (float32).
"""

import pytest
import torch
from cluster import SCRIPTS, assert_clean_output
from train_job import build

TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


def feeds_of(data):
    return lambda step: {"batch.0": data[step][0], "batch.1": data[step][1]}


@pytest.mark.parametrize("num_workers, schedule, model", [(2, "1f1b", "stages"),
                                                          (3, "gpipe", "stages"),
                                                          (2, "interleaved", "chunks")])
def test_launched_microbatched_job_equals_the_unsplit_step(local_cluster, tmp_path,
                                                          num_workers, schedule, model):
    out = tmp_path / "result.pt"
    steps = 8
    proc = local_cluster.run(SCRIPTS / "train_job.py", "--model", model, "--optimizer", "adam",
                             "--steps", steps,
                             "--microbatches", 4, "--schedule", schedule, "--out", out,
                             workers=num_workers)
    assert f"all {num_workers} processes finished" in proc.output()
    assert_clean_output(proc)
    program, data = build(model, "adam", num_workers, steps)
    history, state = program.train_unsplit(steps, feeds_of(data))
    result = torch.load(out)
    torch.testing.assert_close(result["losses"], torch.stack([h["loss"] for h in history]),
                               **TOLERANCE)
    assert result["state"].keys() == state.keys()
    for key, value in state.items():
        torch.testing.assert_close(result["state"][key], value, **TOLERANCE, msg=key)
    first = next(iter(program.grads))
    assert not torch.equal(state[first], program.initial_state[first])
