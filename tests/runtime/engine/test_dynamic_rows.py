"""A server's rows of a dynamic table (runtime/engine/embedding/dynamic_rows.py):
the vectorized policy equals the plain-Python reference (dynamic_reference.py)
id for id on a Zipf stream, training with admission and expiry off equals the
unsplit step bit for bit (SGD), and the live set goes through a checkpoint
onto another number of servers."""

import numpy as np
import pytest
import torch

from splitrun.runtime.engine.embedding.dynamic_reference import ReferencePolicy, RowBudgetError
from splitrun.runtime.engine.embedding.dynamic_rows import DynamicRows
from splitrun.runtime.engine.embedding.id_map import IdMap
from splitrun.runtime.engine.embedding.id_sharding import IdSharding, mix64
from splitrun.runtime.errors import CacheError
from splitrun.splitter import DynamicTable, RowInit

DIM = 4
INIT = RowInit.normal(std=0.1, seed=3)
LR = 0.01


def zipf_stream(num_steps: int, batch: int, seed: int = 0, a: float = 1.2) -> list[np.ndarray]:
    """Per step, `batch` lookups of Zipf ranks mapped to int64 ids all over
    int64 (negative ones and ones past 2^31 included)."""
    rng = np.random.default_rng(seed)
    return [mix64(rng.zipf(a, batch).astype(np.int64)).view(np.int64)
            for _ in range(num_steps)]


def test_id_map_finds_inserts_and_removes_ids_beyond_2_to_the_31():
    m = IdMap(("slot",))
    ids = np.array([-(1 << 62), -1, 5, 1 << 40, (1 << 63) - 1], dtype=np.int64)
    m.insert(ids, slot=np.arange(5))
    positions, found = m.find(np.array([1 << 40, 6, -1], dtype=np.int64))
    assert found.tolist() == [True, False, True]
    assert m.columns["slot"][positions[[0, 2]]].tolist() == [3, 1]
    m.remove(np.array([5, -1], dtype=np.int64))
    assert m.ids.tolist() == [-(1 << 62), 1 << 40, (1 << 63) - 1]
    assert m.columns["slot"].tolist() == [0, 3, 4]


POLICIES = [DynamicTable(admit_after=3, expire_after_steps=15),
            DynamicTable(admit_after=2, row_budget=700),
            DynamicTable(admit_after=4, expire_after_steps=25, row_budget=450),
            DynamicTable()]


@pytest.mark.parametrize("policy", POLICIES, ids=str)
def test_admitted_and_expired_match_the_reference_on_a_zipf_stream(policy):
    sharding = IdSharding(2)
    stores = [DynamicRows("t", DIM, policy, init=INIT, server=s) for s in range(2)]
    references = [ReferencePolicy(policy, "t", s) for s in range(2)]
    for step, ids in enumerate(zipf_stream(150, 400)):
        for server, (part,) in enumerate(sharding.split_by_server(ids)):
            admitted = stores[server].begin_step(step, part)
            outcome = references[server].step(step, part.tolist())
            assert admitted.tolist() == outcome.admitted, (step, server)
            assert stores[server].expired_ids.tolist() == sorted(outcome.expired), (step, server)
    for store, reference in zip(stores, references):
        c = store.counters
        assert (c.admitted, c.expired, c.live_rows) == (
            reference.num_admitted, reference.num_expired, len(reference.rows))
        assert c.waiting == len(reference.waiting)
        slots = store.slots_of(store.live.ids)
        assert {int(i): (int(f), int(t)) for i, f, t in zip(
            store.live.ids, store.frequency[slots], store.last[slots])} == reference.rows
        if policy.row_budget is not None:
            assert c.live_rows <= policy.row_budget
    assert sum(s.counters.admitted for s in stores) > 0
    if not policy.is_exact:
        assert sum(s.counters.expired for s in stores) > 0


def _run_split(steps, optimizer, state_names, settings, num_servers=2):
    """One worker over `num_servers` stores: each step pulls its ids' rows,
    computes the bag and loss locally, and sends the gradient of each
    unique id to its server."""
    sharding = IdSharding(num_servers)
    stores = [DynamicRows("t", DIM, DynamicTable(), init=INIT, optimizer=optimizer,
                          optimizer_settings=settings, state_names=state_names, server=s)
              for s in range(num_servers)]
    for step, (ids, offsets, target) in enumerate(steps):
        unique, inverse = torch.unique(ids, return_inverse=True)
        parts = sharding.split_by_server(unique.numpy(), np.arange(unique.numel()))
        rows = torch.empty(unique.numel(), DIM)
        for server, (part, where) in enumerate(parts):
            stores[server].begin_step(step, part)
            rows[torch.from_numpy(where)] = stores[server].read(part)
        rows.requires_grad_(True)
        bags = torch.nn.functional.embedding_bag(inverse, rows, offsets, mode="sum")
        loss = ((bags - target) ** 2).mean()
        loss.backward()
        for server, (part, where) in enumerate(parts):
            stores[server].apply(part, rows.grad[torch.from_numpy(where)], LR, step + 1)
    return stores


def _run_unsplit(steps, optimizer_class, **settings):
    """The reference: an nn.EmbeddingBag over every id the stream sees, its
    rows from the same initializer, trained by torch's optimizer."""
    seen = torch.unique(torch.cat([ids for ids, _, _ in steps]))
    bag = torch.nn.EmbeddingBag(seen.numel(), DIM, mode="sum")
    with torch.no_grad():
        bag.weight.copy_(INIT.rows(seen, DIM, "t"))
    optimizer = optimizer_class(bag.parameters(), lr=LR, **settings)
    for ids, offsets, target in steps:
        optimizer.zero_grad()
        loss = ((bag(torch.searchsorted(seen, ids), offsets) - target) ** 2).mean()
        loss.backward()
        optimizer.step()
    return seen, bag.weight.detach()


def _steps(num_steps=12, batch=64):
    generator = torch.Generator().manual_seed(0)
    out = []
    for ids in zipf_stream(num_steps, batch * 3, seed=1):
        offsets = torch.arange(0, batch * 3, 3)
        out.append((torch.from_numpy(ids), offsets, torch.randn(batch, DIM, generator=generator)))
    return out


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_one_worker_equals_the_unsplit_step(optimizer):
    steps = _steps()
    if optimizer == "sgd":
        stores = _run_split(steps, "sgd", (), {})
        seen, expected = _run_unsplit(steps, torch.optim.SGD)
    else:
        stores = _run_split(steps, "adagrad", ("sum",), {"eps": 1e-10})
        seen, expected = _run_unsplit(steps, torch.optim.Adagrad, eps=1e-10)
    got = torch.empty_like(expected)
    sharding = IdSharding(2)
    for server, (part, where) in enumerate(sharding.split_by_server(
            seen.numpy(), np.arange(seen.numel()))):
        got[torch.from_numpy(where)] = stores[server].read(part)
    assert int((seen > (1 << 31)).sum()) > 0 and int((seen < 0).sum()) > 0
    if optimizer == "sgd":
        assert torch.equal(got, expected)  # bit for bit
    else:
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


def test_an_id_not_admitted_reads_its_initial_row_and_drops_its_gradient():
    store = DynamicRows("user", DIM, DynamicTable(admit_after=2), init=INIT)
    ids = torch.tensor([7, 1 << 50])
    store.begin_step(0, ids)
    assert torch.equal(store.read(ids), INIT.rows(ids, DIM, "user"))
    store.apply(ids, torch.ones(2, DIM), 1.0, 1)
    assert store.counters.dropped_gradients == 2 and store.counters.live_rows == 0
    assert store.begin_step(1, ids).tolist() == [7, 1 << 50]  # the second sighting admits
    store.apply(ids, torch.ones(2, DIM), 1.0, 2)
    assert torch.equal(store.read(ids), INIT.rows(ids, DIM, "user") - 1)
    assert store.counters.bytes == 2 * DIM * 4


def test_a_caching_worker_gets_row_state_and_writes_back_only_rows_that_exist():
    """What a server gives a worker caching the rows: state (the starting
    value for an id without a row), which ids have rows; a write-back of an
    id without a row names it."""
    store = DynamicRows("t", DIM, DynamicTable(admit_after=2), init=INIT, optimizer="adagrad",
                        state_names=("sum",), state_start={"sum": 0.25})
    store.begin_step(0, np.array([1, 2]))
    store.begin_step(1, np.array([2, 3]))  # 2 admitted; 1 and 3 wait
    assert store.has_rows(np.array([3, 2, 1])).tolist() == [False, True, False]
    store.write(np.array([2]), torch.full((1, DIM), 7.0), {"sum": torch.full((1, DIM), 9.0)})
    state = store.read_state(np.array([2, 3]))["sum"]
    assert state[0].tolist() == [9.0] * DIM and state[1].tolist() == [0.25] * DIM
    assert store.read(np.array([2]))[0].tolist() == [7.0] * DIM
    with pytest.raises(CacheError, match="write-back of id 3, which has no row here"):
        store.write(np.array([2, 3]), torch.zeros(2, DIM), {"sum": torch.zeros(2, DIM)})


def test_zeros_without_an_initializer():
    store = DynamicRows("t", DIM, DynamicTable(admit_after=5))
    store.begin_step(0, np.array([3]))
    assert torch.equal(store.read(np.array([3])), torch.zeros(1, DIM))


def test_a_budget_that_cannot_hold_one_step_names_table_server_and_numbers():
    store = DynamicRows("item", DIM, DynamicTable(row_budget=10), server=1)
    with pytest.raises(RowBudgetError, match=r"dynamic table 'item' on server 1: this step needs "
                       r"12 rows \(0 in use and 12 admitted\) but its row budget is 10 rows"):
        store.begin_step(0, np.arange(12))


def test_float_ids_are_refused():
    store = DynamicRows("item", DIM, DynamicTable())
    with pytest.raises(CacheError, match="dynamic table 'item': ids must be int64.*got float32"):
        store.begin_step(0, torch.tensor([1.0, 2.0]))


def test_the_live_set_resumes_onto_another_number_of_servers():
    policy = DynamicTable(admit_after=2, expire_after_steps=20, row_budget=600)
    stream = zipf_stream(60, 300, seed=5)

    def train(stores, sharding, steps):
        for step, ids in steps:
            for server, (part,) in enumerate(sharding.split_by_server(ids)):
                stores[server].begin_step(step, part)
                stores[server].apply(part, torch.full((part.size, DIM), 0.01), 1.0, step + 1)

    def make(num, s, budget_policy=policy):
        return DynamicRows("t", DIM, budget_policy, init=INIT, optimizer="adagrad",
                           state_names=("sum",), server=s)

    two = [make(2, s) for s in range(2)]
    train(two, IdSharding(2), list(enumerate(stream))[:30])
    snapshots = [s.snapshot() for s in two]
    train(two, IdSharding(2), list(enumerate(stream))[30:])
    # Three servers hold the same live set: with a budget of 600 per server the
    # budget would expire other rows, so the resumed run gets the budget the
    # two-server run's rows need (the total is what is compared).
    resumed = [make(3, s, DynamicTable(admit_after=2, expire_after_steps=20)) for s in range(3)]
    for store in resumed:
        store.restore(snapshots, IdSharding(3))
    assert sum(s.counters.live_rows for s in resumed) == sum(
        int(snap["ids"].numel()) for snap in snapshots)
    # Without a budget, the continued runs agree id for id with the
    # two-server run only up to budget expiries: compare with a two-server
    # run without a budget from the same checkpoint instead.
    again = [make(2, s, DynamicTable(admit_after=2, expire_after_steps=20)) for s in range(2)]
    for store in again:
        store.restore(snapshots, IdSharding(2))
    train(again, IdSharding(2), list(enumerate(stream))[30:])
    train(resumed, IdSharding(3), list(enumerate(stream))[30:])
    ids = np.sort(np.concatenate([s.live.ids for s in again]))
    assert np.array_equal(ids, np.sort(np.concatenate([s.live.ids for s in resumed])))
    got, expected = torch.empty(ids.size, DIM), torch.empty(ids.size, DIM)
    for stores, sharding, out in ((again, IdSharding(2), expected),
                                  (resumed, IdSharding(3), got)):
        for server, (part, where) in enumerate(sharding.split_by_server(ids, np.arange(ids.size))):
            out[torch.from_numpy(where)] = stores[server].read(part)
    assert torch.equal(got, expected)


def test_a_checkpoint_past_the_budget_is_refused_with_the_numbers():
    store = DynamicRows("t", DIM, DynamicTable())
    store.begin_step(0, np.arange(50))
    small = DynamicRows("t", DIM, DynamicTable(row_budget=20), server=0)
    with pytest.raises(RowBudgetError, match="gives it 50 rows but its row budget is 20"):
        small.restore([store.snapshot()], IdSharding(1))


def test_a_row_cache_of_a_dynamic_table_maps_any_int64_id_and_starts_expired_rows_over():
    """A worker's cache of a dynamic table: ids anywhere in int64 get slots
    (a sparse map, no range), a second lookup in a step is refused, and an
    expired cached row starts over from the initializer's row, clean."""
    from splitrun.runtime.engine.embedding.row_cache import RowCache
    from splitrun.splitter import CachedTable, CacheSettings, CaptureError, EvictionPolicy
    init = RowInit.normal(std=1.0, seed=3)
    table = CachedTable("user.weight", 1, DIM, torch.float32,
                        CacheSettings(4, init=init, dynamic=DynamicTable(admit_after=2)),
                        "adagrad", {}, ("sum",), None)
    cache = RowCache(table)
    ids = torch.tensor([1 << 62, -7, 1 << 62, 3])
    plan = cache.plan(ids, 0, write_back=True, max_staleness=0)
    assert plan.pull_ids.tolist() == [-7, 3, 1 << 62]
    cache.install(plan.pull_slots, torch.ones(3, DIM), {"sum": torch.ones(3, DIM)}, None)
    cache.mark_dirty(plan.used_slots)
    assert cache.slots_or_missing(torch.tensor([3, 4])).tolist()[1] == -1
    with pytest.raises(CacheError, match="'user.weight' is looked up twice in step 0"):
        cache.plan(ids, 0, write_back=True, max_staleness=0)
    cache.reset(torch.tensor([-7, 99]), {"sum": 0.5})  # 99: not cached
    slot = int(cache.slots_of(torch.tensor([-7]))[0])
    assert torch.equal(cache.rows[slot], init.rows(torch.tensor([-7]), DIM, "user.weight")[0])
    assert torch.equal(cache.state["sum"][slot], torch.full((DIM,), 0.5))
    dirty_ids, _ = cache.dirty_slots()
    assert sorted(dirty_ids.tolist()) == [3, 1 << 62]  # the reset row is clean
    # Two new ids: the free slot, then the least recently used row (-7, clean:
    # nothing to write back).
    plan = cache.plan(torch.tensor([5, 6]), 1, write_back=True, max_staleness=0)
    assert plan.evictions == 1 and plan.evicted_ids.tolist() == []
    assert cache.slots_or_missing(torch.tensor([-7, 5, 6])).tolist()[0] == -1
    with pytest.raises(CacheError, match="ids must be int64.*got float32"):
        cache.plan(ids.float(), 2, write_back=True, max_staleness=0)
    with pytest.raises(CaptureError, match="evicts by policy='lru'"):
        CacheSettings(4, policy=EvictionPolicy.LFU, dynamic=DynamicTable())
