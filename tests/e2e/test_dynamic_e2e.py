"""Dynamic tables (ids any int64) end to end: real launcher, real processes,
real gRPC. The servers make each id's row from the row initializer on first
sight; nothing holds a table of every id."""

import json

import numpy as np
import pytest
import torch
from cluster import SCRIPTS
from dynamic_models import TABLE, hashed_batches, train_reference

from splitrun.runtime.engine.embedding.dynamic_reference import ReferencePolicy
from splitrun.runtime.engine.embedding.id_sharding import IdSharding
from splitrun.splitter import DynamicTable

DYNAMIC_JOB = SCRIPTS / "dynamic_table_job.py"


def _launch(local_cluster, tmp_path, workers, servers, *args, caches=None):
    tmp_path.mkdir(exist_ok=True)
    out = tmp_path / "final.pt"
    proc = local_cluster.run(DYNAMIC_JOB, *args, "--out", out, workers=workers,
                             servers=servers)
    # One worker caches rows (its progress line shows the hit rate); several
    # only with --max-staleness.
    assert "steps/s" in proc.output()
    assert ("hit rate" in proc.output()) == (workers == 1 if caches is None else caches)
    counters = [json.loads((tmp_path / f"final.pt.server{s}.json").read_text())[TABLE]
                for s in range(servers)]
    return torch.load(out), counters


def test_one_worker_two_servers_equal_the_unsplit_step_bit_for_bit(local_cluster, tmp_path):
    state, counters = _launch(local_cluster, tmp_path, 1, 2, "--steps", 10)
    seen, expected = train_reference("sgd", hashed_batches(10))
    assert torch.equal(state[f"{TABLE}.ids"], seen)
    for key, value in expected.items():
        assert torch.equal(state[key], value), key
    owners = IdSharding(2).server_of(seen.numpy())
    assert [c["live_rows"] for c in counters] == [int((owners == s).sum()) for s in range(2)]


@pytest.mark.parametrize("max_staleness", [0, 2])
def test_two_workers_admission_and_expiry_match_the_reference(local_cluster, tmp_path,
                                                              max_staleness):
    """Caching none, or (max_staleness=2) rows read up to 2 steps old: the
    servers' policy sees the same ids either way."""
    policy = DynamicTable(admit_after=2, expire_after_steps=4, row_budget=40)
    state, counters = _launch(local_cluster, tmp_path, 2, 2, "--steps", 20, "--admit-after",
                              2, "--expire-after", 4, "--row-budget", 40, "--max-staleness",
                              max_staleness, caches=max_staleness > 0)
    references = [ReferencePolicy(policy, TABLE, s) for s in range(2)]
    for step, (ids, _) in enumerate(hashed_batches(20)):
        parts = IdSharding(2).split_by_server(np.unique(ids.numpy()))
        for reference, (part,) in zip(references, parts):
            reference.step(step, part.tolist())
    assert state[f"{TABLE}.ids"].tolist() == sorted(i for r in references for i in r.rows)
    for got, reference in zip(counters, references):
        assert (got["admitted"], got["expired"], got["live_rows"]) == (
            reference.num_admitted, reference.num_expired, len(reference.rows))
    assert sum(r.num_expired for r in references) > 0


def test_the_live_set_saved_on_two_servers_resumes_on_three_to_the_same_end(local_cluster,
                                                                           tmp_path):
    """A sharded checkpoint holds each server's live set (rows, ids, the ids
    waiting for admission, the policy's columns); resumed on 3 servers, each
    takes the ids it owns and the run ends as the run that never stopped."""
    policy = ("--admit-after", 2, "--expire-after", 4)
    directory = tmp_path / "step8"
    straight, counted = _launch(local_cluster, tmp_path / "straight", 1, 2, "--steps", 16,
                          "--save-at", 8, "--save", directory, *policy)
    resumed, counters = _launch(local_cluster, tmp_path / "resumed", 1, 3, "--steps", 16,
                                "--resume", directory, *policy)
    assert straight.keys() == resumed.keys()
    for key, value in straight.items():
        assert torch.equal(resumed[key], value), key
    assert sum(c["live_rows"] for c in counters) == straight[f"{TABLE}.ids"].numel()
    # The resumed servers admitted only the ids first admitted after step 8.
    assert 0 < sum(c["admitted"] for c in counters) < sum(c["admitted"] for c in counted)


def test_live_rows_past_the_gather_limit_come_back_as_views_of_the_final_checkpoint(
        local_cluster, tmp_path):
    """`finish(save_to=DIR, gather_tables_up_to=0)`: the dynamic table and its
    Adagrad sums come back as `LiveTable`s over the servers' live sets in DIR;
    read whole or by id, they equal the unsplit step's."""
    state, _ = _launch(local_cluster, tmp_path, 1, 2, "--steps", 10, "--optimizer", "adagrad",
                       "--finish-to", tmp_path / "final", "--gather-up-to", 0)
    seen, expected = train_reference("adagrad", hashed_batches(10))
    assert torch.equal(state[f"{TABLE}.ids"], seen)
    probe = torch.tensor([[3, 0, 3], [-1, 1, 2]])  # dynamic_table_job.PROBE
    for key in (TABLE, f"{TABLE}.sum"):
        assert torch.equal(state[key], expected[key]), key
        assert torch.equal(state[f"probed.{key}"], expected[key][probe]), key
