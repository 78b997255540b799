"""Parameter-server mode with a staleness bound (stale-synchronous parallel).

The rule (splitter/modes/parameter_server.py): worker w's step c reads parameters
of version v(w, c) with c - s <= v(w, c) <= c, version v being the servers' state
after the synchronous updates of steps 0 .. v-1. s=0 is the synchronous plan
itself. Here the plans and threaded runs: the versions each worker read stay
within the bound, and a bounded run equals the rule run eagerly in one process
on the versions it recorded (`stale_reference`). The launched runs, with one
worker deliberately slow: tests/e2e/test_ps_staleness_e2e.py.
"""

import pytest
import torch
from ps_models import feeds, keys_read, make, stale_reference

from splitrun.runtime import run_threaded
from splitrun.runtime.transport.contract import receive_contracts
from splitrun.splitter import (
    Cluster,
    Label,
    ParameterServerMode,
    PlanError,
    plan_from_text,
    plan_to_text,
    split_program,
)

STEPS = 24


def _split(staleness=None, workers=2, servers=2, kind="dense", optimizer="adam"):
    program, batches = make(kind, optimizer, workers, STEPS)
    mode = ParameterServerMode() if staleness is None else ParameterServerMode(
        staleness=staleness)
    return split_program(program, Cluster(workers, servers), mode), batches


def test_staleness_zero_is_the_synchronous_plan_itself():
    synchronous, _ = _split()
    explicit, _ = _split(staleness=0)
    assert explicit.plan == synchronous.plan
    assert plan_to_text(explicit.plan) == plan_to_text(synchronous.plan)
    assert explicit.plan.fingerprint == synchronous.plan.fingerprint


def test_a_bounded_plan_says_its_bound_and_refuses_a_mismatched_process():
    bounded, _ = _split(staleness=2)
    synchronous, _ = _split()
    assert bounded.plan.staleness == 2
    assert "staleness 2" in plan_to_text(bounded.plan)
    assert plan_from_text(plan_to_text(bounded.plan)) == bounded.plan
    # Processes started with another bound do not agree on the plan.
    assert bounded.plan.fingerprint != synchronous.plan.fingerprint
    bounded.lint()


def test_bounded_data_syncs_are_never_lent_in_place():
    """A transport may lend a plan message in place (a view of its ring) only
    if the executor drops it within the step; a bounded data-sync message may
    wait for a later step, or be dropped untaken at the end."""
    for staleness, lendable in ((0, True), (2, False)):
        split, _ = _split(staleness=staleness)
        worker = Label.worker(0)
        contracts = receive_contracts(split.plan, split.program, worker)
        synced = {s.channel for s in split.plan.data_syncs if s.reader == worker}
        assert synced
        assert all(contracts[name].lendable is lendable for name in synced), staleness


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_a_bad_staleness_names_itself(bad):
    with pytest.raises(PlanError, match=r"staleness=.*whole number of steps >= 0"):
        ParameterServerMode(staleness=bad)


@pytest.mark.parametrize("kind, optimizer", [("dense", "adam"), ("sparse", "adagrad")])
def test_threaded_bounded_run_reads_versions_within_the_bound_and_trains(kind, optimizer):
    split, batches = _split(staleness=2, kind=kind, optimizer=optimizer)
    run = run_threaded(split, STEPS, feeds(batches), recv_timeout_s=30)
    for label, stats in run.stats.items():
        if label.role.value != "worker":
            continue
        assert sorted(stats.versions_read) == list(range(STEPS))
        for step, version in stats.versions_read.items():
            assert step - 2 <= version <= step, (label, step, version)
    key = "body.0.weight" if kind == "dense" else "emb.weight"
    assert not torch.allclose(run.state[key], split.program.initial_state[key])


# A bounded run against the rule run eagerly: the same ops on the same
# versions, in another order (a server sums the workers' gradients in slots).
REFERENCE_TOLERANCE = 1e-6


@pytest.mark.parametrize("staleness, optimizer, servers",
                         [(1, "adam", 1), (2, "sgd_momentum", 2)])
def test_threaded_bounded_run_equals_the_rule_run_eagerly(staleness, optimizer, servers):
    """Each update is applied once, per clock, to the gradients of the
    versions each worker recorded reading (no update twice, no gradient of
    another version or clock, no shifted shard)."""
    split, batches = _split(staleness=staleness, servers=servers, optimizer=optimizer)
    run = run_threaded(split, STEPS, feeds(batches), recv_timeout_s=30)
    workers = [Label.worker(rank) for rank in range(2)]
    versions = [keys_read(split.plan, label, run.stats[label].channel_versions_read)
                for label in workers]
    for rank, read in enumerate(versions):
        assert sorted(read) == list(range(STEPS)), rank
        for step, keys in read.items():
            assert all(step - staleness <= v <= step for v in keys.values()), (rank, step)
    _, expected = stale_reference(split.program, optimizer, batches, versions)
    for key, value in expected.items():
        torch.testing.assert_close(run.state[key], value, rtol=0, atol=REFERENCE_TOLERANCE)
    # The rule is not the synchronous one: some step read an older version.
    assert any(v < step for read in versions for step, keys in read.items()
               for v in keys.values())


def test_with_dense_parameters_on_the_workers_only_the_rows_are_stale():
    """dense="worker": the dense parameters are all-reduced every step (the
    workers agree on them exactly), the bound applies to the rows the
    servers send."""
    from cache_models import feeds as bag_feeds
    from cache_models import make_sum_bags
    program, batches = make_sum_bags("sgd", 2, STEPS, cache_rows=None)
    split = split_program(program, Cluster(2, 1), ParameterServerMode(dense="worker",
                                                                      staleness=1))
    split.lint()
    run = run_threaded(split, STEPS, bag_feeds(batches), recv_timeout_s=30)
    workers = [label for label in run.stats if label.role.value == "worker"]
    for label in workers:
        versions = run.stats[label].versions_read
        assert sorted(versions) == list(range(STEPS))
        assert all(step - 1 <= v <= step for step, v in versions.items())
    synced = {s.key for s in split.plan.data_syncs}
    assert synced == {f"tables.{i}.weight" for i in range(3)}
