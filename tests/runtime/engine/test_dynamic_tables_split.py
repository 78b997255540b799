"""Dynamic tables (ids any int64) through the runtime: each step a worker
pulls its ids' rows from their servers (`StepRows`), the servers make the
step's rows once every worker's ids are in and apply the gradients of all
workers (`EmbeddingStore`'s `DynamicRows`). Threads of one process here;
tests/e2e/test_dynamic_e2e.py runs the same through the launcher."""

import numpy as np
import pytest
import torch
from dynamic_models import TABLE, feeds, hashed_batches, make_dynamic, train_reference

from splitrun.runtime import run_threaded
from splitrun.runtime.engine.embedding.dynamic_reference import ReferencePolicy
from splitrun.runtime.engine.embedding.id_sharding import IdSharding
from splitrun.splitter import Cluster, DynamicTable, EmbeddingCacheMode, Label, split_program

STEPS = 12


def _train(optimizer, workers, servers, batches, policy=None, cache_policy="lru",
           max_staleness=0):
    program = make_dynamic(optimizer, workers, batches, policy=policy, cache_policy=cache_policy,
                           max_staleness=max_staleness)
    split = split_program(program, Cluster(workers, servers), EmbeddingCacheMode())
    return run_threaded(split, len(batches), feeds(batches))


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_one_worker_equals_the_unsplit_step_bit_for_bit(optimizer):
    batches = hashed_batches(STEPS)
    run = _train(optimizer, 1, 2, batches)
    seen, expected = train_reference(optimizer, batches)
    assert int((seen < 0).sum()) > 0 and int((seen > (1 << 31)).sum()) > 0
    state = run.state
    assert torch.equal(state[f"{TABLE}.ids"], seen)  # every id seen has a row
    assert state.keys() == expected.keys() | {f"{TABLE}.ids"}
    for key, value in expected.items():
        assert torch.equal(state[key], value), key
    # Each server made only the rows of the ids it owns.
    owners = IdSharding(2).server_of(seen.numpy())
    for server in range(2):
        counters = run.cache_counters[Label.server(server)][TABLE]
        assert counters["live_rows"] == counters["admitted"] == int((owners == server).sum())
    # The worker cached rows across steps (64 slots; a step's ~30 distinct ids
    # of 300), evicting and writing some back.
    worker = run.cache_counters[Label.worker(0)][TABLE]
    assert worker["hits"] > 0 and worker["evictions"] > 0 and worker["bytes_pushed"] > 0


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_one_worker_caching_the_rows_equals_one_caching_none_under_admission_and_expiry(
        optimizer):
    """With admission, expiry by age and a row budget, the worker's cache
    (write-back: rows stay while cached, its servers say which ids have rows
    and which expired) trains exactly as pulling every row every step: the
    same rows and state, the same policy counts, the same dropped gradients."""
    policy = DynamicTable(admit_after=2, expire_after_steps=6, row_budget=20)
    batches = hashed_batches(30)
    cached = _train(optimizer, 1, 2, batches, policy)
    uncached = _train(optimizer, 1, 2, batches, policy, cache_policy="none")
    assert cached.state.keys() == uncached.state.keys()
    for key, value in uncached.state.items():
        assert torch.equal(cached.state[key], value), key
    policy_counts = ("admitted", "expired", "expired_by_budget", "live_rows", "waiting")
    dropped = 0
    for server in range(2):
        ours = cached.cache_counters[Label.server(server)][TABLE]
        theirs = uncached.cache_counters[Label.server(server)][TABLE]
        assert {k: ours[k] for k in policy_counts} == {k: theirs[k] for k in policy_counts}
        assert ours["dropped_gradients"] == 0  # the worker drops them itself
        dropped += theirs["dropped_gradients"]
        assert theirs["expired"] > theirs["expired_by_budget"] > 0
    worker = cached.cache_counters[Label.worker(0)][TABLE]
    assert worker["dropped_gradients"] == dropped > 0
    assert worker["hits"] > 0 and uncached.cache_counters[Label.worker(0)][TABLE]["hits"] == 0


def test_two_workers_equal_the_unsplit_step_within_a_millionth():
    batches = hashed_batches(STEPS)
    run = _train("adagrad", 2, 2, batches)
    seen, expected = train_reference("adagrad", batches)
    assert torch.equal(run.state[f"{TABLE}.ids"], seen)
    for key, value in expected.items():
        torch.testing.assert_close(run.state[key], value, atol=1e-6, rtol=0)


def test_two_workers_caching_stale_rows_keep_the_policy_and_stay_near_the_exact_run():
    """Two workers caching rows up to 2 steps old (write-through: gradients
    go to the servers): admission and expiry see the same ids as workers
    caching none, so every policy count is equal; rows are pulled less and
    the trained rows stay near the exact run's."""
    policy = DynamicTable(admit_after=2, expire_after_steps=6, row_budget=20)
    batches = hashed_batches(30)
    stale = _train("sgd", 2, 2, batches, policy, max_staleness=2)
    exact = _train("sgd", 2, 2, batches, policy)
    policy_counts = ("admitted", "expired", "expired_by_budget", "live_rows", "waiting",
                     "dropped_gradients")
    for server in range(2):
        ours = stale.cache_counters[Label.server(server)][TABLE]
        theirs = exact.cache_counters[Label.server(server)][TABLE]
        assert {k: ours[k] for k in policy_counts} == {k: theirs[k] for k in policy_counts}
        assert theirs["expired_by_budget"] > 0 and theirs["dropped_gradients"] > 0
    for worker in range(2):
        ours = stale.cache_counters[Label.worker(worker)][TABLE]
        theirs = exact.cache_counters[Label.worker(worker)][TABLE]
        assert ours["hits"] > 0 == theirs["hits"]
        assert ours["bytes_pulled"] < theirs["bytes_pulled"]
    key = f"{TABLE}.ids"
    assert torch.equal(stale.state[key], exact.state[key])
    assert not torch.equal(stale.state[TABLE], exact.state[TABLE])  # stale rows were read
    assert torch.allclose(stale.state[TABLE], exact.state[TABLE], atol=5e-3)


def test_admission_and_expiry_of_two_workers_match_the_reference_per_server():
    """The servers hear both workers' ids of a step before making its rows:
    admitted, expired, live and waiting counts, and the live ids at the end,
    are the plain-Python reference's fed each global batch's ids."""
    policy = DynamicTable(admit_after=2, expire_after_steps=4, row_budget=40)
    batches = hashed_batches(30)
    run = _train("sgd", 2, 2, batches, policy)
    sharding = IdSharding(2)
    references = [ReferencePolicy(policy, TABLE, s) for s in range(2)]
    for step, (ids, _) in enumerate(batches):
        distinct = np.unique(ids.numpy())
        for server, (part,) in enumerate(sharding.split_by_server(distinct)):
            references[server].step(step, part.tolist())
    live = sorted(i for reference in references for i in reference.rows)
    assert run.state[f"{TABLE}.ids"].tolist() == live
    for server, reference in enumerate(references):
        counters = run.cache_counters[Label.server(server)][TABLE]
        assert (counters["admitted"], counters["expired"], counters["live_rows"],
                counters["waiting"]) == (reference.num_admitted, reference.num_expired,
                                         len(reference.rows), len(reference.waiting))
        assert counters["live_rows"] <= 40
    assert sum(r.num_expired for r in references) > 0
    assert sum(run.cache_counters[Label.server(s)][TABLE]["dropped_gradients"]
               for s in range(2)) > 0


def test_a_table_looked_up_twice_in_a_step_is_refused_in_one_line():
    from splitrun.runtime.engine.embedding.step_rows import StepRows
    from splitrun.runtime.errors import CacheError
    from splitrun.splitter import CachedTable, CacheSettings
    table = CachedTable("user.weight", 1, 4, torch.float32,
                        CacheSettings(16, dynamic=DynamicTable()), "sgd", {}, (), None)
    rows = StepRows(table)
    ids = torch.tensor([5, -(1 << 40), 5])
    plan = rows.plan(ids, 0, write_back=False, max_staleness=0)
    assert plan.pull_ids.tolist() == [-(1 << 40), 5] and plan.lookup_slots.tolist() == [1, 0, 1]
    with pytest.raises(CacheError, match="'user.weight' is looked up twice in step 0"):
        rows.plan(ids, 0, write_back=False, max_staleness=0)
    with pytest.raises(CacheError, match="ids must be int64.*got float32"):
        rows.plan(ids.float(), 1, write_back=False, max_staleness=0)


def test_a_row_budget_the_servers_memory_cap_cannot_hold_is_refused_at_start(monkeypatch):
    """A server whose row budget (rows and their state) alone passes its
    memory cgroup's limit says so, naming the table, the numbers and the fix,
    before it serves a step."""
    from splitrun.runtime import LoopbackHub, ProcessRuntime
    from splitrun.runtime.cluster import process_memory
    from splitrun.runtime.errors import MemoryCapError
    batches = hashed_batches(1)
    program = make_dynamic("adagrad", 1, batches, policy=DynamicTable(row_budget=1_000_000))
    split = split_program(program, Cluster(1, 2), EmbeddingCacheMode())
    monkeypatch.setattr(process_memory, "own_memory_limit", lambda: 16 << 20)
    hub = LoopbackHub(split.plan.labels)
    with pytest.raises(MemoryCapError, match=r"\[server 0\] the row budget of dynamic table "
                       r"'table.weight' \(1000000 rows of 32 bytes with their state\) would "
                       r"need 30.5 MiB .* limit is 16.0 MiB.*lower DynamicTable\(row_budget"):
        ProcessRuntime(split, Label.server(0), hub.transport(Label.server(0)))


def test_an_exported_checkpoint_of_a_dynamic_table_names_the_table_when_resumed():
    """`splitrun export` writes a dynamic table's live sets under `live_rows`:
    no tensor of the model's shape, so a plain resume says where to resume
    from instead of "lacks table.weight"."""
    from splitrun.runtime import CheckpointError
    from splitrun.runtime.checkpoints import from_checkpoint
    program = make_dynamic("sgd", 1, hashed_batches(1))
    exported = {"step": 4, "optimizer": {"state": {}, "param_groups": []},
                "model": {"top.weight": torch.zeros(1, 4), "top.bias": torch.zeros(1)},
                "live_rows": {TABLE: {"server0": {"ids": torch.tensor([3])}}}}
    with pytest.raises(CheckpointError, match="table.weight is a dynamic table, whose live rows "
                       "a plain file cannot resume; resume from the sharded directory"):
        from_checkpoint(program, exported, "exported.pt")
