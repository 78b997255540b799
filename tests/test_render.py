"""The plan picture (`splitrun plan --out plan.dot`): blocks and channels named
by modules, not aten op names; a legend for data, data-sync and control edges."""

from __future__ import annotations

import shutil

import pydot
import pytest
import torch
import torch.nn.functional as F
from cluster import REPO
from torch import nn

from splitrun.launcher.render import plan_picture, render_plan
from splitrun.splitter import ParameterServerMode, capture, place
from splitrun.splitter.graph_splitter import split_program
from splitrun.splitter.labels import Cluster

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
    modules = {node.name: split.program.module_of(node) for node in split.program.graph.nodes
               if split.program.module_of(node) is not None}
    return split.plan, modules


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
    render_plan(plan.to_text(), out)
    text = out.read_text()
    assert "addmm" in text and "cluster_legend" in text
    pydot.graph_from_dot_data(text)


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz's dot is not installed")
def test_svg_through_graphviz(ps_split, tmp_path):
    plan, modules = ps_split
    out = tmp_path / "plan.svg"
    render_plan(plan.to_text(), out, modules)
    assert "<svg" in out.read_text() and "optimizer" in out.read_text()


@pytest.mark.slow
def test_splitrun_plan_names_the_modules_of_the_main_job(local_cluster, tmp_path):
    out = tmp_path / "plan.dot"
    proc = local_cluster.start("plan", "--workers", 2, "--servers", 1, "--out", out,
                               REPO / "examples" / "ps_train.py")
    assert proc.wait(120) == 0, proc.output()
    graph = pydot.graph_from_dot_data(out.read_text())[0]
    labels = " ".join(block_labels(graph))
    assert "optimizer (0.weight, 0.bias, 2.weight, 2.bias" in labels
    assert "addmm" not in labels and "cluster_legend" in out.read_text()
