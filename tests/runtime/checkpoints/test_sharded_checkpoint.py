"""Sharded checkpoint directories in one process: written by several writers
(as processes write them), read back piece by piece with another cut, exported
to a plain file that plain PyTorch loads, and refused with one line naming the
file when corrupt, incomplete or of another model; a restart picks the newest
complete periodic one; a table's rows read by id (`ShardedTable`)."""

import os
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from splitrun.runtime.checkpoints import sharded as sc
from splitrun.runtime.checkpoints.periodic import latest_checkpoint, periodic_path, prune_periodic
from splitrun.runtime.checkpoints.plain import load_checkpoint
from splitrun.runtime.engine.embedding.sharding import RowSharding
from splitrun.runtime.engine.embedding.store import LocalRows, RowsToWrite
from splitrun.runtime.errors import CheckpointError, SplitrunError
from splitrun.runtime.job.trainer import _check_finish_arguments
from splitrun.splitter import capture, optim

TABLE = "0.weight"  # stands for a row-sharded table here: 8 rows of 6
TABLE_KEYS = (TABLE, f"{TABLE}.exp_avg", f"{TABLE}.exp_avg_sq")


def net(width=8):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, width), nn.Tanh(), nn.Linear(width, 3))


def trained(width=8, steps=3):
    loss_fn = lambda m, x, y: F.cross_entropy(m(x), y)  # noqa: E731
    generator = torch.Generator().manual_seed(3)
    data = [(torch.randn(10, 6, generator=generator),
             torch.randint(0, 3, (10,), generator=generator)) for _ in range(steps)]
    program = capture(net(width), loss_fn, optim.Adam(lr=0.01), data[0])
    _, state = program.train_unsplit(
        steps, lambda s: {"batch.0": data[s][0], "batch.1": data[s][1]})
    return program, state


def hash_order(num_rows):
    """Some permutation of the rows, as the servers' hash order is."""
    return torch.randperm(num_rows, generator=torch.Generator().manual_seed(7))


def write(directory, program, state, step=3, *, rows=False, made_later=None):
    """As a job writes it: "w0" the step, param groups and a part of each
    tensor, "s0" the rest; with `rows`, the table in hash order by two
    servers (each rows tensor passed through `made_later`, if given: a
    server's rows made as they are written). Returns the ids in hash order."""
    made_later = made_later or (lambda value: value)
    paths = sc.state_paths(program)
    objects, counts = sc.driver_objects(program, step, {"cluster": "test"})
    w0, s0, table = list(counts), [], {}
    for key, value in state.items():
        if rows and key in TABLE_KEYS:
            continue
        if value.dim() and value.shape[0] > 1:  # cut along rows between two writers
            half = value.shape[0] // 2
            w0.append(sc.Piece(paths[key], tuple(value.shape), (0,) * value.dim(), value[:half]))
            s0.append(sc.Piece(paths[key], tuple(value.shape), (half,) + (0,) * (value.dim() - 1),
                               value[half:]))
        else:
            s0.append(sc.Piece.whole(paths[key], value))
    ids = hash_order(state[TABLE].shape[0])
    if rows:
        for name, (first, end) in (("s0-rows", (0, 3)), ("s1-rows", (3, 8))):
            pieces = [sc.Piece(sc.ids_path(TABLE), (8,), (first,), ids[first:end])]
            pieces += [sc.Piece(sc.row_paths(TABLE, paths[key]), (8, 6), (first, 0),
                                made_later(state[key][ids[first:end]])) for key in TABLE_KEYS]
            table[name] = sc.write_pieces(directory, name, pieces)
    sc.start_checkpoint(directory)
    reports = {"w0": sc.write_pieces(directory, "w0", w0, objects),
               "s0": sc.write_pieces(directory, "s0", s0), **table}
    sc.finish_checkpoint(directory, reports)
    return ids


def test_pieces_of_several_writers_load_back_whole(tmp_path):
    program, state = trained()
    write(tmp_path / "ckpt", program, state)
    loaded, step = sc.load_state(program, tmp_path / "ckpt", state.keys())
    assert step == 3
    for key, value in state.items():
        assert torch.equal(loaded[key], value), key


def test_writes_that_fail_are_one_checkpoint_error_naming_the_directory(tmp_path):
    program, state = trained()
    taken = tmp_path / "a-file"
    taken.write_text("not a directory")
    with pytest.raises(CheckpointError, match=rf"^checkpoint {taken}/ckpt: cannot write it: "
                                              rf"Not a directory"):
        sc.start_checkpoint(taken / "ckpt")
    piece = sc.Piece.whole(sc.state_paths(program)["2.bias"], state["2.bias"])
    with pytest.raises(CheckpointError, match=rf"^checkpoint {taken} \(w0's part\): cannot "
                                              rf"write it: "):
        sc.write_pieces(taken, "w0", [piece])


def test_a_process_reads_only_its_own_keys(tmp_path):
    program, state = trained()
    write(tmp_path / "ckpt", program, state)
    loaded, _ = sc.load_state(program, tmp_path / "ckpt", ["2.bias"])
    assert torch.equal(loaded["2.bias"], state["2.bias"])
    assert torch.equal(loaded["0.weight"], program.initial_state["0.weight"])


def test_a_region_is_read_across_the_pieces_that_hold_it(tmp_path):
    program, state = trained()
    write(tmp_path / "ckpt", program, state)  # rows 0-3 by one writer, 4-7 by another
    region = ((2, 1), (4, 3))                  # rows 2-5, columns 1-3
    loaded, _ = sc.load_state(program, tmp_path / "ckpt", ["0.weight"],
                              regions={"0.weight": region})
    inside = loaded["0.weight"][2:6, 1:4]
    assert torch.equal(inside, state["0.weight"][2:6, 1:4])
    outside = loaded["0.weight"].clone()
    outside[2:6, 1:4] = program.initial_state["0.weight"][2:6, 1:4]
    assert torch.equal(outside, program.initial_state["0.weight"])


@pytest.mark.parametrize("num_servers", [1, 2, 3])
def test_rows_in_hash_order_reshard_to_any_number_of_servers(tmp_path, num_servers):
    program, state = trained()
    ids = write(tmp_path / "ckpt", program, state, rows=True)
    bounds = [k * 8 // num_servers for k in range(num_servers + 1)]
    for server in range(num_servers):
        first, end = bounds[server], bounds[server + 1]
        rows = sc.RowRange(TABLE, TABLE_KEYS, first, end, ids[first:end])
        loaded, _ = sc.load_state(program, tmp_path / "ckpt", [], [rows])
        for key in TABLE_KEYS:  # this server's rows only, in its local order: no whole table
            mine = ids[first:end]
            assert isinstance(loaded[key], LocalRows) and loaded[key].first_row == first, key
            assert torch.equal(loaded[key].values, state[key][mine]), key


def test_rows_saved_in_hash_order_load_whole_in_another_mode(tmp_path):
    program, state = trained()
    write(tmp_path / "ckpt", program, state, rows=True)
    loaded, _ = sc.load_state(program, tmp_path / "ckpt", TABLE_KEYS)
    for key in TABLE_KEYS:
        assert torch.equal(loaded[key], state[key]), key


def test_rows_made_as_written_are_made_one_at_a_time_and_load_back(tmp_path):
    """A server's rows go into the checkpoint as `RowsToWrite`: each is made
    when its file is written, after the one before was written and freed."""
    program, state = trained()
    held_when_made, alive = [], weakref.WeakSet()

    def made_later(value):
        def make():
            held_when_made.append(len(alive))
            copy = value.clone()
            alive.add(copy)
            return copy
        return RowsToWrite(tuple(value.shape), value.dtype, make)

    write(tmp_path / "ckpt", program, state, rows=True, made_later=made_later)
    assert held_when_made == [0] * (2 * len(TABLE_KEYS))
    loaded, _ = sc.load_state(program, tmp_path / "ckpt", TABLE_KEYS)
    for key in TABLE_KEYS:
        assert torch.equal(loaded[key], state[key]), key


@pytest.mark.parametrize("rows", [False, True])
def test_export_loads_into_a_plain_model_and_optimizer(tmp_path, rows):
    program, state = trained()
    write(tmp_path / "ckpt", program, state, rows=rows)
    sc.export_checkpoint(tmp_path / "ckpt", tmp_path / "model.pt")
    plain = torch.load(tmp_path / "model.pt", weights_only=True)
    assert plain["step"] == 3 and (tmp_path / "model.pt.sha256").exists()
    model = net()
    model.load_state_dict(plain["model"])  # strict: every key, every shape
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    optimizer.load_state_dict(plain["optimizer"])
    for key, param in model.named_parameters():
        assert torch.equal(param.detach(), state[key]), key
    moments = optimizer.state[model[0].weight]
    assert torch.equal(moments["exp_avg"], state["0.weight.exp_avg"])
    assert float(moments["step"]) == 3.0
    # The exported file is also a checkpoint splitrun resumes from.
    resumed, step = load_checkpoint(program, tmp_path / "model.pt")
    assert step == 3 and all(torch.equal(resumed[k], v) for k, v in state.items())


def test_dcp_itself_reads_the_directory(tmp_path):
    program, state = trained()
    write(tmp_path / "ckpt", program, state)
    dcp_to_torch_save(tmp_path / "ckpt", tmp_path / "dcp.pt")
    converted = torch.load(tmp_path / "dcp.pt", weights_only=True)
    assert converted["step"] == 3
    for key, value in converted["model"].items():
        assert torch.equal(value, state[key]), key


# -- refused --

def refused(program, directory, keys=None) -> str:
    with pytest.raises(CheckpointError) as info:
        sc.load_state(program, directory, program.initial_state.keys() if keys is None else keys)
    message = str(info.value)
    assert "\n" not in message and str(directory) in message, message
    return message


@pytest.fixture
def saved(tmp_path):
    program, state = trained()
    write(tmp_path / "ckpt", program, state)
    return program, tmp_path / "ckpt"


def test_a_flipped_byte_in_a_shard_is_refused_naming_the_file(saved):
    program, directory = saved
    shard = directory / "__s0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    assert "__s0_0.distcp is corrupt" in refused(program, directory)


def test_missing_metadata_is_refused(saved):
    program, directory = saved
    (directory / sc.METADATA).unlink()
    assert ".metadata is missing" in refused(program, directory)


def test_a_save_that_did_not_complete_is_refused(saved):
    program, directory = saved
    (directory / sc.CHECKSUMS).unlink()
    assert "the save did not complete" in refused(program, directory)


def test_a_shard_not_gathered_is_refused_naming_it(saved):
    program, directory = saved
    (directory / "__s0_0.distcp").unlink()
    message = refused(program, directory)
    assert "__s0_0.distcp is missing" in message and "gather" in message


def test_a_checkpoint_of_another_model_is_refused_naming_the_tensor(saved):
    _, directory = saved
    other, _ = trained(width=16)
    message = refused(other, directory)
    assert "'0.bias' is float32[8], the model has float32[16]" in message


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_plain_dcp_directory_is_refused(tmp_path):
    import torch.distributed.checkpoint as dcp
    dcp.save({"x": torch.zeros(2)}, checkpoint_id=tmp_path / "dcp", no_dist=True)
    program, _ = trained()
    assert "no checksums.sha256" in refused(program, tmp_path / "dcp")


def test_export_refuses_a_corrupt_directory(saved, tmp_path):
    _, directory = saved
    shard = directory / "__w0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=r"__w0_0.distcp is corrupt"):
        sc.export_checkpoint(directory, tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()


def test_a_restart_resumes_from_the_newest_complete_periodic_checkpoint(tmp_path):
    """`--checkpoint-every`'s directories: a restart skips the newest one, cut
    short (no checksums.sha256), and one altered since, for the newest good
    one; pruning keeps the newest two complete ones and any newer, removes older."""
    program, state = trained()
    for step in (10, 20, 30, 40):
        write(periodic_path(tmp_path, step), program, state, step)
    (tmp_path / "step-000000040" / sc.CHECKSUMS).unlink()
    shard = tmp_path / "step-000000030" / "__s0_0.distcp"
    shard.write_bytes(shard.read_bytes()[::-1])
    assert latest_checkpoint(tmp_path) == (periodic_path(tmp_path, 20), 20)
    loaded, step = sc.load_state(program, latest_checkpoint(tmp_path)[0], state.keys())
    assert step == 20 and all(torch.equal(loaded[k], v) for k, v in state.items())
    prune_periodic(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["step-000000020", "step-000000030",
                                            "step-000000040"]


# -- ShardedTable: a table's rows read by id, as finish() hands a large one back --


def write_rows(directory, program, state, num_servers=3, ids=None):
    """The table's rows as the servers write them: in the hash order of
    `RowSharding`, each server its contiguous slice (or in the order `ids`)."""
    paths = sc.state_paths(program)
    num_rows = state[TABLE].shape[0]
    order = RowSharding(num_rows, 1).ids_of(0) if ids is None else ids
    objects, counts = sc.driver_objects(program, 3, {"cluster": "test"})
    w0 = list(counts) + [sc.Piece.whole(paths[key], value) for key, value in state.items()
                         if key not in TABLE_KEYS]
    reports = {}
    bounds = [k * num_rows // num_servers for k in range(num_servers + 1)]
    for server in range(num_servers):
        first, end = bounds[server], bounds[server + 1]
        pieces = [sc.Piece(sc.ids_path(TABLE), (num_rows,), (first,), order[first:end])]
        pieces += [sc.Piece(sc.row_paths(TABLE, paths[key]), tuple(state[key].shape),
                            (first, 0), state[key][order[first:end]]) for key in TABLE_KEYS]
        reports[f"s{server}-rows"] = sc.write_pieces(directory, f"s{server}-rows", pieces)
    sc.start_checkpoint(directory)
    reports["w0"] = sc.write_pieces(directory, "w0", w0, objects)
    sc.finish_checkpoint(directory, reports)


def view(directory, program, key):
    return sc.ShardedTable(directory, TABLE, sc.state_paths(program)[key])


def test_rows_read_by_id_equal_the_saved_table_whatever_the_servers(tmp_path):
    program, state = trained()
    for num_servers in (1, 2, 3):
        directory = tmp_path / f"on{num_servers}"
        write_rows(directory, program, state, num_servers)
        for key in TABLE_KEYS:
            table = view(directory, program, key)
            assert table.shape == tuple(state[key].shape) and table.dtype == state[key].dtype
            ids = torch.tensor([[7, 0, 7], [3, 3, 1]], dtype=torch.int32)  # repeats, any shape
            assert torch.equal(table[ids], state[key][ids.long()]), key
            assert table[torch.tensor([], dtype=torch.int64)].shape == (0, 6)
            assert torch.equal(table.load(), state[key]), key


@pytest.mark.parametrize("ids, says", [
    (torch.tensor([2, 8]), r"id 8 is outside the table's 8 rows \(ids 0-7\)"),
    (torch.tensor([-1]), r"id -1 is outside the table's 8 rows \(ids 0-7\)"),
    (torch.tensor([1.0]), r"rows are read by an integer tensor of ids, got a float32 tensor"),
    ([1, 2], r"rows are read by an integer tensor of ids, got list")])
def test_bad_ids_are_refused_in_one_line(tmp_path, ids, says):
    program, state = trained()
    write_rows(tmp_path / "ckpt", program, state)
    with pytest.raises(CheckpointError, match=rf"ShardedTable\('{TABLE}', .*\): {says}$"):
        view(tmp_path / "ckpt", program, TABLE)[ids]


def test_rows_stored_in_another_order_are_refused_not_read_wrong(tmp_path):
    program, state = trained()
    write_rows(tmp_path / "ckpt", program, state, ids=torch.arange(8))
    with pytest.raises(CheckpointError, match=r"the ids stored with the rows are not in the "
                                              r"servers' hash order"):
        view(tmp_path / "ckpt", program, TABLE)[torch.tensor([1])]


def test_a_tensor_that_is_no_table_is_named(tmp_path):
    program, state = trained()
    write_rows(tmp_path / "ckpt", program, state)
    with pytest.raises(CheckpointError, match=r"holds no rows of table '2.bias' at "
                                              r"'model.2.bias'"):
        sc.ShardedTable(tmp_path / "ckpt", "2.bias", ("model", "2.bias"))


@pytest.mark.parametrize("save_to, limit, says", [
    (None, 0, r"give save_to=<a directory> \(got None\)"),
    ("final.pt", 10, r"give save_to=<a directory> \(got 'final.pt'\)"),
    ("final", -1, r"a size in bytes >= 0, got -1"),
    ("final", True, r"a size in bytes >= 0, got True")])
def test_finish_refuses_a_gather_limit_without_a_directory(save_to, limit, says):
    with pytest.raises(SplitrunError, match=says):
        _check_finish_arguments(save_to, limit)
