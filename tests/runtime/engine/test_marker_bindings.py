"""Marker ops stand for what the runtime binds them to (a worker's row cache, a
process group). An executor whose process runs a marker it has no binding for
refuses to start, naming the process, the nodes and the markers; it does not
wait for the node's first run in the middle of a step."""

import inspect

import pytest
import torch
from cache_models import feeds, make_sum_bags

from splitrun.runtime import Executor, LoopbackHub, SplitrunError
from splitrun.splitter import Cluster, EmbeddingCacheMode, Label, split_program
from splitrun.splitter.ops import cache, collectives, worker_all_reduce
from splitrun.splitter.ops.markers import MARKERS

W0 = Label.worker(0)


@pytest.fixture(scope="module")
def cache_split():
    # Two workers with the dense parameters on the workers: each worker runs the
    # cache's markers and the workers' all-reduce.
    program, batches = make_sum_bags("sgd", 2, 1, cache_rows=48, dense_on_servers=False)
    split = split_program(program, Cluster(2, 2), EmbeddingCacheMode(dense="worker"))
    return split, batches


def _markers_run_by(split, label):
    nodes = {n.name: n for n in split.program.graph.nodes}
    return {nodes[i.target].target for i in split.plan.process(label).schedule
            if i.target in nodes and nodes[i.target].target in MARKERS}


def test_an_unbound_marker_is_refused_when_the_executor_starts(cache_split):
    split, _ = cache_split
    markers = _markers_run_by(split, W0)
    assert worker_all_reduce.all_reduce_mean in markers
    assert cache.cached_bags in markers
    hub = LoopbackHub(split.plan.labels)
    with pytest.raises(SplitrunError) as refused:
        Executor(split.plan, split.program, W0, hub.transport(W0))
    message = str(refused.value)
    assert message.startswith("[worker 0] ")
    reduce_node = next(n.name for n in split.program.graph.nodes
                       if n.target is worker_all_reduce.all_reduce_mean)
    assert f"{reduce_node} (all_reduce_mean, bound to a torch.distributed process group " \
           f"of all the workers" in message
    assert "(cached_bags, bound to a worker's embedding cache" in message
    assert "Job.start or run_threaded" in message


def test_with_every_marker_bound_the_executor_starts(cache_split):
    split, _ = cache_split
    hub = LoopbackHub(split.plan.labels)
    bindings = {marker: lambda *args, **kwargs: None for marker in _markers_run_by(split, W0)}
    Executor(split.plan, split.program, W0, hub.transport(W0), bindings=bindings)
    # A server runs none of the workers' markers: it needs no binding.
    server = Label.server(0)
    assert not _markers_run_by(split, server)
    Executor(split.plan, split.program, server, hub.transport(server))


def test_a_split_run_by_the_runtime_has_every_marker_bound(cache_split):
    from splitrun.runtime import run_threaded

    split, batches = cache_split
    run = run_threaded(split, 1, feeds(batches), recv_timeout_s=30)
    assert run.stats[W0].steps == 1 and run.stats[Label.worker(1)].steps == 1
    assert all(torch.isfinite(value).all() for value in run.state.values())


@pytest.mark.parametrize("module", [cache, collectives, worker_all_reduce])
def test_every_marker_of_ops_is_in_the_registry(module):
    """A marker added to one of ops' marker modules is registered, so the check
    above sees it (the modules' other public names are types)."""
    functions = [getattr(module, name) for name in module.__all__
                 if inspect.isfunction(getattr(module, name))]
    assert functions
    missing = [f.__name__ for f in functions if f not in MARKERS]
    assert not missing, f"{module.__name__}: {missing} are not in ops.markers.MARKERS"
