"""Parameter-server mode with a staleness bound (stale-synchronous parallel),
through the real launcher. The rule and the threaded runs:
tests/splitter/test_ps_staleness.py.

The launched tests record, per worker and step, the version read, with one
worker deliberately slow, and check the bound holds and is used up to its
limit (the fast worker is not held back before it). Others compare a
bounded run, step by step, with the rule run eagerly in one process on the
versions the run recorded (`stale_reference`): each worker's loss at each step
(a function of the parameters it read) and the final parameters (of the
updates applied).
"""

import json

import pytest
import torch
from cluster import SCRIPTS, LocalCluster
from ps_models import make, stale_reference

PS_JOB = SCRIPTS / "ps_job.py"
STEPS = 24
# A bounded run against the rule run eagerly: the same ops on the same
# versions, in another order (a server sums the workers' gradients in slots).
REFERENCE_TOLERANCE = 1e-6


def _versions(directory, workers):
    return [{int(step): v for step, v in json.loads(
        (directory / f"worker{rank}.json").read_text()).items()} for rank in range(workers)]


@pytest.fixture(scope="module")
def slow_worker_run(tmp_path_factory):
    """`slow_worker_run(staleness)`: the folder where PS_JOB, launched with that
    bound on 2 workers and 2 servers for STEPS steps, worker 1 slow by 0.1 s a
    step, wrote each worker's versions read and losses (--versions-out) and
    worker 0 its result (r.pt). Each bound is launched once per module: the
    tests of the bound and of the rule read the same run."""
    directory = tmp_path_factory.mktemp("slow_worker_run")
    cluster = LocalCluster(cwd=directory)
    runs = {}

    def run(staleness):
        if staleness not in runs:
            out = directory / f"s{staleness}"
            out.mkdir()
            cluster.run(PS_JOB, "--steps", STEPS, "--staleness", staleness, "--slow-worker", 1,
                        "--slow-step-s", 0.1, "--versions-out", out, "--out", out / "r.pt",
                        workers=2, servers=2)
            runs[staleness] = out
        return runs[staleness]

    try:
        yield run
    finally:
        cluster.close()


@pytest.mark.parametrize("staleness", [1, 3])
def test_launched_slow_worker_bound_holds_and_the_fast_worker_runs_up_to_it(slow_worker_run,
                                                                           staleness):
    out = slow_worker_run(staleness)
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


def test_launched_bounded_job_equals_the_rule_run_eagerly_step_by_step(slow_worker_run):
    """Real processes over shared memory, a slow worker, two servers: every
    worker's loss at every step is the loss of the versions it recorded
    reading, and the final parameters those of the rule's updates."""
    out = slow_worker_run(1)  # the run of the bound test above, with bound 1
    records = [json.loads((out / f"worker{rank}-read.json").read_text())
               for rank in range(2)]
    versions = [{int(step): keys for step, keys in record["keys"].items()}
                for record in records]
    program, batches = make("dense", "adam", 2, STEPS)
    losses, expected = stale_reference(program, "adam", batches, versions)
    for rank, record in enumerate(records):
        for step, (loss, reference) in enumerate(zip(record["losses"], losses[rank],
                                                     strict=True)):
            assert loss == pytest.approx(reference, abs=REFERENCE_TOLERANCE), (rank, step)
    state = torch.load(out / "r.pt")["state"]
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=REFERENCE_TOLERANCE)
    assert any(v < step for read in versions for step, keys in read.items()
               for v in keys.values())


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
