"""Bad labels get an error at split time that names the node, the module, the
label and the fix."""

import pytest
import torch
from torch import nn

from splitrun.splitter import (
    Cluster,
    Label,
    LabelError,
    Mode,
    PlanError,
    Role,
    capture,
    optim,
    place,
    region,
    split,
)
from splitrun.splitter.testing import random_program


class TwoStage(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 2)

    def forward(self, x):
        return self.second(torch.relu(self.first(x)))


def program_with(**placement):
    model = TwoStage()
    place(model.second, **placement)
    return capture(model, lambda m, x: m(x).sum(), optim.SGD(lr=0.1), torch.randn(3, 4))


def test_rank_beyond_cluster_size():
    program = program_with(rank=3)
    with pytest.raises(PlanError, match=r"param 'second.weight'\) is placed on worker 3, but the "
                                        r"cluster has 2 workers \(ranks 0-1\).*--workers 4"):
        split(program, Cluster(num_workers=2))


def test_server_when_the_cluster_has_none():
    program = program_with(role="server", rank=0)
    with pytest.raises(PlanError, match=r"placed on server 0, but the cluster has 0 servers"
                                        r".*--servers 1"):
        split(program, Cluster(num_workers=2))


def test_node_placed_on_the_scheduler():
    program = program_with(role="scheduler", rank=0)
    with pytest.raises(PlanError, match=r"param 'second.weight'\) is placed on the scheduler"):
        split(program, Cluster(num_workers=2, num_servers=1))


def test_unknown_role():
    with pytest.raises(LabelError, match=r"unknown role 'gpu'; expected one of worker, server"):
        place(nn.Linear(2, 2), role="gpu")
    with pytest.raises(LabelError, match=r"unknown role 'sever'"):
        with region(role="sever"):
            pass


def test_malformed_label_in_graph_names_node():
    program = random_program(5, [Label.worker(0)], seed=0)
    node = next(n for n in program.graph.nodes if n.op == "call_function")
    node.meta["custom"] = {"splitrun.label": "x7"}
    with pytest.raises(PlanError, match=rf"node {node.name}: malformed label 'x7'"):
        split(program, Cluster())


class WorkersOnly(Mode):
    def reject_label(self, label, cluster):
        if label.role is Role.SERVER:
            return "this mode runs every op on workers; remove the server placement"
        return None


def test_label_the_mode_cannot_accept():
    program = program_with(role="server", rank=0)
    with pytest.raises(PlanError, match=r"param 'second.weight'\) is placed on server 0: this mode "
                                        r"runs every op on workers"):
        split(program, Cluster(num_workers=1, num_servers=1), WorkersOnly())
