"""`splitrun plan --out plan.dot` through the real command: the main job's
blocks named by its modules, not aten op names, and a legend (the picture
itself: tests/launcher/test_render.py)."""

from __future__ import annotations

import pydot
from cluster import REPO


def block_labels(graph: pydot.Dot) -> list[str]:
    labels = []
    for cluster in graph.get_subgraphs():
        labels += [node.get("label") or "" for node in cluster.get_nodes()]
    return labels


def test_splitrun_plan_names_the_modules_of_the_main_job(local_cluster, tmp_path):
    out = tmp_path / "plan.dot"
    proc = local_cluster.start("plan", "--workers", 2, "--servers", 1, "--out", out,
                               REPO / "examples" / "ps_train.py")
    assert proc.wait(120) == 0, proc.output()
    graph = pydot.graph_from_dot_data(out.read_text())[0]
    labels = " ".join(block_labels(graph))
    assert "optimizer (0.weight, 0.bias, 2.weight, 2.bias" in labels
    assert "addmm" not in labels and "cluster_legend" in out.read_text()
