"""Embedding-cache mode end to end: real launcher, real processes, real gRPC."""

import re

import pytest
import torch
from cache_models import feeds, make, make_sum_bags
from cluster import JOB_TIMEOUT_S, SCRIPTS

from splitrun.runtime import run_threaded
from splitrun.splitter import Cluster, EmbeddingCacheMode, ParameterServerMode, split_program

CACHE_JOB = SCRIPTS / "cache_job.py"


@pytest.fixture
def launch(local_cluster, tmp_path):
    """Runs CACHE_JOB through the launcher; returns what worker 0 wrote to --out."""
    def launch(name, workers, servers, *args):
        out = tmp_path / f"{name}.pt"
        proc = local_cluster.run(CACHE_JOB, *args, "--out", out, workers=workers, servers=servers)
        return torch.load(out), proc.output()
    return launch


def test_one_worker_two_servers_equal_whole_tables(cache_saved_at_ten):
    # 20 steps with a 40-row cache, saved after step 10 (the tests below resume it).
    result, output = torch.load(cache_saved_at_ten.out), cache_saved_at_ten.output
    program, batches = make("adagrad", 1, 20, cache_rows=None, sparse_tables=True)
    expected = program.train_unsplit(20, feeds(batches))[1]
    assert result["state"].keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(result["state"][key], value), key
    for counters in result["counters"].values():
        assert counters["evictions"] > 0 and 0 < counters["hit_rate"] < 1
    assert "hit rate" in output  # shown in worker 0's progress


@pytest.mark.parametrize("kind, workers, says", [
    # Two workers, staleness 1: the step before pulls the batch's missing rows.
    ("ids", 2, r"StepFailed: \[worker \d\] step 3: .*CacheError: table '\S+' has 400 rows "
               r"\(ids 0-399\) but the batch looks up id 1000000"),
    ("type", 1, r"SplitrunError: step\(\) takes the batch as a tensor, a sequence of tensors "
                r"or a dict of feeds, got str"),
    ("raises", 1, r"ValueError: the data of batch 3 cannot be read")])
def test_a_bad_batch_is_named_at_its_own_step_though_run_reads_it_ahead(local_cluster, kind,
                                                                        workers, says):
    # trainer.run takes the next batch while a step runs (the cache prefetches
    # its rows): a bad one must still fail at its own step, as in a loop of step().
    proc = local_cluster.launch(CACHE_JOB, "--steps", 6, "--max-staleness", 1,
                                "--bad-batch-at", 3, "--bad-batch", kind, workers=workers,
                                servers=1)
    assert proc.wait(JOB_TIMEOUT_S) == 1, proc.output()
    # Every worker's shard holds the bad batch: either may be named.
    assert re.search(rf"worker \d \(pid \d+\) exited with code 1 at step 3: {says}",
                     proc.lines[-1]), proc.output()


def test_two_workers_equal_parameter_server_mode(launch):
    result, _ = launch("run", 2, 2, "--steps", 20, "--policy", "lfu")
    program, batches = make("adagrad", 2, 20, cache_rows=None, sparse_tables=True)
    split_prog = split_program(program, Cluster(2, 2), ParameterServerMode())
    expected = run_threaded(split_prog, 20, feeds(batches)).state
    for key, value in expected.items():
        assert torch.equal(result["state"][key], value), key


def test_save_writes_dirty_rows_back_and_resumes_with_other_servers(launch, cache_saved_at_ten):
    checkpoint = cache_saved_at_ten.plain  # 1 worker, 2 servers, after step 10 of 20
    saved = torch.load(checkpoint, weights_only=True)
    program, batches = make("adagrad", 1, 10, cache_rows=None, sparse_tables=True)
    at_ten = program.train_unsplit(10, feeds(batches))[1]
    # The checkpoint holds the whole, current tables: every dirty row came back.
    for key in ("tables.0.weight", "tables.1.weight"):
        assert torch.equal(saved["model"][key], at_ten[key])
    resumed, _ = launch("resumed", 1, 1, "--steps", 20, "--resume", checkpoint)
    straight = torch.load(cache_saved_at_ten.out)  # the run that saved it, on to step 20
    for key, value in straight["state"].items():
        assert torch.equal(resumed["state"][key], value), key


def test_dense_on_workers_and_fused_bags_through_the_launcher(launch, tmp_path):
    """Sum bags (FBGEMM's fused SGD), dense parameters on the workers: one
    worker equals the unsplit step bit for bit (the servers only serve rows);
    two workers equal the threaded run, and a sharded checkpoint of theirs
    resumes with one server to the same end."""
    sum_bags = ("--model", "sum_bags", "--dense", "worker", "--optimizer", "sgd",
                "--cache-rows", 48)
    result, _ = launch("one", 1, 2, "--steps", 20, *sum_bags)
    program, batches = make_sum_bags("sgd", 1, 20, cache_rows=None, dense_on_servers=False)
    expected = program.train_unsplit(20, feeds(batches))[1]
    assert result["state"].keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(result["state"][key], value), key
    checkpoint = tmp_path / "step10"
    two, _ = launch("two", 2, 2, "--steps", 20, "--save-at", 10, "--save", checkpoint,
                    *sum_bags)
    program, batches = make_sum_bags("sgd", 2, 20, cache_rows=48, dense_on_servers=False)
    split_prog = split_program(program, Cluster(2, 2), EmbeddingCacheMode(dense="worker"))
    threaded = run_threaded(split_prog, 20, feeds(batches)).state
    for key, value in threaded.items():
        assert torch.equal(two["state"][key], value), key
    # Saved after step 10 by the run above, which trained on to step 20.
    resumed, _ = launch("resumed", 2, 1, "--steps", 20, "--resume", checkpoint, *sum_bags)
    for key, value in two["state"].items():
        assert torch.equal(resumed["state"][key], value), key


def test_lazy_rows_through_the_launcher_equal_the_unsplit_step_and_reshard(launch, tmp_path):
    """Rows from a row initializer, made by the servers as first pulled (the
    model's own tables NaN): SGD on 1 worker and 2 servers equals the unsplit
    step from `whole_table(init, ...)` bit for bit; its sharded checkpoint
    (written by the servers, every row of each shard) resumes on 3 servers to
    the same end."""
    directory = tmp_path / "step10"
    lazy = ("--optimizer", "sgd", "--cache-rows", 40, "--lazy-rows")
    result, _ = launch("lazy", 1, 2, "--steps", 20, "--save-at", 10, "--save", directory,
                       *lazy)
    program, batches = make("sgd", 1, 20, cache_rows=None, sparse_tables=True, lazy_rows=True)
    expected = program.train_unsplit(20, feeds(batches))[1]
    assert result["state"].keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(result["state"][key], value), key
    resumed, _ = launch("lazy_resumed", 1, 3, "--steps", 20, "--resume", directory, *lazy)
    for key, value in expected.items():
        assert torch.equal(resumed["state"][key], value), key


def test_tables_on_the_meta_device_through_the_launcher_equal_the_unsplit_step(launch):
    """No process builds the tables: the model's are on `meta`, each server
    makes its own rows from the initializer; SGD on 1 worker and 2 servers
    equals the unsplit step from `whole_table(init, ...)` bit for bit."""
    result, _ = launch("meta", 1, 2, "--steps", 12, "--optimizer", "sgd", "--cache-rows", 40,
                       "--lazy-rows", "--meta-tables")
    program, batches = make("sgd", 1, 12, cache_rows=None, sparse_tables=True, lazy_rows=True)
    expected = program.train_unsplit(12, feeds(batches))[1]
    assert result["state"].keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(result["state"][key], value), key


def test_tables_past_the_gather_limit_come_back_as_views_of_the_final_checkpoint(launch,
                                                                                 tmp_path):
    """`finish(save_to=DIR, gather_tables_up_to=0)`: no table is gathered;
    worker 0 gets each table and its Adagrad sums as a `ShardedTable` over
    the sharded checkpoint the workers just saved, whose rows (read by id or
    whole) equal the unsplit step's; the dense parameters come whole."""
    directory = tmp_path / "final"
    result, _ = launch("viewed", 1, 2, "--steps", 12, "--finish-to", directory,
                       "--gather-up-to", 0)
    program, batches = make("adagrad", 1, 12, cache_rows=None, sparse_tables=True)
    expected = program.train_unsplit(12, feeds(batches))[1]
    tables = sorted(key for key in expected if key.startswith("tables."))
    assert result["views"] == tables and len(tables) > 2  # each table and its sums
    assert result["state"].keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(result["state"][key], value), key
    probe = torch.tensor([[3, 0, 3], [17, 1, 2]])  # cache_job.PROBE_IDS
    for key in tables:
        assert torch.equal(result["probed"][key], expected[key][probe]), key
    assert (directory / ".metadata").exists()
