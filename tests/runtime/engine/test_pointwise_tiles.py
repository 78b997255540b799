"""Elementwise chains run tile by tile: the same bits as op by op.

Tiles are shrunk to 64 elements so the small test models' updates tile (with
parameters of 370 and 1 369 elements: full tiles and a ragged last one).
"""

import ps_models
import pytest
import torch
from ps_models import feeds, make
from torch import fx

from splitrun.runtime import run_threaded
from splitrun.runtime.engine import tiles as pointwise_tiles
from splitrun.runtime.engine.tiles import TiledRun, find_tiled_runs
from splitrun.splitter import Cluster, ParameterServerMode, optim, split_program

_aten = torch.ops.aten
TILE = 64
WIDTH = 37
STEPS = 4

# foreach=False: the single-tensor chains, which are what runs tile by tile.
OPTIMIZERS = {
    "sgd_momentum_decay": lambda: optim.SGD(lr=0.1, momentum=0.9, weight_decay=1e-3,
                                            foreach=False),
    "sgd_nesterov_maximize": lambda: optim.SGD(lr=0.1, momentum=0.9, nesterov=True,
                                               maximize=True, foreach=False),
    "sgd_dampening": lambda: optim.SGD(lr=0.1, momentum=0.9, dampening=0.3, foreach=False),
    "adam": lambda: optim.Adam(lr=0.01, weight_decay=1e-2, foreach=False),
    "adamw": lambda: optim.AdamW(lr=0.01, foreach=False),
    "adagrad": lambda: optim.Adagrad(lr=0.1, lr_decay=0.01, foreach=False),
}


@pytest.fixture
def small_tiles(monkeypatch):
    monkeypatch.setattr(pointwise_tiles, "TILE_ELEMENTS", TILE)
    monkeypatch.setattr(pointwise_tiles, "MIN_TILED_ELEMENTS", 2 * TILE)
    calls = []
    run = TiledRun.run

    def counted(self, env):
        calls.append(tuple(self.names))
        return run(self, env)
    monkeypatch.setattr(TiledRun, "run", counted)
    return calls


def _train(name, monkeypatch, *, tiled, state=None):
    monkeypatch.setitem(ps_models.OPTIMIZERS, name, OPTIMIZERS[name])
    program, batches = make("dense", name, 2, STEPS, width=WIDTH)
    if not tiled:
        monkeypatch.setattr(pointwise_tiles, "MIN_TILED_ELEMENTS", 1 << 62)
    split = split_program(program, Cluster(2, 1), ParameterServerMode())
    run = run_threaded(split, STEPS, feeds(batches), state=state, recv_timeout_s=30)
    return run, program


def _assert_same_bits(a, b):
    assert a.state.keys() == b.state.keys()
    for key, value in a.state.items():
        assert torch.equal(b.state[key], value), key


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_tiled_updates_equal_op_by_op_bit_for_bit(name, small_tiles, monkeypatch):
    tiled, program = _train(name, monkeypatch, tiled=True)
    # The server's two large parameters (10x37 and 37x37) update in tiles every step.
    assert len(small_tiles) >= 2 * STEPS, small_tiles
    assert any(len(names) >= 4 for names in small_tiles), "whole update chains, not single ops"
    calls = len(small_tiles)
    untiled, _ = _train(name, monkeypatch, tiled=False)
    assert len(small_tiles) == calls, "the baseline must run op by op"
    _assert_same_bits(untiled, tiled)
    assert not torch.equal(tiled.state["body.2.weight"], program.initial_state["body.2.weight"])


def test_a_non_contiguous_input_runs_op_by_op_with_the_same_bits(small_tiles, monkeypatch):
    program, _ = make("dense", "sgd_momentum", 2, 1, width=WIDTH)
    state = dict(program.initial_state)
    weight = state["body.2.weight"]
    state["body.2.weight"] = weight.t().contiguous().t()  # same values, other strides
    assert not state["body.2.weight"].is_contiguous()
    monkeypatch.setitem(OPTIMIZERS, "sgd_momentum", ps_models.OPTIMIZERS["sgd_momentum"])
    mixed, _ = _train("sgd_momentum", monkeypatch, tiled=True, state=state)
    plain, _ = _train("sgd_momentum", monkeypatch, tiled=False, state=program.initial_state)
    _assert_same_bits(plain, mixed)


def _graph(shape, ops):
    """A graph of placeholders `a`, `b` (of `shape`) and `lr` (0-dim), then
    `ops`: (name, aten op, argument names or constants)."""
    graph = fx.Graph()
    values = {}
    for name, value_shape in (("a", shape), ("b", shape), ("lr", ())):
        values[name] = graph.placeholder(name)
        values[name].meta["val"] = torch.empty(value_shape, device="meta")
    for name, op, args in ops:
        node = graph.call_function(op, tuple(values.get(a, a) if isinstance(a, str) else a
                                             for a in args))
        node.name = name
        fake = [values[a].meta["val"] if isinstance(a, str) else a for a in args]
        node.meta["val"] = op(*fake)
        values[name] = node
    return graph, values


def test_runs_are_cut_at_other_shapes_and_at_ops_that_are_not_elementwise(small_tiles):
    shape = (16, 40)  # 640 elements
    graph, v = _graph(shape, [
        ("s", _aten.add.Tensor, ("a", "b")),
        ("m", _aten.mul.Tensor, ("s", 0.5)),
        ("total", _aten.sum.default, ("m",)),        # a reduction ends the run
        ("n", _aten.neg.default, ("lr",)),           # a scalar op before the run: left out
        ("u", _aten.mul.Tensor, ("n", "a")),
        ("w", _aten.add.Tensor, ("u", "b")),
        ("r", _aten.view.default, ("w", [640])),     # not elementwise
        ("x", _aten.mul.Tensor, ("r", 2.0)),         # another shape: a run of one op
    ])
    schedule = [v[name] for name in ("s", "m", "total", "n", "u", "w", "r", "x")]
    runs = find_tiled_runs(schedule, lambda name, i: False)
    assert [(first, last, run.names) for first, last, run in runs] == [
        (0, 1, ["s", "m"]), (4, 5, ["u", "w"])]


def test_a_tiled_run_keeps_only_what_is_read_later_and_equals_op_by_op(small_tiles):
    torch.manual_seed(0)
    shape = (33, 41)  # 1 353 elements: 21 tiles of 64 and a ragged one
    graph, v = _graph(shape, [
        ("s", _aten.add.Tensor, ("a", "b")),
        ("d", _aten.div.Tensor, ("s", 3)),
        ("n", _aten.neg.default, ("lr",)),
        ("u", _aten.addcmul.default, ("d", "a", "b")),
        ("w", _aten.lerp.Scalar, ("u", "a", 0.25)),
    ])
    schedule = [v[name] for name in ("s", "d", "n", "u", "w")]
    [(first, last, run)] = find_tiled_runs(schedule, lambda name, i: name in ("d", "w"))
    a, b, lr = torch.randn(shape), torch.randn(shape), torch.tensor(0.1)
    assert (first, last) == (0, 4) and set(run.keep) == {"d", "w"}
    assert not run.can_tile({"a": a.t().contiguous().t(), "b": b, "lr": lr})
    assert not run.can_tile({"a": a[:, :40], "b": b, "lr": lr})
    assert not run.can_tile({"a": a.double(), "b": b, "lr": lr})
    assert run.can_tile({"a": a, "b": b, "lr": lr})
    env = {"a": a, "b": b, "lr": lr}
    run.run(env)
    assert small_tiles == [("s", "d", "n", "u", "w")]
    d = _aten.div.Tensor(_aten.add.Tensor(a, b), 3)
    w = _aten.lerp.Scalar(_aten.addcmul.default(d, a, b), a, 0.25)
    assert torch.equal(env["d"], d) and torch.equal(env["w"], w)
    assert torch.equal(env["n"], -lr)
    assert "s" not in env and "u" not in env, "intermediates stay in tile-sized scratch"
