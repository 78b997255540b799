"""Dense parameters on the workers (`dense="worker"`), only embedding rows on
the servers: parameter-server and embedding-cache modes.

One worker: the step equals the unsplit step bit for bit (the dense update
runs on the worker, the cached tables as before). Two workers at staleness 0:
equal, bit for bit, to the same job with the dense parameters on the servers
(the workers' all-reduce sums two gradients as a server's mean does), and
within rounding of the unsplit step over the global batch (two half-batch
means are not one mean: 3.3e-6 apart after 10 steps at learning rate 0.3). Nothing but rows and
row gradients reaches a server.
"""

import pytest
import torch
from cache_models import feeds, make_sum_bags

from splitrun.runtime import run_threaded
from splitrun.splitter import (
    Cluster,
    EmbeddingCacheMode,
    ParameterServerMode,
    PlanError,
    split_program,
)
from splitrun.splitter.labels import Role
from splitrun.splitter.ops.worker_all_reduce import all_reduce_mean

NUM_STEPS = 10


def _run(optimizer, num_workers, dense, *, steps=NUM_STEPS):
    program, batches = make_sum_bags(optimizer, num_workers, steps, cache_rows=48,
                                     dense_on_servers=dense == "server")
    split = split_program(program, Cluster(num_workers, 2), EmbeddingCacheMode(dense=dense))
    split.lint()
    return split, run_threaded(split, steps, feeds(batches), recv_timeout_s=30), batches


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_one_worker_equals_the_unsplit_step(optimizer):
    split, run, batches = _run(optimizer, 1, "worker")
    assert not any(n.target is all_reduce_mean for n in split.program.graph.nodes)
    for proc in split.plan.processes:
        if proc.label.role is Role.SERVER:
            assert not proc.state and proc.is_idle, "a server holds dense state"
    whole, _ = make_sum_bags(optimizer, 1, NUM_STEPS, cache_rows=None, dense_on_servers=False)
    expected = whole.train_unsplit(NUM_STEPS, feeds(batches))[1]
    assert run.state.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(run.state[key], value), f"{key} differs"


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "sgd_chain", "adagrad_chain"])
def test_two_workers_equal_dense_on_servers(optimizer):
    split, run, batches = _run(optimizer, 2, "worker")
    if not optimizer.endswith("_chain"):
        # Both workers run the same replicated updates: one call each, the same node.
        calls = {str(proc.label): [i.target for i in proc.schedule
                                   if i.target.startswith("foreach_update")]
                 for proc in split.plan.processes if proc.label.role is Role.WORKER}
        assert len(set(map(tuple, calls.values()))) == 1, calls
        assert all(len(names) == 1 for names in calls.values()), calls
    assert sum(n.target is all_reduce_mean for n in split.program.graph.nodes) == 1
    for channel in split.plan.channels:
        assert Role.SERVER not in (channel.src.role, channel.dst.role), (
            f"{channel.name}: dense values reach a server")
    _, on_servers, _ = _run(optimizer, 2, "server")
    assert run.state.keys() == on_servers.state.keys()
    for key, value in on_servers.state.items():
        assert torch.equal(run.state[key], value), f"{key} differs"
    whole, _ = make_sum_bags(optimizer, 1, NUM_STEPS, cache_rows=None, dense_on_servers=False)
    expected = whole.train_unsplit(NUM_STEPS, feeds(batches))[1]
    for key, value in expected.items():
        torch.testing.assert_close(run.state[key], value, rtol=0, atol=1e-5)


def test_parameter_server_mode_keeps_only_sparse_tables_on_servers():
    program, _ = make_sum_bags("sgd", 2, 1, cache_rows=None)
    split = split_program(program, Cluster(2, 1), ParameterServerMode(dense="worker"))
    (server,) = [p for p in split.plan.processes if p.label.role is Role.SERVER]
    assert set(server.state) == {f"tables.{i}.weight" for i in range(3)}


def test_bad_dense_placements_are_refused():
    with pytest.raises(PlanError, match="dense='servers'.*'server'.*'worker'"):
        EmbeddingCacheMode(dense="servers")
    with pytest.raises(PlanError, match="gradient_bucket_bytes.*dense='worker'"):
        ParameterServerMode(dense="worker", gradient_bucket_bytes=1 << 20)
