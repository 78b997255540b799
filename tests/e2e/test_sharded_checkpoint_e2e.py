"""Sharded checkpoints end to end: real launcher, real processes. A job saved
with two servers (every process writing its own files) resumes with one and
with three, and ends where the uninterrupted job ends; `splitrun export`
turns the directory into a plain file a plain model loads."""

import shutil

import pytest
import torch
from cache_models import TinyRecommender
from cache_models import feeds as cache_feeds
from cache_models import make as make_cache
from cluster import JOB_TIMEOUT_S, SCRIPTS, splitrun
from parallel_models import capture_mlp, mlp_batches
from ps_models import DenseNet
from ps_models import feeds as ps_feeds
from ps_models import make as make_ps
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from splitrun.launcher import cli
from splitrun.runtime.checkpoints.sharded import CHECKSUMS, METADATA, ShardedCheckpoint

PS_JOB = SCRIPTS / "ps_job.py"
CACHE_JOB = SCRIPTS / "cache_job.py"
PARALLEL_JOB = SCRIPTS / "parallel_job.py"


@pytest.fixture
def launch(local_cluster, tmp_path):
    """Runs a job script through the launcher; returns what worker 0 wrote to --out."""
    def launch(script, name, workers, servers, *args):
        out = tmp_path / f"{name}.pt"
        local_cluster.run(script, *args, "--out", out, workers=workers, servers=servers)
        return torch.load(out)
    return launch


@pytest.fixture
def export(capsys):
    """`splitrun export DIRECTORY OUT`, run in this process (the command's own
    function; `python -m splitrun` as a process is tests/launcher/test_cli_options.py's):
    returns its exit status and what it wrote to stderr."""
    def export(directory, out):
        capsys.readouterr()
        code = cli.main(["export", str(directory), str(out)])
        return code, capsys.readouterr().err
    return export


def data_files(directory) -> list[str]:
    """The writers' names of the checkpoint's data files (`__NAME_0.distcp`)."""
    lines = (directory / CHECKSUMS).read_text().split("\n")
    names = [line.split()[1] for line in lines if line.strip()]
    return [name.removeprefix("__").rsplit("_", 1)[0] for name in names if name != METADATA]


def written_by(directory) -> set[str]:
    """The processes whose data files the checkpoint lists (a server's rows
    of each table and row state are files of their own, `s0-rows.N`)."""
    return {name.split(".", 1)[0] for name in data_files(directory)}


def assert_equal_states(got, expected, atol):
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=atol, msg=key)


def test_ps_saved_with_two_servers_resumes_with_one_and_three(launch, ps_saved_at_ten,
                                                               uninterrupted_ps_job, export,
                                                               tmp_path):
    _, directory = ps_saved_at_ten  # 2 workers, 2 servers, after step 10 of 20
    assert written_by(directory) == {"w0", "s0", "s1"}, "each server wrote its own file"
    # The run that saved it, launched once for this test and tests/e2e/test_ps_e2e.py's.
    straight = uninterrupted_ps_job("dense", "adam", steps=20, workers=2, servers=2)
    for servers in (1, 3):
        resumed = launch(PS_JOB, f"resumed{servers}", 2, servers, "--steps", 20,
                         "--resume", directory)
        assert resumed["steps"] == 20
        assert_equal_states(resumed["state"], straight["state"], atol=1e-6)

    # Export: one plain file that a plain model and optimizer load.
    out = tmp_path / "model.pt"
    code, stderr = export(directory, out)
    assert code == 0, stderr
    plain = torch.load(out, weights_only=True)
    assert plain["step"] == 10
    model = DenseNet()
    model.load_state_dict(plain["model"])  # strict: every key, every shape
    torch.optim.Adam(model.parameters(), lr=0.01).load_state_dict(plain["optimizer"])
    full, batches = make_ps("dense", "adam", 1, 10)
    at_ten = full.train_unsplit(10, ps_feeds(batches))[1]
    for key, param in model.named_parameters():
        torch.testing.assert_close(param.detach(), at_ten[key], rtol=0, atol=1e-5, msg=key)


def test_cache_saved_with_two_servers_resumes_with_one_and_three(launch, export,
                                                                  cache_saved_at_ten, tmp_path):
    directory = cache_saved_at_ten.sharded  # 1 worker, 2 servers, after step 10 of 20
    assert written_by(directory) == {"w0", "s0", "s1", "s0-rows", "s1-rows"}
    # Each server's ids in one file, then its rows of each table and their
    # Adagrad sums one file each: made as they are written.
    per_server = 2 * len(make_cache("adagrad", 1, 1)[0].cached_tables)
    assert sorted(data_files(directory)) == sorted(
        ["w0", "s0", "s1", "s0-rows", "s1-rows"]
        + [f"s{rank}-rows.{n}" for rank in (0, 1) for n in range(1, per_server + 1)])
    # One worker: the uninterrupted job equals whole-table training bit for bit
    # (test_cache_e2e), so the resumed ones are compared with that.
    program, batches = make_cache("adagrad", 1, 20, cache_rows=None, sparse_tables=True)
    history = program.train_unsplit(20, cache_feeds(batches))[1]
    for servers in (1, 3):
        resumed = launch(CACHE_JOB, f"resumed{servers}", 1, servers, "--steps", 20,
                         "--resume", directory)
        assert resumed["state"].keys() == history.keys()
        for key, value in history.items():
            assert torch.equal(resumed["state"][key], value), key

    # Export puts the rows back in id order, dirty rows written back included.
    out = tmp_path / "model.pt"
    code, stderr = export(directory, out)
    assert code == 0, stderr
    plain = torch.load(out, weights_only=True)
    at_ten = program.train_unsplit(10, cache_feeds(batches))[1]
    model = TinyRecommender()
    model.load_state_dict(plain["model"])
    for key, param in model.named_parameters():
        assert torch.equal(param.detach(), at_ten[key]), key


def test_a_corrupt_directory_is_refused_by_resume_and_export(local_cluster, ps_saved_at_ten,
                                                             export, tmp_path):
    directory = tmp_path / "ckpt"
    shutil.copytree(ps_saved_at_ten[1], directory)  # the shared one stays intact
    shard = directory / "__s1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    code, stderr = export(directory, tmp_path / "model.pt")
    assert code == 1
    assert "__s1_0.distcp is corrupt" in stderr, stderr
    # Resumed with one server, server 0 reads that file and stops the job naming it.
    proc = local_cluster.launch(PS_JOB, "--steps", 20, "--resume", directory, workers=1,
                                servers=1)
    assert proc.wait(JOB_TIMEOUT_S) != 0
    assert "CheckpointError" in proc.output() and "__s1_0.distcp is corrupt" in proc.output()


def test_parallel_saved_at_four_workers_resumes_at_two(local_cluster, parallel_saved_at_five,
                                                       tmp_path):
    _, directory = parallel_saved_at_five  # 4 workers, 5 steps (shared with a plain test)
    assert written_by(directory) == {"w0", "w1", "w2", "w3"}
    saved = ShardedCheckpoint(directory).tensor_md(("model", "l1.weight"))
    assert saved.size == (16, 8) and len(saved.chunks) == 4, "one piece per member"
    out = tmp_path / "result.pt"
    local_cluster.run(PARALLEL_JOB, "--steps", 10, "--resume", directory, "--out", out,
                      workers=2)
    result = torch.load(out, weights_only=True)
    _, expected = capture_mlp("adam").train_unsplit(10, mlp_batches(10))
    for key, value in expected.items():
        torch.testing.assert_close(result["state"][key], value, rtol=0, atol=1e-5, msg=key)


def test_each_machine_writes_locally_and_the_files_are_gathered_later(local_cluster, export,
                                                                       tmp_path):
    """Three processes joined from three working directories (as on three
    machines without a shared filesystem) each save into their own `ckpt/`;
    export refuses worker 0's directory until the servers' files are copied in."""
    scheduler, address, token = local_cluster.scheduler(workers=1, servers=2)
    machines = []
    for role, rank in (("worker", 0), ("server", 0), ("server", 1)):
        cwd = tmp_path / f"{role}{rank}"
        cwd.mkdir()
        proc = splitrun("join", "--scheduler", address, "--token-file", token, "--role", role,
                        "--rank", rank, PS_JOB, "--steps", 4, "--save", "ckpt", cwd=cwd)
        local_cluster.procs.append(proc)
        machines.append((cwd / "ckpt", proc))
    for _, proc in machines:
        assert proc.wait(JOB_TIMEOUT_S) == 0, proc.output()
    assert scheduler.wait(30) == 0
    (gathered, _), (server0, _), (server1, _) = machines
    assert sorted(p.name for p in server0.iterdir()) == ["__s0_0.distcp"]
    assert sorted(p.name for p in server1.iterdir()) == ["__s1_0.distcp"]

    code, stderr = export(gathered, tmp_path / "model.pt")
    assert code == 1
    assert "__s0_0.distcp is missing" in stderr and "gather" in stderr
    for part in (server0 / "__s0_0.distcp", server1 / "__s1_0.distcp"):
        shutil.copy(part, gathered)
    code, stderr = export(gathered, tmp_path / "model.pt")
    assert code == 0, stderr
    plain = torch.load(tmp_path / "model.pt", weights_only=True)
    assert plain["step"] == 4
    DenseNet().load_state_dict(plain["model"])


@pytest.mark.parametrize("optimizer", ["adagrad", "adam"])
def test_dcps_own_reader_takes_an_embedding_cache_checkpoint(launch, export, cache_saved_at_ten,
                                                             tmp_path, optimizer):
    # torch.distributed.checkpoint's dcp_to_torch_save on a job with cached
    # tables whose rows carry optimizer state: it reads every tensor, equal to
    # `splitrun export`'s (which puts the tables' rows back in id order).
    if optimizer == "adagrad":  # the shared run's (1 worker, 2 servers, after step 10)
        directory, step = cache_saved_at_ten.sharded, 10
    else:
        directory, step = tmp_path / "ckpt", 4
        launch(CACHE_JOB, optimizer, 1, 2, "--optimizer", optimizer, "--steps", step, "--save",
               directory)
    dcp_to_torch_save(directory, tmp_path / "dcp.pt")
    converted = torch.load(tmp_path / "dcp.pt", weights_only=True)
    code, stderr = export(directory, tmp_path / "plain.pt")
    assert code == 0, stderr
    plain = torch.load(tmp_path / "plain.pt", weights_only=True)
    assert converted["step"] == plain["step"] == step
    # Every tensor of the plain checkpoint is in DCP's, where DCP nests it: the
    # tables and their rows' state under hashed_rows in hash order (with the
    # ids), the optimizer state by the parameter's index as a string.
    found = {("model", key): value for key, value in converted["model"].items()}
    for index, state in converted["optimizer"]["state"].items():
        found.update({("optimizer", int(index), name): value for name, value in state.items()})
    tables = converted["hashed_rows"]
    assert set(tables) == {"tables.0.weight", "tables.1.weight"}
    for table, rows in tables.items():
        in_id_order = {("model", table): rows["model"][table]}
        for index, state in rows["optimizer"]["state"].items():
            in_id_order.update({("optimizer", int(index), name): value
                                for name, value in state.items()})
        for where, hashed in in_id_order.items():
            assert where not in found, where
            found[where] = torch.empty_like(hashed).index_copy_(0, rows["ids"], hashed)
    expected = {("model", key): value for key, value in plain["model"].items()}
    for index, state in plain["optimizer"]["state"].items():
        expected.update({("optimizer", index, name): value for name, value in state.items()})
    assert found.keys() == expected.keys()
    for where, value in expected.items():
        assert torch.equal(found[where], torch.as_tensor(value)), where


def test_dcps_own_reader_takes_the_ps_and_parallel_checkpoints(ps_saved_at_ten,
                                                               parallel_saved_at_five, export,
                                                               tmp_path):
    for name, directory in (("ps", ps_saved_at_ten[1]),
                            ("parallel", parallel_saved_at_five[1])):
        dcp_to_torch_save(directory, tmp_path / f"{name}.dcp.pt")
        converted = torch.load(tmp_path / f"{name}.dcp.pt", weights_only=True)
        code, stderr = export(directory, tmp_path / f"{name}.pt")
        assert code == 0, stderr
        plain = torch.load(tmp_path / f"{name}.pt", weights_only=True)
        assert converted["model"].keys() == plain["model"].keys(), name
        for key, value in plain["model"].items():
            assert torch.equal(converted["model"][key], value), (name, key)
        states = converted["optimizer"]["state"]
        for index, state in plain["optimizer"]["state"].items():
            for key, value in state.items():
                assert torch.equal(torch.as_tensor(states[str(index)][key]),
                                   torch.as_tensor(value)), (name, index, key)
