"""The embedding cache's cached bags on FBGEMM's table-batched kernels, and
one exchange per server and step.

One worker: every sum bag of the step is one `cached_bags` node whose tables
train by one fused backward-and-SGD call (`cached_bags_update`); the trained
tables and dense parameters equal the unsplit step bit for bit. The tables
the kernel cannot train keep their own gradient and update. Each server gets
at most one pull, one write-back and one prefetch request a step, whatever
the number of tables, and applies a group of tables' gradients in one call.
A table cached whole is resident.
"""

import collections

import pytest
import torch
from cache_models import NUM_SUM_BAG_TABLES, ROWS, feeds, make, make_bags, make_sum_bags

from splitrun.runtime import run_threaded
from splitrun.runtime.engine.embedding.fused_bags import FusedBags
from splitrun.runtime.engine.embedding.protocol import Op, read_request
from splitrun.runtime.engine.embedding.store import EmbeddingStore
from splitrun.splitter import Cluster, EmbeddingCacheMode, ParameterServerMode, split_program
from splitrun.splitter.ops.cache import (
    cached_bag_gradient,
    cached_bags,
    cached_bags_update,
    cached_update,
)

NUM_STEPS = 12


def _targets(split) -> collections.Counter:
    return collections.Counter(n.target for n in split.program.graph.nodes
                               if n.op == "call_function")


def _split(program, num_workers=1, num_servers=2):
    split = split_program(program, Cluster(num_workers, num_servers), EmbeddingCacheMode())
    split.lint()
    return split


def test_sum_bags_train_in_one_fused_call_bit_for_bit_with_the_unsplit_step(monkeypatch):
    program, batches = make_sum_bags("sgd", 1, NUM_STEPS, cache_rows=48)
    split = _split(program)
    targets = _targets(split)
    assert targets[cached_bags] == 1 and targets[cached_bags_update] == 1
    assert targets[cached_update] == 0 and targets[cached_bag_gradient] == 0
    (group,) = split.artifacts.fused_groups
    assert len(group) == NUM_SUM_BAG_TABLES
    calls = collections.Counter()
    for name in ("forward", "backward_update"):
        original = getattr(FusedBags, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(FusedBags, name, counted)
    run = run_threaded(split, NUM_STEPS, feeds(batches), recv_timeout_s=30)
    assert calls == {"forward": NUM_STEPS, "backward_update": NUM_STEPS}
    whole, _ = make_sum_bags("sgd", 1, NUM_STEPS, cache_rows=None)
    expected = whole.train_unsplit(NUM_STEPS, feeds(batches))[1]
    assert run.state.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(run.state[key], value), f"{key} differs"
    for table, counters in next(iter(run.cache_counters.values())).items():
        assert counters["evictions"] > 0, f"{table}: the cache must really evict"


@pytest.mark.parametrize("build, optimizer, cache_rows", [
    (make_sum_bags, "sgd", 48), (make_sum_bags, "sgd", 200), (make, "adagrad", 48)])
def test_the_next_steps_rows_move_while_a_step_computes(monkeypatch, build, optimizer,
                                                        cache_rows):
    """One worker: each step's plan is made (rows evicted, written back,
    pulled, installed) while the step before computes. The trained tables are
    the unsplit step's bit for bit, and hits, misses and evictions are those
    of planning every step in the step, also where a plan ahead is refused
    (48 rows: it would evict a row the running step uses)."""
    from splitrun.runtime.engine.embedding.plans_ahead import PlansAhead

    def run(plan_ahead: bool):
        if not plan_ahead:
            monkeypatch.setattr(PlansAhead, "start", lambda self, step, lookups: set())
        program, batches = build(optimizer, 1, NUM_STEPS, cache_rows=cache_rows)
        result = run_threaded(_split(program), NUM_STEPS, feeds(batches), recv_timeout_s=30)
        monkeypatch.undo()
        return result, batches

    ahead, batches = run(True)
    in_step, _ = run(False)
    options = {"sparse_tables": True} if build is make else {}
    whole, _ = build(optimizer, 1, NUM_STEPS, cache_rows=None, **options)
    for key, value in whole.train_unsplit(NUM_STEPS, feeds(batches))[1].items():
        assert torch.equal(ahead.state[key], value), f"{key} differs"
    planned_ahead = []
    for (table, counters), expected in zip(next(iter(ahead.cache_counters.values())).items(),
                                           next(iter(in_step.cache_counters.values())).values()):
        for name in ("hits", "misses", "evictions", "unique_ids"):
            assert counters[name] == expected[name], f"{table}: {name}"
        assert expected["planned_ahead"] == 0
        planned_ahead.append(counters["planned_ahead"])
    if cache_rows == 48:  # some plans ahead refused, some made
        assert min(planned_ahead) < NUM_STEPS - 1 and max(planned_ahead) > 0, planned_ahead
    else:  # every step after the first
        assert planned_ahead == [NUM_STEPS - 1] * len(planned_ahead)


@pytest.mark.parametrize("optimizer, num_workers", [("adagrad", 1), ("sgd", 2)])
def test_bags_the_kernel_cannot_train_keep_their_own_update(optimizer, num_workers):
    """Adagrad, or several workers (gradients go to the servers): one
    `cached_bags` lookup still, but no fused update."""
    program, _ = make_sum_bags(optimizer, num_workers, 1, cache_rows=48)
    split = _split(program, num_workers)
    targets = _targets(split)
    assert targets[cached_bags] == 1 and targets[cached_bags_update] == 0
    assert targets[cached_update] == NUM_SUM_BAG_TABLES
    assert split.artifacts.fused_groups == ()


def test_padded_and_weighted_bags_are_not_fused():
    program, _ = make_bags("sgd", 1, 1, cache_rows=48)
    split = _split(program)
    assert split.artifacts.fused_groups == ()
    assert _targets(split)[cached_bags] == 1  # the two bags (the embedding is no bag)


def _spy_on_requests(monkeypatch) -> collections.Counter:
    """(server, step, op) -> requests received."""
    seen = collections.Counter()
    receive = EmbeddingStore.on_message

    def on_message(self, key, src, tensors):
        op, step, _, _ = read_request(tensors)
        seen[(self.label.rank, step, op)] += 1
        receive(self, key, src, tensors)
    monkeypatch.setattr(EmbeddingStore, "on_message", on_message)
    return seen


@pytest.mark.parametrize("build, num_workers", [(make_sum_bags, 1), (make_sum_bags, 2),
                                                (make, 1)])
def test_each_server_gets_one_request_of_a_kind_per_step(monkeypatch, build, num_workers):
    """Pulls, prefetches, write-backs and gradients of every table ride one
    message per server and step (a step's pull and the next step's prefetch
    are two PULLs). `make`'s tables are plain embeddings, looked up one by one:
    one message per table."""
    program, batches = build("sgd", num_workers, NUM_STEPS, cache_rows=48,
                             max_staleness=1 if num_workers > 1 else 0)
    seen = _spy_on_requests(monkeypatch)
    run_threaded(_split(program, num_workers), NUM_STEPS, feeds(batches), recv_timeout_s=30)
    per_step = NUM_SUM_BAG_TABLES if build is make else 1
    pulls = {k: n for k, n in seen.items() if k[2] is Op.PULL}
    assert max(pulls.values()) <= 2 * per_step * num_workers
    # (The last step's count holds the final flush of dirty rows too.)
    assert max(n for k, n in seen.items() if k[2] in (Op.PUSH, Op.GRADS)
               and k[1] < NUM_STEPS - 1) <= num_workers * (1 if build is make_sum_bags else 2)
    assert any(k[2] in (Op.PUSH, Op.GRADS) for k in seen), "nothing went back to a server"


@pytest.mark.parametrize("build, optimizer", [(make_sum_bags, "sgd"), (make, "adagrad")])
def test_a_table_cached_whole_is_resident_and_equals_the_unsplit_step(build, optimizer):
    """cache_rows >= the table's rows with one worker: every row pulled once,
    slot = id, no plan and no miss afterwards; the same numbers as ever."""
    program, batches = build(optimizer, 1, NUM_STEPS, cache_rows=ROWS)
    run = run_threaded(_split(program), NUM_STEPS, feeds(batches), recv_timeout_s=30)
    options = {"sparse_tables": True} if build is make else {}
    whole, _ = build(optimizer, 1, NUM_STEPS, cache_rows=None, **options)
    expected = whole.train_unsplit(NUM_STEPS, feeds(batches))[1]
    for key, value in expected.items():
        assert torch.equal(run.state[key], value), f"{key} differs"
    for table, counters in next(iter(run.cache_counters.values())).items():
        assert counters["misses"] == 0 and counters["evictions"] == 0, table
        assert counters["hit_rate"] == 1.0
        # Pulled once, whole: the rows and any row state.
        assert counters["bytes_pulled"] >= ROWS * 4 * 4, table


def test_servers_update_a_group_of_tables_in_one_call_per_step(monkeypatch):
    """Two workers (gradients go to the servers): the tables a server holds
    that train alike share one buffer and take one row-wise update call a
    step, not one per table; the numbers stay parameter-server mode's."""
    import splitrun.runtime.engine.embedding.store as store_module

    calls = collections.Counter()
    original = dict(store_module.IN_PLACE)
    for name, update in original.items():
        def counted(*args, _update=update, _name=name, **kwargs):
            calls[_name] += 1
            return _update(*args, **kwargs)
        monkeypatch.setitem(store_module.IN_PLACE, name, counted)
    program, batches = make("adagrad", 2, NUM_STEPS, cache_rows=48)  # two tables alike
    run = run_threaded(_split(program, 2, 2), NUM_STEPS, feeds(batches), recv_timeout_s=30)
    assert calls["adagrad"] == NUM_STEPS * 2  # a call per server and step
    expected = run_threaded(split_program(*make("adagrad", 2, NUM_STEPS, cache_rows=None,
                                                 sparse_tables=True)[:1], Cluster(2, 2),
                                          ParameterServerMode()), NUM_STEPS, feeds(batches),
                            recv_timeout_s=30).state
    for key, value in expected.items():
        assert torch.equal(run.state[key], value), f"{key} differs"


def _fused_group(dims, capacity=10):
    from splitrun.runtime.engine.embedding.row_cache import RowCache
    from splitrun.splitter import CachedTable, CacheSettings

    caches = [RowCache(CachedTable(f"t{i}.weight", 40, dim, torch.float32,
                                   CacheSettings(capacity), "sgd", {}, (), f"ids.{i}"))
              for i, dim in enumerate(dims)]
    fused = FusedBags(caches)
    generator = torch.Generator().manual_seed(3)
    fused.weights.copy_(torch.randn(fused.weights.shape, generator=generator))
    return fused


@pytest.mark.parametrize("layout", ["stacked", "stacked_last", "cat", "out_of_order",
                                    "separate"])
def test_the_backward_reads_gradients_in_place_where_they_share_rows(monkeypatch, layout):
    """The kernel reads the bags' gradients where they lie when they are side
    by side in the rows of one buffer (the backward of DLRM's `stack`), any
    columns before or after them; otherwise they are concatenated. Either
    way the rows are those of the concatenated gradients' update, bit for bit."""
    dims, num_bags = (4, 4, 8), 6
    generator = torch.Generator().manual_seed(0)
    slots = [torch.randint(0, 10, (num_bags * 3,), generator=generator) for _ in dims]
    offsets = [torch.arange(0, num_bags * 3, 3) for _ in dims]
    width = sum(dims)
    if layout == "stacked":      # other columns before and after the tables'
        base = torch.randn(num_bags, 3 + width + 2, generator=generator)
        starts = [3, 7, 11]
    elif layout == "stacked_last":  # the tables' columns end the buffer
        base = torch.randn(num_bags, 5 + width, generator=generator)
        starts = [5, 9, 13]
    elif layout == "cat":
        base = torch.randn(num_bags, width, generator=generator)
        starts = [0, 4, 8]
    elif layout == "out_of_order":
        base = torch.randn(num_bags, width, generator=generator)
        starts = [4, 0, 8]
    else:
        base = None
    grads = ([base[:, s:s + d] for s, d in zip(starts, dims)] if base is not None else
             [torch.randn(num_bags, d, generator=generator) for d in dims])
    in_place = layout in ("stacked", "stacked_last", "cat")

    expected = _fused_group(dims)
    expected.forward(slots, offsets)
    expected.backward_update([g.clone() for g in grads], torch.tensor(0.5))
    fused = _fused_group(dims)
    fused.forward(slots, offsets)
    concatenated = []
    original_cat = torch.cat

    def counted_cat(*args, **kwargs):
        concatenated.append(1)
        return original_cat(*args, **kwargs)
    monkeypatch.setattr(torch, "cat", counted_cat)
    fused.backward_update(grads, torch.tensor(0.5))
    monkeypatch.setattr(torch, "cat", original_cat)
    assert bool(concatenated) is not in_place
    assert torch.equal(fused.weights, expected.weights)
    assert not torch.equal(fused.weights, _fused_group(dims).weights), "nothing was updated"


@pytest.mark.parametrize("before, after", [(0.005, 0.0005), (0.0001, 0.0001)])
def test_a_cache_worker_shortens_the_gil_switch_interval(before, after):
    """A worker's step and its planning thread share the GIL: a cache worker
    hands it over every 0.5 ms at most (Python's default is 5 ms); a shorter
    interval the user set stays."""
    import sys

    saved = sys.getswitchinterval()
    try:
        sys.setswitchinterval(before)
        program, batches = make_sum_bags("sgd", 1, 2, cache_rows=48)
        run_threaded(_split(program), 2, feeds(batches), recv_timeout_s=30)
        assert sys.getswitchinterval() == pytest.approx(after, rel=0.05)  # kept in whole us
    finally:
        sys.setswitchinterval(saved)
