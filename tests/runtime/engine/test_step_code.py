"""The generated step (`step_code`): its source, its frees, its errors."""

import ast
import inspect
import re
import traceback
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from splitrun.runtime import Executor, LoopbackHub
from splitrun.runtime.errors import StepFailed
from splitrun.splitter import Cluster, Label, capture, optim, split_program
from splitrun.splitter.program import InputKind
from splitrun.splitter.testing import random_program

W0 = Label.worker(0)


def one_worker():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))

    def loss_fn(model, x, y):
        return F.cross_entropy(model(x), y)
    batch = (torch.randn(5, 4), torch.randint(0, 3, (5,)))
    split = split_program(capture(net, loss_fn, optim.SGD(lr=0.1), batch), Cluster(num_workers=1))
    executor = Executor(split.plan, split.program, W0,
                        LoopbackHub(split.plan.labels).transport(W0))
    executor.load_state(split.program.initial_state)
    keys = [spec.key for spec in split.program.inputs if spec.kind is InputKind.BATCH]
    return executor, {**split.program.hparams(0), **dict(zip(keys, batch))}, keys


def _loads(statement) -> set[str]:
    return {n.id for n in ast.walk(statement)
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _check_frees(function: ast.FunctionDef) -> int:
    """Every local value is deleted by the statement right after its last
    read, unless the step returns it; returns how many dels were checked."""
    body = function.body
    returned = _loads(body[-1])
    assigned = {t.id for s in body if isinstance(s, ast.Assign) for target in s.targets
                for t in ast.walk(target) if isinstance(t, ast.Name) and t.id.startswith("v_")}
    checked = 0
    for name in assigned - returned:
        reads = [i for i, s in enumerate(body) if name in _loads(s)]
        if not reads:
            continue  # never read (kept to the step's end, as the peak counts it)
        after = body[reads[-1] + 1]
        assert isinstance(after, ast.Delete) and name in {t.id for t in after.targets}, \
            f"{name} is read last by line {body[reads[-1]].lineno} but not deleted right after"
        checked += 1
    return checked


@pytest.mark.parametrize("seed", [3, 11])
def test_every_value_is_deleted_right_after_its_last_use(seed):
    cluster = Cluster(num_workers=2)
    split = split_program(random_program(30, cluster.labels(), seed=seed, run_length=3.0),
                          cluster)
    hub = LoopbackHub(split.plan.labels)
    for label in split.plan.labels:
        code = Executor(split.plan, split.program, label, hub.transport(label)).code
        step = next(f for f in ast.parse(code.source).body if f.name == "step")
        # Straight-line: no environment, one statement per op, send or receive.
        assert "env" not in code.source.replace("_env", "")
        sends = code.source.split("def measured")[0].count("_send(")
        assert sends == sum(c.src == label for c in split.plan.channels)
        assert _check_frees(step) > 0


def test_the_generated_source_is_inspectable_and_in_tracebacks():
    executor, feeds, _ = one_worker()
    code = executor.code
    assert inspect.getsource(code.step) == code.source.split("\n\n")[0] + "\n"
    assert code.source.startswith("def step(step, state, feeds,")
    # Arguments are written into the calls: the first layer's addmm reads its
    # bias, the batch and the transposed weight by name.
    assert re.search(r"v_addmm = \w+\(v_p_0_bias, v_in_0, v_t\)", code.source)


def test_a_failing_node_is_named_with_its_module_and_the_cause_kept():
    executor, feeds, keys = one_worker()
    executor.run_step(0, feeds)
    bad = {**feeds, keys[0]: torch.randn(5, 6)}  # the first Linear wants 4 features
    with pytest.raises(StepFailed, match=r"\[worker 0\] step 1: node addmm \(module '0'\) "
                                         r"\(addmm\.default\) raised RuntimeError: mat1 and "
                                         r"mat2 shapes cannot be multiplied") as caught:
        executor.run_step(1, bad)
    assert isinstance(caught.value.__cause__, RuntimeError)
    lines = [f.line for f in traceback.extract_tb(caught.value.__cause__.__traceback__)]
    assert any(line and line.startswith("v_addmm = ") for line in lines), \
        "the traceback shows the generated line"


def test_a_steps_peak_is_measured_once_per_step_shape():
    executor, feeds, keys = one_worker()
    calls = []
    measured = executor.code.measured

    def counting(*args):
        calls.append(args[0])
        return measured(*args)
    executor.code.measured = counting
    executor.run_step(0, feeds)
    peak = executor.stats.peak_activation_bytes
    assert peak > 0
    executor.run_step(1, feeds)
    smaller = {**feeds, keys[0]: feeds[keys[0]][:2], keys[1]: feeds[keys[1]][:2]}
    executor.run_step(2, smaller)
    executor.run_step(3, smaller)
    assert calls == [0, 2]
    assert executor.stats.peak_activation_bytes == peak


def test_a_new_state_value_replaces_the_old_one_as_soon_as_it_is_made():
    """So a process holds one copy of its parameters and moments during the
    update, not the old and the new ones until the step ends."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    batch = (torch.randn(5, 4), torch.randint(0, 3, (5,)))
    program = capture(net, lambda m, x, y: F.cross_entropy(m(x), y),
                      torch.optim.Adam(net.parameters(), lr=1e-2), batch)
    split = split_program(program, Cluster(num_workers=1))
    executor = Executor(split.plan, split.program, W0,
                        LoopbackHub(split.plan.labels).transport(W0), tile_pointwise=False)
    executor.load_state(split.program.initial_state)
    keys = [spec.key for spec in split.program.inputs if spec.kind is InputKind.BATCH]
    feeds = {**split.program.hparams(0), **dict(zip(keys, batch))}
    source = executor.code.source
    order = sorted(executor.state, key=lambda k: source.index(f"_put_state({k!r}"))
    first, last = order[0], order[-1]
    old_first = weakref.ref(executor.state[first])
    put = executor.code.step.__globals__["_put_state"]
    seen = []

    def recording(key, value):
        if key == last:  # every other key is put already, its old value gone
            seen.append((old_first() is None, executor.state[first] is not None))
        put(key, value)

    for function in (executor.code.step, executor.code.measured):
        function.__globals__["_put_state"] = recording
    expected = program.train_unsplit(1, lambda _: dict(zip(keys, batch)))[1]
    executor.run_step(0, feeds)
    assert seen == [(True, True)]
    for key, value in expected.items():
        assert torch.equal(executor.state[key], value), key
