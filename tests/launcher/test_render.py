"""The plan picture (`splitrun plan --out plan.dot`): blocks and channels named
by modules, not aten op names; a legend for data, data-sync and control edges.
(The main job's, through the real command: tests/e2e/test_render_e2e.py.)"""

from __future__ import annotations

import re
import shutil

import pydot
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from splitrun.launcher.render import ModuleNames, PlanNames, plan_picture, render_plan
from splitrun.splitter import (
    ParameterServerMode,
    capture,
    place,
    plan_from_text,
    plan_to_text,
    split_program,
)
from splitrun.splitter.labels import Cluster
from splitrun.splitter.plan.picture_names import picture_names

ATEN_NAMES = ("addmm", "relu", "threshold_backward", "_log_softmax", "nll_loss")


@pytest.fixture(scope="module")
def ps_split():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    place(model, role="server")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    batch = (torch.randn(4, 8), torch.randint(0, 4, (4,)))
    program = capture(model, lambda m, x, y: F.cross_entropy(m(x), y), optimizer, batch)
    split = split_program(program, Cluster(2, 1), ParameterServerMode())
    return split.plan, PlanNames(**picture_names(split.program))


def block_labels(graph: pydot.Dot) -> list[str]:
    labels = []
    for cluster in graph.get_subgraphs():
        labels += [node.get("label") or "" for node in cluster.get_nodes()]
    return labels


def test_blocks_are_named_by_modules_and_a_legend_explains_the_edges(ps_split):
    plan, modules = ps_split
    graph = pydot.graph_from_dot_data(plan_picture(plan, modules))[0]
    labels = " ".join(block_labels(graph))
    # The server's block: the optimizer and the gradient sums of each parameter.
    assert "optimizer (0.weight, 0.bias, 2.weight, 2.bias)" in labels
    assert "gradient sum (" in labels
    # The workers' blocks: the model's modules and the loss function.
    for module in ("module 0: ", "module 1: ", "module 2: ", "outside modules (loss function)"):
        assert module in labels, labels
    for aten in ATEN_NAMES:
        assert aten not in labels, f"aten op {aten} in a block label: {labels}"
    clusters = {sub.get_name() for sub in graph.get_subgraphs()}
    assert "cluster_legend" in clusters
    legend = next(sub for sub in graph.get_subgraphs() if sub.get_name() == "cluster_legend")
    styles = {edge.get("style") for edge in legend.get_edges()}
    assert styles == {"solid", "dashed", "dotted"}
    # The plan's own data-sync edges are dashed, as the legend says.
    synced = {sync.channel for sync in plan.data_syncs}
    dashed = [e for e in graph.get_edges() if e.get("style") == "dashed"]
    assert synced and len(dashed) == len(synced)


def test_without_a_module_map_the_picture_falls_back_to_node_names(ps_split, tmp_path):
    plan, _ = ps_split
    out = tmp_path / "plan.dot"
    render_plan(plan_to_text(plan), out)
    text = out.read_text()
    assert "addmm" in text and "cluster_legend" in text
    pydot.graph_from_dot_data(text)


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz's dot is not installed")
def test_svg_through_graphviz(ps_split, tmp_path):
    plan, modules = ps_split
    out = tmp_path / "plan.svg"
    render_plan(plan_to_text(plan), out, modules)
    assert "<svg" in out.read_text() and "optimizer" in out.read_text()


def test_channels_carry_module_and_parameter_names(ps_split):
    plan, names = ps_split
    graph = pydot.graph_from_dot_data(plan_picture(plan, names))[0]
    labels = [edge.get("label") or "" for edge in graph.get_edges()]
    synced = [label for label in labels if "s0->w0" in label]
    assert synced and "0.weight" in synced[0] and "2.bias" in synced[0], synced
    for label in labels:  # no fx node names: p_0_weight, view_5, t_3
        assert not re.search(r"\b(p_\w+|view_\d+|t_\d+|addmm\w*)\b", label), label


def test_one_op_is_one_op():
    names = ModuleNames({"linear": "l1"})
    assert names.describe_ops(["linear"]).split("\\n") == ["1 op", "module l1: 1 op"]
    assert names.describe_ops(["linear", "other"]).startswith("2 ops\\n")


def test_the_cache_mode_picture_shows_the_embedding_row_traffic():
    from cache_models import make

    from splitrun.splitter import EmbeddingCacheMode

    program, _ = make("adagrad", 1, 2, cache_rows=48)
    split = split_program(program, Cluster(1, 2), EmbeddingCacheMode())
    plan = split.plan
    assert plan_from_text(plan_to_text(plan)) == plan, "the text form keeps the tables"
    assert [t.key for t in plan.cached_tables] == ["tables.0.weight", "tables.1.weight"]
    assert plan.row_bytes_per_step() > plan.bytes_per_step()
    assert f"up to {plan.row_bytes_per_step()} bytes per step each way" in plan.summary()
    graph = pydot.graph_from_dot_data(plan_picture(plan, PlanNames(**picture_names(
        split.program))))[0]
    rows = [edge for edge in graph.get_edges() if edge.get("dir") == "both"
            and not edge.get_source().startswith("legend")]
    assert sorted((e.get_source(), e.get_destination()) for e in rows) == [
        ("w0_rows", "s0_start"), ("w0_rows", "s1_start")]
    label = rows[0].get("label")
    assert "embedding rows: tables.0.weight, tables.1.weight" in label, label
    assert "misses pulled, dirty rows pushed" in label
    worker = next(sub for sub in graph.get_subgraphs() if sub.get_name() == "cluster_w0")
    cache = next(node for node in worker.get_nodes() if node.get_name() == "w0_rows")
    assert "row cache" in cache.get("label") and "48 rows (lru)" in cache.get("label")


def test_an_svg_without_graphviz_says_what_to_do(ps_split, tmp_path, monkeypatch):
    from splitrun.launcher import render
    from splitrun.splitter.errors import SplitrunError

    plan, names = ps_split
    monkeypatch.setattr(render.shutil, "which", lambda name: None)
    with pytest.raises(SplitrunError) as refused:
        render_plan(plan_to_text(plan), tmp_path / "plan.svg", names)
    assert str(refused.value) == (
        f"cannot write {tmp_path / 'plan.svg'}: graphviz's `dot` is not on PATH. Install "
        f"graphviz (Debian/Ubuntu: apt-get install graphviz; macOS: brew install graphviz; "
        f"conda: conda install -c conda-forge graphviz), or write {tmp_path / 'plan.dot'} "
        f"(--out plan.dot) and run `dot -Tsvg plan.dot -o plan.svg` where graphviz is "
        f"installed")
