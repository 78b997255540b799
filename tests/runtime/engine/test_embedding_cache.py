"""Embedding-cache mode over loopback.

One worker: training equals the whole tables in one process (compared with
torch.equal; the cache runs the same row-wise ops on the same rows). Two
workers with max_staleness 0 equal parameter-server mode exactly; with
staleness, the held-out log-loss stays within 1% of it.
"""

import collections

import pytest
import torch
import torch.nn.functional as F
from cache_models import ROWS, TinyRecommender, click_batches, feeds, make

from splitrun.runtime import LoopbackHub, run_threaded
from splitrun.runtime.engine.embedding.client import EmbeddingClient
from splitrun.runtime.engine.embedding.protocol import PREFIX
from splitrun.runtime.engine.embedding.row_cache import RowCache
from splitrun.runtime.engine.embedding.store import EmbeddingStore
from splitrun.runtime.errors import MessageRejected, SplitrunError
from splitrun.splitter import (
    CachedTable,
    CacheSettings,
    CaptureError,
    Cluster,
    EmbeddingCacheMode,
    EvictionPolicy,
    Label,
    ParameterServerMode,
    PlanError,
    RowInit,
    capture,
    optim,
    place_embedding_cache,
    split,
    split_program,
)

NUM_STEPS = 25


def cached_run(optimizer, num_workers, num_servers, steps=NUM_STEPS, **options):
    program, batches = make(optimizer, num_workers, steps, **options)
    split_prog = split_program(program, Cluster(num_workers, num_servers), EmbeddingCacheMode())
    split_prog.lint()
    return run_threaded(split_prog, steps, feeds(batches), recv_timeout_s=30), batches


def whole_table_run(optimizer, steps=NUM_STEPS, **options):
    program, batches = make(optimizer, 1, steps, cache_rows=None, sparse_tables=True, **options)
    return program.train_unsplit(steps, feeds(batches))[1]


def ps_run(optimizer, num_workers, num_servers, steps=NUM_STEPS, **options):
    program, batches = make(optimizer, num_workers, steps, cache_rows=None, sparse_tables=True,
                            **options)
    split_prog = split_program(program, Cluster(num_workers, num_servers), ParameterServerMode())
    return run_threaded(split_prog, steps, feeds(batches), recv_timeout_s=30).state


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
@pytest.mark.parametrize("num_servers", [1, 2])
def test_one_worker_equals_whole_tables_in_one_process(optimizer, num_servers):
    run, _ = cached_run(optimizer, 1, num_servers, cache_rows=40)
    expected = whole_table_run(optimizer)
    assert run.state.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(run.state[key], value), f"{key} differs"
    for table, counters in run.cache_counters[Label.worker(0)].items():
        assert counters["evictions"] > 0, f"{table}: the cache must really evict"
        assert 0 < counters["hit_rate"] < 1
        assert counters["bytes_pushed"] > 0 and counters["bytes_pulled"] > 0


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
@pytest.mark.parametrize("num_servers", [1, 2])
def test_lazy_rows_one_worker_equals_the_whole_table_from_the_same_initializer(optimizer,
                                                                                num_servers):
    # The model's tables are NaN in the split run: every row comes from the
    # initializer on the servers, made when first pulled.
    run, _ = cached_run(optimizer, 1, num_servers, cache_rows=40, lazy_rows=True)
    expected = whole_table_run(optimizer, lazy_rows=True)
    assert run.state.keys() == expected.keys()
    for key, value in expected.items():
        if optimizer == "sgd":
            assert torch.equal(run.state[key], value), f"{key} differs"
        else:
            torch.testing.assert_close(run.state[key], value, rtol=0, atol=1e-6, msg=key)
    assert not any(run.state[key].isnan().any() for key in expected)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_tables_built_on_the_meta_device_train_as_lazy_rows_do(optimizer):
    """No process holds a table's rows but its servers' own: the model's
    tables are on `meta` (capture traces them on the CPU, their Adagrad
    sums start from a row of zeros' state), and the run equals the lazy-rows
    run bit for bit, so the whole-table reference too."""
    program, _ = make(optimizer, 1, 1, cache_rows=40, lazy_rows=True, meta_tables=True)
    assert program.initial_state["tables.0.weight"].device.type == "meta"
    run, _ = cached_run(optimizer, 1, 2, cache_rows=40, lazy_rows=True, meta_tables=True)
    lazy, _ = cached_run(optimizer, 1, 2, cache_rows=40, lazy_rows=True)
    assert run.state.keys() == lazy.state.keys()
    for key, value in lazy.state.items():
        assert torch.equal(run.state[key], value), f"{key} differs"


def test_a_table_on_the_meta_device_without_a_row_initializer_is_refused_at_marking():
    table = torch.nn.Embedding(1000, 4, device="meta")
    with pytest.raises(CaptureError, match=r"cached Embedding\(1000, 4\) on the meta device "
                       r"holds no rows to start from; give it a row initializer"):
        place_embedding_cache(table, cache_rows=16)


def test_lazy_rows_two_workers_equal_parameter_server_mode():
    run, _ = cached_run("adagrad", 2, 2, cache_rows=40, policy="lfu", lazy_rows=True)
    expected = ps_run("adagrad", 2, 2, lazy_rows=True)
    for key, value in expected.items():
        assert torch.equal(run.state[key], value), f"{key} differs"


@pytest.mark.parametrize("optimizer, state", [("adagrad", {"sum": 0.0}),
                                              ("adam", {"exp_avg": 0.0, "exp_avg_sq": 0.0})])
def test_capture_makes_no_whole_row_state_for_a_cached_table(optimizer, state):
    # The table's starting state is one row broadcast over its rows: a table
    # of any size costs one row at capture; a plain parameter's state is whole.
    program, _ = make(optimizer, 1, 1, cache_rows=40)
    for index in range(2):
        table = program.initial_state[f"tables.{index}.weight"]
        for name, start in state.items():
            value = program.initial_state[f"tables.{index}.weight.{name}"]
            assert value.shape == table.shape and value.dtype == table.dtype
            assert value.untyped_storage().nbytes() <= 2 * table.shape[1] * table.element_size()
            assert torch.equal(value, torch.full_like(table, start)), name
    for key in ("dense.weight", "top.0.weight"):
        for name in state:
            value = program.initial_state[f"{key}.{name}"]
            assert value.untyped_storage().nbytes() == value.numel() * value.element_size()


def test_lazy_rows_get_memory_only_when_first_named():
    table = CachedTable("emb.weight", 1000, 4, torch.float32,
                        CacheSettings(4, init=RowInit.uniform(seed=3)), "adagrad", {}, ("sum",),
                        "batch.0")
    cluster = Cluster(1, 2)
    labels = cluster.labels()
    hub = LoopbackHub(labels)
    meta = {table.key: torch.empty(1000, 4, device="meta"),
            f"{table.key}.sum": torch.full((1000, 4), 0.25)}
    store = EmbeddingStore([table], labels[1], cluster, hub.transport(labels[1]), 0, meta)
    shard = store.shards[0]
    assert shard.slots.used == 0
    assert store.rows_made() == {table.key: (0, 500)}
    mine = shard.sharding.ids_of(labels[1].rank)[:3]
    where = store._group_rows(shard, torch.cat([mine, mine[:1]]))
    assert shard.slots.used == 3 and where.tolist() == [0, 1, 2, 0]
    assert store.rows_made() == {table.key: (3, 500)}
    assert torch.equal(shard.group.rows[:3],
                       RowInit.uniform(seed=3).rows(mine, 4, table.key, num_rows=1000))
    assert torch.equal(shard.group.state["sum"][:3], torch.full((3, 4), 0.25))
    # The shard in local order (a dump, a checkpoint): used rows as they are,
    # the others from the initializer.
    ids = shard.sharding.ids_of(labels[1].rank)
    whole = RowInit.uniform(seed=3).rows(ids, 4, table.key, num_rows=1000)
    shard.group.rows[1] += 1
    expected = whole.clone()
    expected[1] += 1
    assert torch.equal(store._local_order(shard), expected)


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


@pytest.mark.parametrize("policy", [EvictionPolicy.LRU, EvictionPolicy.LFU])
def test_a_workers_cache_of_a_huge_table_costs_the_pages_its_ids_touch(policy):
    """Its id -> slot map (and LFU's counts) are backed page by page as ids are
    first seen: 500 M declared rows cost nothing at start, and a step's ids
    the pages they fall in."""
    rows = 500_000_000
    before = _rss_mb()
    cache = RowCache(CachedTable("emb.weight", rows, 2, torch.float32,
                                 CacheSettings(1000, policy), "sgd", {}, (), "batch.0"))
    assert _rss_mb() - before < 50, "the map was written whole at start"
    ids = torch.arange(0, rows, rows // 200, dtype=torch.int64)  # 200 ids, 200 pages apart
    plan = cache.plan(ids, 0, write_back=True, max_staleness=0)
    assert plan.num_unique == 200 and torch.equal(cache.slots_or_missing(ids), plan.lookup_slots)
    assert _rss_mb() - before < 50
    assert torch.equal(cache.slots_or_missing(torch.tensor([1, ids[3]])), torch.tensor([-1, 3]))


def test_a_shard_beyond_the_servers_memory_cap_is_refused_and_lazy_rows_are_not(monkeypatch):
    """A shard copied at start-up is written whole: one its server's memory
    cgroup cannot hold is refused naming the server, the table and the
    numbers. Rows from a row initializer get memory when used: they start."""
    from splitrun.runtime.cluster import process_memory
    from splitrun.runtime.errors import MemoryCapError

    cluster = Cluster(1, 2)
    labels = cluster.labels()
    plain = CachedTable("emb.weight", 1000, 4, torch.float32, CacheSettings(4), "adagrad", {},
                        ("sum",), "batch.0")
    initial = {plain.key: torch.zeros(1000, 4), f"{plain.key}.sum": torch.zeros(1000, 4)}
    monkeypatch.setattr(process_memory, "own_memory_limit", lambda: 500 * 4 * 4 * 2 - 1)
    hub = LoopbackHub(labels)
    with pytest.raises(MemoryCapError, match=r"^\[server 0\] its shards of the cached tables "
                       r"\(rows and their optimizer state\) need 0.0 MiB \(1 tensors; the "
                       r"largest 'emb.weight' 0.0 MiB\) but its memory cgroup's limit is 0.0 "
                       r"MiB: it cannot hold them; give the tables a row initializer"):
        EmbeddingStore([plain], labels[1], cluster, hub.transport(labels[1]), 0, initial)
    lazy = CachedTable("emb.weight", 1000, 4, torch.float32,
                       CacheSettings(4, init=RowInit.uniform(seed=3)), "adagrad", {}, ("sum",),
                       "batch.0")
    meta = {lazy.key: torch.empty(1000, 4, device="meta"),
            f"{lazy.key}.sum": torch.zeros(1000, 4)}
    store = EmbeddingStore([lazy], labels[1], cluster, hub.transport(labels[1]), 0, meta)
    assert store.rows_made() == {lazy.key: (0, 500)}


@pytest.mark.parametrize("ids, says", [
    (torch.tensor([1, -2]), r"\[server 0\] table emb.weight: id -2 is outside its rows "
                            r"\[0, 20\)"),
    (torch.tensor([1, 2], dtype=torch.int32), r"\[server 0\] table emb.weight: ids must be "
                                              r"int64, got torch.int32")])
def test_a_bad_id_is_one_line_naming_table_and_server(ids, says):
    table = _table(rows=20)
    cluster = Cluster(1, 1)
    labels = cluster.labels()
    hub = LoopbackHub(labels)
    store = EmbeddingStore([table], labels[1], cluster, hub.transport(labels[1]), 0,
                           {table.key: torch.zeros(20, 2)})
    with pytest.raises(MessageRejected, match=says):
        store._group_rows(store.shards[0], ids)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_two_workers_without_staleness_equal_parameter_server_mode(optimizer):
    run, _ = cached_run(optimizer, 2, 2, cache_rows=40, policy="lfu", max_staleness=0)
    expected = ps_run(optimizer, 2, 2)
    for key, value in expected.items():
        assert torch.equal(run.state[key], value), f"{key} differs"


def held_out_loss(state, batches):
    model = TinyRecommender()
    model.load_state_dict({k: v for k, v in state.items() if k in model.state_dict()})
    with torch.no_grad():
        losses = [F.binary_cross_entropy_with_logits(model(b[0], *b[1:-1]), b[-1])
                  for b in batches]
    return torch.stack(losses).mean().item()


def test_stale_rows_keep_the_held_out_loss_within_one_percent():
    # Batches of 64 and a modest rate, so the loss is settled enough that 1%
    # measures staleness rather than the noise of one trajectory.
    options = {"batch": 64, "lr": 0.05}
    steps = 150
    held_out = click_batches(30, seed=99, batch=64)
    run, _ = cached_run("adagrad", 2, 2, steps, cache_rows=160, policy="lfu", max_staleness=3,
                        **options)
    fresh = ps_run("adagrad", 2, 2, steps, **options)
    stale_loss, fresh_loss = held_out_loss(run.state, held_out), held_out_loss(fresh, held_out)
    untrained = held_out_loss(make("adagrad", 1, 1)[0].initial_state, held_out)
    assert fresh_loss < 0.8 * untrained, "the model must learn for the comparison to mean much"
    assert abs(stale_loss - fresh_loss) <= 0.01 * fresh_loss, (stale_loss, fresh_loss)
    pulled = sum(c["bytes_pulled"] for c in run.cache_counters[Label.worker(0)].values())
    fresh_run, _ = cached_run("adagrad", 2, 2, steps, cache_rows=160, policy="lfu",
                              max_staleness=0, **options)
    pulled_fresh = sum(c["bytes_pulled"]
                       for c in fresh_run.cache_counters[Label.worker(0)].values())
    assert pulled < pulled_fresh, "stale rows must save pulls"


def _table(rows=20, cache_rows=4, policy=EvictionPolicy.LRU, optimizer="sgd"):
    return CachedTable("emb.weight", rows, 2, torch.float32, CacheSettings(cache_rows, policy),
                       optimizer, {}, (), "batch.0")


def test_eviction_never_drops_an_update():
    """Write known values through the update path, force every written row out
    of the cache, read them back from the servers."""
    table = _table(rows=20, cache_rows=4)
    cluster = Cluster(1, 2)
    labels = cluster.labels()
    hub = LoopbackHub(labels)
    initial = {table.key: torch.arange(40, dtype=torch.float32).reshape(20, 2)}
    stores = [EmbeddingStore([table], server, cluster, hub.transport(server), 0, initial)
              for server in labels[1:]]
    for store, server in zip(stores, labels[1:]):
        hub.transport(server).route(PREFIX, store.on_message)
        store.start()
    try:
        client = EmbeddingClient([table], labels[0], cluster, hub.transport(labels[0]), 0,
                                 timeout_s=10)
        written = torch.tensor([3, 7, 11, 15])
        client.step = 0
        rows = client.lookup(written, table=table.key)
        assert torch.equal(rows, initial[table.key][written])
        grad = torch.full((4, 2), 2.0)
        client.update(written, grad, torch.tensor(0.5, dtype=torch.float64),
                      torch.tensor(1.0, dtype=torch.float64), table=table.key)
        expected = initial[table.key][written] - 1.0
        client.step = 1
        client.lookup(torch.tensor([0, 1, 2, 4]), table=table.key)  # evicts all four
        counters = client.counters[table.key]
        assert counters["evictions"] == 4 and counters["bytes_pushed"] > 0
        assert not bool((client.caches[table.key].slot_of_id[written] >= 0).any())
        dumped = client.dump(steps_done=2)[table.key]
        assert torch.equal(dumped[written], expected)
        client.step = 2
        assert torch.equal(client.lookup(written, table=table.key), expected)
    finally:
        for store in stores:
            store.stop()


def test_a_server_refuses_rows_it_does_not_hold_and_says_which_table():
    """A write-back or pull naming ids of another server's slice (a worker
    sharding the table otherwise) is refused, not written into or read from
    some other row of the server's buffer."""
    from splitrun.runtime.engine.embedding.protocol import Op, request, request_channel
    from splitrun.runtime.engine.embedding.sharding import RowSharding
    from splitrun.runtime.transport.protocol import MessageKey

    table = _table(rows=20, cache_rows=4)
    cluster = Cluster(1, 2)
    worker, _, server = cluster.labels()
    # Server 0's rows, sent to server 1 (they would count back from its end).
    others = RowSharding(20, 2).ids_of(0)[:3]
    for op, part in [(Op.PULL, [others]), (Op.PUSH, [others, torch.zeros(3, 2)])]:
        hub = LoopbackHub(cluster.labels())
        store = EmbeddingStore([table], server, cluster, hub.transport(server), 0,
                               {table.key: torch.zeros(20, 2)})
        store.start()
        try:
            store.on_message(MessageKey(0, 0, request_channel(worker)), worker,
                             request(op, 0, [0], [part]))
            with pytest.raises(SplitrunError, match="emb.weight this server does not hold"):
                hub.transport(server).recv(worker, MessageKey(0, 0, "never"), 10)
            assert bool((store.shards[0].rows == 0).all())
        finally:
            store.stop()


def test_a_server_refuses_rows_of_a_dynamic_table_from_workers_that_send_gradients():
    """With two workers a dynamic table's rows live on its servers only (the
    workers send gradients); a PUSH of rows for it is refused by name rather
    than written over rows the other worker is training."""
    from splitrun.runtime.engine.embedding.protocol import Op, request, request_channel
    from splitrun.runtime.transport.protocol import MessageKey
    from splitrun.splitter import DynamicTable

    table = CachedTable("emb.weight", 0, 2, torch.float32,
                        CacheSettings(4, EvictionPolicy.LRU, dynamic=DynamicTable()),
                        "sgd", {}, (), "batch.0")
    cluster = Cluster(2, 1)
    worker, _, server = cluster.labels()
    hub = LoopbackHub(cluster.labels())
    store = EmbeddingStore([table], server, cluster, hub.transport(server), 0, {})
    store.start()
    try:
        store.on_message(MessageKey(0, 0, request_channel(worker)), worker,
                         request(Op.PUSH, 0, [0], [[torch.tensor([5]), torch.zeros(1, 2)]]))
        with pytest.raises(SplitrunError, match="PUSH .* writes rows of a dynamic table back"):
            hub.transport(server).recv(worker, MessageKey(0, 0, "never"), 10)
        assert store.dynamic_counters()["emb.weight"]["live_rows"] == 0
    finally:
        store.stop()


def test_a_server_lets_go_of_a_request_once_served_not_when_the_next_comes():
    """A request lent from a shared-memory ring holds its room there until its
    tensors are gone; a store that kept its last request while waiting for the
    next one hung a sharded save of Adagrad tables (the flush's write-back,
    larger than the room left, could never arrive)."""
    import threading
    import weakref

    from splitrun.runtime.engine.embedding.protocol import Op, request, request_channel
    from splitrun.runtime.transport.protocol import MessageKey

    table = _table(rows=20, cache_rows=4)
    cluster = Cluster(1, 1)
    worker, server = cluster.labels()
    hub = LoopbackHub(cluster.labels())
    store = EmbeddingStore([table], server, cluster, hub.transport(server), 0,
                           {table.key: torch.zeros(20, 2)})
    store.start()
    try:
        rows, released = torch.ones(3, 2), threading.Event()
        weakref.finalize(rows, released.set)
        store.on_message(MessageKey(0, 0, request_channel(worker)), worker,
                         request(Op.PUSH, 0, [0], [[torch.tensor([1, 5, 7]), rows]]))
        del rows
        assert released.wait(10), "the served request's tensors are still referenced"
        assert store.requests_served == 1 and store.error is None
        assert torch.equal(store.shards[0].rows[store.shards[0].sharding.local_index(
            torch.tensor([1, 5, 7]), 0)], torch.ones(3, 2))
    finally:
        store.stop()


def test_lru_and_lfu_evict_different_rows_and_never_a_pinned_one():
    lru, lfu = RowCache(_table(policy=EvictionPolicy.LRU)), RowCache(_table(
        policy=EvictionPolicy.LFU))
    history = [[0, 0, 0, 1], [2, 2, 3], [1, 2, 3]]  # id 0: frequent but old
    for step, ids in enumerate(history):
        for cache in (lru, lfu):
            cache.plan(torch.tensor(ids), step, write_back=True, max_staleness=0)
    cached = lambda cache: set((cache.id_of_slot[cache.id_of_slot >= 0]).tolist())  # noqa: E731
    lru.plan(torch.tensor([4]), 3, write_back=True, max_staleness=0)
    lfu.plan(torch.tensor([4]), 3, write_back=True, max_staleness=0)
    assert cached(lru) == {1, 2, 3, 4}, "LRU drops the least recently used: 0"
    assert 0 in cached(lfu) and cached(lfu) == {0, 2, 3, 4}, "LFU drops the least used: 1"
    # The batch's own rows are pinned: with a full cache, a batch that reuses
    # the least recent row keeps it.
    plan = lru.plan(torch.tensor([1, 5]), 4, write_back=True, max_staleness=0)
    assert 1 in cached(lru) and 5 in cached(lru) and plan.evictions == 1


@pytest.mark.parametrize("policy", [EvictionPolicy.LRU, EvictionPolicy.LFU])
def test_a_plan_that_would_evict_a_kept_slot_is_refused_and_changes_nothing(policy):
    """Planning the next batch while a step runs keeps the running step's
    slots: a plan that must evict one is refused, the cache left as it was;
    one that need not is the plan made without `keep`."""
    caches = [RowCache(_table(policy=policy)) for _ in range(2)]
    for cache in caches:
        for step, ids in enumerate([[0, 1], [2, 3]]):
            cache.plan(torch.tensor(ids), step, write_back=True, max_staleness=0)
    kept, other = caches
    before = {name: getattr(kept, name).clone() for name in ("slot_of_id", "id_of_slot",
                                                             "last_used", "dirty")}
    # Rows of step 0 on are kept: the victim (id 0, the least recent) too.
    assert kept.plan(torch.tensor([4]), 2, write_back=True, max_staleness=0,
                     keep_since=0) is None
    for name, value in before.items():
        assert torch.equal(getattr(kept, name), value), f"{name} changed"
    assert kept.filled == 4
    plan = kept.plan(torch.tensor([4]), 2, write_back=True, max_staleness=0, keep_since=1)
    expected = other.plan(torch.tensor([4]), 2, write_back=True, max_staleness=0)
    assert torch.equal(plan.pull_slots, expected.pull_slots)
    assert torch.equal(kept.id_of_slot, other.id_of_slot)
    assert torch.equal(kept.last_used, other.last_used)


@pytest.mark.parametrize("policy", [EvictionPolicy.LRU, EvictionPolicy.LFU])
def test_evictions_at_scale_pick_exactly_the_policys_victims(policy):
    """A cache large enough that eviction selects its victims partially (LRU
    by counting its step-number keys, LFU by topk): every step's victims are
    the cached rows outside the batch with the smallest keys (LRU: last use;
    LFU: lookups so far, then last use; ties: lower slot first)."""
    rows, capacity = 20_000, 4_000
    cache = RowCache(_table(rows=rows, cache_rows=capacity, policy=policy))
    generator = torch.Generator().manual_seed(0)
    last_used, lookups, partial_steps = {}, {}, 0
    for step in range(24):
        # Warm rows again and again, and a few cold ones: few victims a step.
        ids = torch.cat([torch.randint(0, 3_000, (600,), generator=generator),
                         torch.randint(0, rows, (150,), generator=generator)])
        unique, counts = ids.unique(return_counts=True)
        slot_of = {int(i): s for s, i in enumerate(cache.id_of_slot.tolist()) if i >= 0}
        batch = set(unique.tolist())
        misses = [i for i in unique.tolist() if i not in slot_of]
        short = len(misses) - (capacity - len(slot_of))

        recency = {i: (last_used[i], slot) for i, slot in slot_of.items()}
        key = {i: r if policy is EvictionPolicy.LRU else (lookups[i], *r)
               for i, r in recency.items()}
        expected = set(sorted(set(slot_of) - batch, key=key.get)[:max(short, 0)])
        plan = cache.plan(ids, step, write_back=True, max_staleness=0)
        now_cached = set(cache.id_of_slot[cache.id_of_slot >= 0].tolist())
        assert now_cached == (set(slot_of) - expected) | batch, f"step {step}"
        assert plan.evictions == len(expected)
        partial_steps += 0 < len(expected) <= capacity // 16
        for i, count in zip(unique.tolist(), counts.tolist()):
            last_used[i] = step
            lookups[i] = lookups.get(i, 0) + count
    assert partial_steps >= 10, "eviction picked few victims of many slots"


@pytest.mark.parametrize("min_chunk", [1, 256], ids=["one-slot-chunks", "default-chunks"])
def test_lru_order_kept_step_by_step_plans_exactly_as_sorting_every_slot(monkeypatch, min_chunk):
    """LRU reads its victims off an order it keeps as plans are made
    (`use_order.py`, an entry a chunk at a time: chunks of one slot per slot
    wanted too); a cache that sorts every slot's last use each plan
    instead makes the same plans: the same victims in the same order, so the
    same slots for the same ids. Also across a plan refused for keeping the
    running step's rows, and a table planned twice in one step."""
    from splitrun.runtime.engine.embedding import use_order

    monkeypatch.setattr(use_order, "_MIN_CHUNK", min_chunk)
    if min_chunk == 1:
        monkeypatch.setattr(use_order, "_CHUNK_PER_WANTED", 1)
    rows, capacity = 5_000, 600
    kept = RowCache(_table(rows=rows, cache_rows=capacity))
    sorting = RowCache(_table(rows=rows, cache_rows=capacity))
    monkeypatch.setattr(sorting, "_lru_order", lambda step: None)
    generator = torch.Generator().manual_seed(0)
    used_order = 0
    for step in range(40):
        ids = torch.cat([torch.randint(0, 400, (300,), generator=generator),
                         torch.randint(0, rows, (120,), generator=generator)])
        replans = [(ids, step, None)]
        if step % 7 == 3:  # refused: it must evict a row the step before used
            replans.insert(0, (torch.randint(0, rows, (500,), generator=generator), step, step - 1))
        if step % 11 == 5:  # the same table twice in one step
            replans.append((torch.randint(0, rows, (200,), generator=generator), step, None))
        for batch, at, keep_since in replans:
            plans = [cache.plan(batch, at, write_back=True, max_staleness=0,
                                keep_since=keep_since) for cache in (kept, sorting)]
            if plans[0] is None or plans[1] is None:
                assert plans[0] is None and plans[1] is None, f"step {step}"
                continue
            for name in ("lookup_slots", "pull_ids", "pull_slots", "evicted_ids",
                         "evicted_slots"):
                assert torch.equal(getattr(plans[0], name), getattr(plans[1], name)), (
                    f"step {step}: {name}")
            used_order += kept._use_order is not None and plans[0].evictions > 0
        for name in ("slot_of_id", "id_of_slot", "last_used"):
            assert torch.equal(getattr(kept, name), getattr(sorting, name)), f"step {step}: {name}"
    assert used_order >= 20, "the kept order chose the victims of most steps"


def test_lru_order_stays_bounded_while_nothing_is_evicted(monkeypatch):
    """Steps that only hit leave stale entries behind in the kept LRU order:
    it is dropped past 4 entries a slot and built again from the slots' last
    uses, and the plans stay those of sorting every slot."""
    rows, capacity = 2_000, 200
    kept = RowCache(_table(rows=rows, cache_rows=capacity))
    sorting = RowCache(_table(rows=rows, cache_rows=capacity))
    monkeypatch.setattr(sorting, "_lru_order", lambda step: None)
    generator = torch.Generator().manual_seed(1)
    largest = 0
    for step in range(60):
        if 10 <= step < 40:  # only rows cached now: no misses, no victims
            cached = kept.id_of_slot[kept.id_of_slot >= 0]
            ids = cached[torch.randint(0, cached.numel(), (150,), generator=generator)]
        else:
            ids = torch.randint(0, rows, (150,), generator=generator)
        plans = [cache.plan(ids, step, write_back=True, max_staleness=0)
                 for cache in (kept, sorting)]
        assert torch.equal(plans[0].lookup_slots, plans[1].lookup_slots), f"step {step}"
        assert torch.equal(kept.id_of_slot, sorting.id_of_slot), f"step {step}"
        if kept._use_order is not None:
            largest = max(largest, kept._use_order.num_entries)
    assert 0 < largest <= 4 * capacity


def test_bad_ids_and_small_caches_name_the_table():
    cache = RowCache(_table(rows=20, cache_rows=4))
    with pytest.raises(SplitrunError, match=r"table 'emb.weight' has 20 rows \(ids 0-19\) but "
                                            r"the batch looks up id 25"):
        cache.plan(torch.tensor([1, 25]), 0, write_back=True, max_staleness=0)
    with pytest.raises(SplitrunError, match=r"looks up 6 distinct ids but the cache holds 4 "
                                            r"rows; cache_rows must be at least 6"):
        cache.plan(torch.arange(6), 0, write_back=True, max_staleness=0)


def test_cached_tables_refuse_what_they_cannot_do():
    torch.manual_seed(0)
    model = TinyRecommender()
    place_embedding_cache(model.tables, cache_rows=50)
    batch = click_batches(1)[0]
    loss = lambda m, *b: F.binary_cross_entropy_with_logits(m(b[0], *b[1:-1]), b[-1])  # noqa
    with pytest.raises(Exception, match=r"SGD with momentum or weight decay cannot update a "
                                        r"sparse embedding row by row"):
        capture(model, loss, optim.SGD(lr=0.1, momentum=0.9), batch)
    with pytest.raises(PlanError, match=r"needs at least one server"):
        split(capture(model, loss, optim.SGD(lr=0.1), batch), Cluster(1, 0),
              EmbeddingCacheMode())
    with pytest.raises(CaptureError, match=r"cache_rows must be >= 1"):
        place_embedding_cache(model.tables, cache_rows=0)


def test_uncached_policy_pulls_every_row_every_step():
    run, _ = cached_run("sgd", 1, 1, cache_rows=ROWS, policy="none")
    for counters in run.cache_counters[Label.worker(0)].values():
        assert counters["hits"] == 0 and counters["misses"] == counters["unique_ids"]
    for key, value in whole_table_run("sgd").items():
        torch.testing.assert_close(run.state[key], value, rtol=0, atol=1e-6)



def test_a_plans_write_back_and_pull_share_one_message_per_server(monkeypatch):
    """The plans made while a step computes write back their victims and pull
    their misses in one PUSH_PULL per server (the server answers, then writes
    back): still the unsplit step's training bit for bit."""
    from cache_models import make_sum_bags

    from splitrun.runtime.engine.embedding import store as store_module
    from splitrun.runtime.engine.embedding.protocol import Op

    read_request = store_module.read_request
    ops = collections.Counter()

    def recording(tensors):
        read = read_request(tensors)
        ops[read[0]] += 1
        return read
    monkeypatch.setattr(store_module, "read_request", recording)
    steps = 12
    program, batches = make_sum_bags("sgd", 1, steps, cache_rows=200)
    split_prog = split_program(program, Cluster(1, 2), EmbeddingCacheMode())
    run = run_threaded(split_prog, steps, feeds(batches), recv_timeout_s=30)
    whole, _ = make_sum_bags("sgd", 1, steps, cache_rows=None)
    for key, value in whole.train_unsplit(steps, feeds(batches))[1].items():
        assert torch.equal(run.state[key], value), f"{key} differs"
    # Once the caches are full, each step's rows move in one message per server
    # (the last PUSHes: the final flush of dirty rows).
    assert ops[Op.PUSH_PULL] >= 8 and ops[Op.PUSH] <= 2, ops


def test_a_flush_goes_back_in_bounded_messages_and_loses_no_row(monkeypatch):
    """The final flush of dirty rows is cut into messages of at most
    FLUSH_MESSAGE_BYTES of rows (here 10 rows of Adagrad's 4 floats and 4
    sums), every table's packed together: still the unsplit step's state."""
    from splitrun.runtime.engine.embedding import client as client_module

    sizes, send = [], client_module.EmbeddingClient._write_back_counted

    def recording(self, parts):
        sizes.append(sum(ids.numel() for _, ids, _ in parts))
        return send(self, parts)
    monkeypatch.setattr(client_module.EmbeddingClient, "_write_back_counted", recording)
    monkeypatch.setattr(client_module, "FLUSH_MESSAGE_BYTES", 10 * 4 * 4 * 2)
    run, _ = cached_run("adagrad", 1, 2, steps=6, cache_rows=40)
    expected = whole_table_run("adagrad", steps=6)
    for key, value in expected.items():
        assert torch.equal(run.state[key], value), f"{key} differs"
    # Two tables of 40 cached rows, most dirty: every message full but the last.
    assert sum(sizes) > 40 and max(sizes) == 10 and min(sizes[:-1]) == 10, sizes


def test_one_planning_thread_plans_ahead_and_ends_with_the_job(monkeypatch):
    """The next steps' plans are made by one thread for the whole job (not
    one a step), which ends when the job's processes close."""
    import threading

    from cache_models import make_sum_bags

    started = []
    original = threading.Thread.start

    def counting(thread):
        if thread.name.startswith("splitrun-cache-ahead"):
            started.append(thread)
        return original(thread)
    monkeypatch.setattr(threading.Thread, "start", counting)
    steps = 10
    program, batches = make_sum_bags("sgd", 1, steps, cache_rows=200)
    split_prog = split_program(program, Cluster(1, 2), EmbeddingCacheMode())
    run = run_threaded(split_prog, steps, feeds(batches), recv_timeout_s=30)
    planned = sum(c["planned_ahead"] for c in run.cache_counters[Label.worker(0)].values())
    assert planned >= steps - 2, planned
    assert len(started) == 1, started
    assert not started[0].is_alive()
