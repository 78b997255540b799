"""Parameter-server mode with a staleness bound (stale-synchronous parallel).

The rule (splitter/ps_mode.py): worker w's step c reads parameters of version
v(w, c) with c - s <= v(w, c) <= c, version v being the servers' state after
the synchronous updates of steps 0 .. v-1. s=0 is the synchronous plan itself.
The launched tests record, per worker and step, the version read, with one
worker deliberately slow, and check the bound holds and is used up to its
limit (the fast worker is not held back before it).
"""

import json

import pytest
import torch
from cluster import SCRIPTS
from ps_models import feeds, make

from splitrun.runtime import run_threaded
from splitrun.runtime.transport.contract import receive_contracts
from splitrun.splitter import (
    Cluster,
    Label,
    ParameterServerMode,
    PlanError,
    SplitPlan,
    split_program,
)

PS_JOB = SCRIPTS / "ps_job.py"
STEPS = 24


def _split(staleness=None, workers=2, servers=2, kind="dense", optimizer="adam"):
    program, _, batches = make(kind, optimizer, workers, STEPS)
    mode = ParameterServerMode() if staleness is None else ParameterServerMode(
        staleness=staleness)
    return split_program(program, Cluster(workers, servers), mode), batches


def test_staleness_zero_is_the_synchronous_plan_itself():
    synchronous, _ = _split()
    explicit, _ = _split(staleness=0)
    assert explicit.plan == synchronous.plan
    assert explicit.plan.to_text() == synchronous.plan.to_text()
    assert explicit.plan.fingerprint == synchronous.plan.fingerprint


def test_a_bounded_plan_says_its_bound_and_refuses_a_mismatched_process():
    bounded, _ = _split(staleness=2)
    synchronous, _ = _split()
    assert bounded.plan.staleness == 2
    assert "staleness 2" in bounded.plan.to_text()
    assert SplitPlan.from_text(bounded.plan.to_text()) == bounded.plan
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


def _versions(directory, workers):
    return [{int(step): v for step, v in json.loads(
        (directory / f"worker{rank}.json").read_text()).items()} for rank in range(workers)]


@pytest.mark.slow
@pytest.mark.parametrize("staleness", [1, 3])
def test_launched_slow_worker_bound_holds_and_the_fast_worker_runs_up_to_it(
        local_cluster, tmp_path, staleness):
    out = tmp_path / f"s{staleness}"
    out.mkdir()
    local_cluster.run(PS_JOB, "--steps", STEPS, "--staleness", staleness, "--slow-worker", 1,
                      "--slow-step-s", 0.1, "--versions-out", out, "--out", out / "r.pt",
                      workers=2, servers=2)
    fast, slow = _versions(out, 2)
    for rank, versions in enumerate((fast, slow)):
        assert sorted(versions) == list(range(STEPS)), rank
        for step, version in versions.items():
            assert step - staleness <= version <= step, (rank, step, version)
    # The fast worker did not wait for updates it was allowed to skip: it ran
    # ahead of the slow one as far as the bound lets it, and no further.
    assert max(step - version for step, version in fast.items()) == staleness
    result = torch.load(out / "r.pt")
    assert result["steps"] == STEPS


@pytest.mark.slow
def test_launched_bounded_job_with_large_parameters_finishes(local_cluster, tmp_path):
    """23 MB of parameters a message over shared memory, bound 3: the fast
    worker ends with up to 3 versions it never reads; they must not hold the
    64 MiB ring the server still writes into (lent in place they did, and
    the server's last sends waited until the job's finish timed out)."""
    out = tmp_path / "large"
    out.mkdir()
    local_cluster.run(PS_JOB, "--steps", 12, "--staleness", 3, "--width", 2400,
                      "--optimizer", "sgd", "--slow-worker", 1, "--slow-step-s", 0.2,
                      "--versions-out", out, "--out", out / "r.pt", workers=2, servers=1)
    fast, _ = _versions(out, 2)
    assert all(step - 3 <= v <= step for step, v in fast.items())
    assert torch.load(out / "r.pt")["steps"] == 12


@pytest.mark.slow
def test_launched_staleness_zero_equals_the_synchronous_job_bit_for_bit(
        local_cluster, uninterrupted_ps_job, tmp_path):
    out = tmp_path / "s0.pt"
    local_cluster.run(PS_JOB, "--steps", 20, "--staleness", 0, "--out", out,
                      workers=2, servers=2)
    explicit = torch.load(out)
    synchronous = uninterrupted_ps_job("dense", "adam", steps=20, workers=2, servers=2)
    assert explicit["state"].keys() == synchronous["state"].keys()
    for key, value in synchronous["state"].items():
        assert torch.equal(explicit["state"][key], value), key


@pytest.mark.slow
def test_launched_bounded_job_resumes_from_a_checkpoint_on_more_servers(local_cluster,
                                                                       tmp_path):
    """The checkpoint at step n is the servers' state after the updates of
    steps 0 .. n-1 (the cut the synchronous mode saves); a resumed bounded
    job's first step reads exactly that version, whatever the bound."""
    checkpoint = tmp_path / "step10.pt"
    local_cluster.run(PS_JOB, "--steps", 20, "--stop-after", 10, "--save", checkpoint,
                      "--staleness", 2, "--slow-worker", 1, workers=2, servers=1)
    assert torch.load(checkpoint, weights_only=True)["step"] == 10
    out = tmp_path / "resumed"
    out.mkdir()
    local_cluster.run(PS_JOB, "--steps", 20, "--resume", checkpoint, "--staleness", 2,
                      "--versions-out", out, "--out", out / "r.pt", workers=2, servers=2)
    for versions in _versions(out, 2):
        assert sorted(versions) == list(range(10, 20))
        assert versions[10] == 10
        for step, version in versions.items():
            assert max(step - 2, 10) <= version <= step
    assert torch.load(out / "r.pt")["steps"] == 20


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
