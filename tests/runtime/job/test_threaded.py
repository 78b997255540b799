"""`run_threaded` takes what `split_program` returns, and asks for batches in
the order a launched job's loop does: once per step, in order, the step's
learning rate read right after its batch (a schedule stepped in the batch
callback applies from that step on, not one step early)."""

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from splitrun.runtime import run_threaded
from splitrun.splitter import (
    Cluster,
    Label,
    ParameterServerMode,
    SplitrunError,
    capture,
    place,
    split,
    split_program,
)

NUM_STEPS = 5


def scheduled_program():
    """A parameter-server step whose torch.optim learning rate a schedule halves."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    place(model, role="server")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.4)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 0.5 ** epoch)
    data = [(torch.randn(8, 6, generator=torch.Generator().manual_seed(s)),
             torch.randint(0, 3, (8,), generator=torch.Generator().manual_seed(s)))
            for s in range(NUM_STEPS)]
    program = capture(model, lambda m, x, y: F.cross_entropy(m(x), y), optimizer,
                      tuple(t[:4] for t in data[0]))
    calls: list[int] = []

    def batches(step):  # the schedule steps as each step's batch is made
        calls.append(step)
        if step > 0:
            schedule.step()
        return {"batch.0": data[step][0], "batch.1": data[step][1]}
    return program, batches, calls


def test_a_schedule_stepped_in_the_batch_callback_applies_from_that_step():
    program, batches, calls = scheduled_program()
    splitted = split_program(program, Cluster(num_workers=2, num_servers=1),
                             ParameterServerMode())
    run = run_threaded(splitted, NUM_STEPS, batches)
    assert calls == list(range(NUM_STEPS)), "once per step, in order, for both workers"
    # Plain torch, as the loop of a launched job runs it: make step s's batch
    # (the schedule steps), then train on it (the two workers' shards together).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.4)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 0.5 ** epoch)
    for step in range(NUM_STEPS):
        if step > 0:
            schedule.step()
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(step))
        y = torch.randint(0, 3, (8,), generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(run.state[key], value, rtol=0, atol=1e-6, msg=key)


def test_the_plan_alone_is_refused_naming_split_program():
    program, batches, _ = scheduled_program()
    plan = split(program, Cluster(num_workers=2, num_servers=1), ParameterServerMode())
    with pytest.raises(SplitrunError, match=r"^run_threaded needs what split_program\(program, "
                                            r"cluster, mode\) returns .*split\(\.\.\.\) gives "
                                            r"the plan alone$"):
        run_threaded(plan, NUM_STEPS, batches)


def test_threads_run_the_job_loop_servers_serve_until_the_workers_finish():
    """Each thread runs a launched process's loop: the server serves steps
    until the workers report their last (it is not told a step count), and
    every process's history and stats cover exactly the steps run."""
    program, batches, _ = scheduled_program()
    splitted = split_program(program, Cluster(num_workers=2, num_servers=1),
                             ParameterServerMode())
    run = run_threaded(splitted, 3, batches)
    assert len(run.history) == 3 and all("loss" in outputs for outputs in run.history)
    assert {label: stats.steps for label, stats in run.stats.items()} == {
        label: 3 for label in splitted.plan.labels}
    assert set(run.held) == set(splitted.plan.labels)
    assert set(run.held[Label.server(0)]) <= set(run.state), "the server's state is gathered"


def test_a_failing_worker_thread_stops_every_other_thread_and_is_raised():
    """A worker whose batch cannot be made fails outside a step: the others
    (the server waiting for its gradient, the other worker for the weights)
    are stopped at once, not after their receive timeouts, and the caller
    gets the worker's own error."""
    program, _, _ = scheduled_program()
    splitted = split_program(program, Cluster(num_workers=2, num_servers=1),
                             ParameterServerMode())
    data = {"batch.0": torch.randn(4, 6), "batch.1": torch.randint(0, 3, (4,))}

    def worker_batches(rank, step):
        if rank == 1 and step == 2:
            raise ValueError("worker 1 cannot read its third batch")
        return data

    started = time.monotonic()
    with pytest.raises(ValueError, match="worker 1 cannot read its third batch"):
        run_threaded(splitted, NUM_STEPS, worker_batches=worker_batches, recv_timeout_s=60)
    assert time.monotonic() - started < 30, "the other threads waited for their timeouts"
