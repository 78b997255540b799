"""Less work per lookup: each cached table's ids are made unique once per
step, and that one unique serves the lookup, the cache and the gradient;
gradients leave a worker summed per unique id (embedding-cache mode, cached or
not, and parameter-server mode's sparse gradients), and training results stay
what they were (the one-worker and parameter-server equalities live in
tests/runtime/engine/test_embedding_cache.py and
tests/splitter/test_embedding_bag.py).
"""

import operator

import pytest
import torch
from cache_models import NUM_TABLES, feeds, make, make_bags, make_sum_bags

from splitrun.runtime import run_threaded
from splitrun.runtime.engine.embedding import StepIds
from splitrun.runtime.engine.embedding.protocol import Op, read_request
from splitrun.runtime.engine.embedding.store import EmbeddingStore
from splitrun.splitter import Cluster, EmbeddingCacheMode, ParameterServerMode, split_program
from splitrun.splitter.labels import Role
from splitrun.splitter.ops.sparse_updates import coalesce

NUM_STEPS = 6


class _Counting:
    """A torch function, counted."""

    def __init__(self, function) -> None:
        self.calls = 0
        self._function = function

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self._function(*args, **kwargs)


def _cached_run(program, batches, num_workers, num_servers):
    split = split_program(program, Cluster(num_workers, num_servers), EmbeddingCacheMode())
    return run_threaded(split, NUM_STEPS, feeds(batches), recv_timeout_s=30)


@pytest.mark.parametrize("optimizer, model", [("sgd", "embeddings"), ("adam", "embeddings"),
                                              ("sgd", "bags"), ("sgd", "fused_bags")])
def test_one_worker_runs_at_most_one_unique_per_table_and_step(monkeypatch, optimizer, model):
    """The cache plan and the prefetch of the next batch sort no step's
    lookups (each lookup's slot comes from the id map; only the misses, fewer,
    are made distinct); a bag's gradient sums and the update (write-back: the
    row-wise optimizer gets rows already summed) share one unique, one stable
    sort of the table's ids per step (`sorted_groups`), made when the gradient
    asks; a fused table's kernel sums its gradient itself: no unique at all."""
    build = {"embeddings": make, "bags": make_bags, "fused_bags": make_sum_bags}[model]
    program, batches = build(optimizer, 1, NUM_STEPS, cache_rows=48)
    unique, sort = _Counting(torch.unique), _Counting(torch.sort)
    monkeypatch.setattr(torch, "unique", unique)
    monkeypatch.setattr(torch, "sort", sort)
    run = _cached_run(program, batches, 1, 2)
    # The one stable sort of a table's ids is `sorted_groups`'; nothing else sorts.
    per_step = {"embeddings": NUM_TABLES, "bags": 3, "fused_bags": 0}[model]
    assert sort.calls == per_step * NUM_STEPS
    tables = next(iter(run.cache_counters.values()))
    # Misses made distinct: at most twice per table and step (the plan, the prefetch).
    assert unique.calls <= 2 * len(tables) * NUM_STEPS
    assert all(c["evictions"] > 0 for c in tables.values()), "the cache never evicted"


def _spy_on_gradients(monkeypatch) -> list[tuple[int, torch.Tensor]]:
    """Every table's ids in each GRADS request a server receives: (worker
    rank, ids). A request holds every table's (ids, grads, lr, step)."""
    seen: list[tuple[int, torch.Tensor]] = []
    receive = EmbeddingStore.on_message

    def on_message(self, key, src, tensors):
        op, _, tables, parts = read_request(tensors)
        if op is Op.GRADS:
            assert len(parts) == 4 * len(tables)
            seen.extend((src.rank, parts[4 * i].clone()) for i in range(len(tables)))
        receive(self, key, src, tensors)

    monkeypatch.setattr(EmbeddingStore, "on_message", on_message)
    return seen


@pytest.mark.parametrize("policy", ["lru", "none"])
def test_workers_send_each_id_once_per_step(monkeypatch, policy):
    """Two workers (gradients go to the servers every step), cached or not:
    each message holds each id once, the padding row left out, and together
    the messages cover exactly the ids the workers' batches looked up."""
    program, batches = make_bags("sgd", 2, NUM_STEPS, cache_rows=48, policy=policy)
    seen = _spy_on_gradients(monkeypatch)
    _cached_run(program, batches, 2, 2)
    assert seen, "no gradient reached a server"
    for _, ids in seen:
        assert ids.numel() == torch.unique(ids).numel(), f"duplicate ids sent: {ids.tolist()}"
        assert not bool((ids == 0).any()), "the padding row's gradient was sent"
    # Exactly the distinct ids (padding left out) of each worker's shard, per
    # table and step: not one row per lookup.
    shard = batches[0][0].shape[0] // 2
    expected = sum(int((torch.unique(ids[rank * shard:(rank + 1) * shard]) != 0).sum())
                   for batch in batches[:NUM_STEPS] for ids in (batch[1], batch[3], batch[4])
                   for rank in range(2))
    lookups = sum(t.numel() for batch in batches for t in (batch[1], batch[3], batch[4]))
    assert sum(ids.numel() for _, ids in seen) == expected < lookups


def test_uncached_policy_with_one_worker_sends_unique_rows_and_matches_whole_tables(
        monkeypatch):
    program, batches = make("adagrad", 1, NUM_STEPS, cache_rows=48, policy="none")
    seen = _spy_on_gradients(monkeypatch)
    run = _cached_run(program, batches, 1, 2)
    for _, ids in seen:
        assert ids.numel() == torch.unique(ids).numel()
    whole, _ = make("adagrad", 1, NUM_STEPS, cache_rows=None, sparse_tables=True)
    expected = whole.train_unsplit(NUM_STEPS, feeds(batches))[1]
    for key, value in expected.items():
        torch.testing.assert_close(run.state[key], value, rtol=0, atol=1e-6)


def test_parameter_server_workers_send_coalesced_sparse_gradients():
    """The values a worker sends a server for a sparse table come out of
    `coalesce` on the worker (one row per unique id), not the lookup's backward."""
    program, _ = make_bags("sgd", 2, 1, cache_rows=None)
    split = split_program(program, Cluster(2, 2), ParameterServerMode())
    nodes = {n.name: n for n in split.program.graph.nodes}
    sparse_params = {p for p in program.sparse_grads}
    assert sparse_params, "the bag model has sparse tables"
    sent = [nodes[v] for c in split.plan.channels if c.src.role is Role.WORKER
            for v in c.values]
    from_coalesce = [n for n in sent if n.target is operator.getitem
                     and n.args[0].target is coalesce]
    # Indices and values of every sparse table, from each of the two workers.
    assert len(from_coalesce) == 2 * 2 * len(sparse_params)


def test_sums_per_unique_id_equal_torch_coalescing_bit_for_bit():
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 50, (4, 300), generator=generator)
    values = torch.randn(1200, 16, generator=generator)
    step_ids = StepIds.of(ids)
    rows, summed = coalesce(ids.reshape(-1), values)
    assert torch.equal(step_ids.unique, rows)
    assert torch.equal(step_ids.reduce(values), summed)
    reference = torch.sparse_coo_tensor(ids.reshape(1, -1), values, (50, 16)).coalesce()
    assert torch.equal(reference.indices()[0], rows)
    torch.testing.assert_close(reference.values(), summed, rtol=0, atol=1e-5)
    assert step_ids.holds(ids.reshape(-1)) and not step_ids.holds(ids.flip(1))
