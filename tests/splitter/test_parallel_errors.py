"""Bad input to parallel mode: each refused with an error naming the culprit."""

import pytest
import torch
from parallel_models import BATCH, IN, OUT, mse
from torch import nn

from splitrun.splitter import (
    Cluster,
    ParallelLinear,
    ParallelMode,
    PlanError,
    ShardingError,
    capture,
    constrain,
    optim,
    place,
    shard,
    split,
)


def capture_model(model):
    return capture(model, mse, optim.SGD(lr=0.1),
                   (torch.randn(BATCH, IN), torch.randn(BATCH, OUT)))


class Two(nn.Module):
    def __init__(self, hidden=16, first=None):
        super().__init__()
        self.l1 = first or ParallelLinear(IN, hidden, dim=-1)
        self.l2 = nn.Linear(hidden, OUT)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x)))


def test_an_indivisible_dimension_names_the_tensor_and_its_size():
    program = capture_model(Two(hidden=15))
    with pytest.raises(ShardingError, match=r"param 'l1.weight' of shape \[15, 8\].*"
                                            r"dimension 0 has size 15.*group size 2"):
        split(program, Cluster(num_workers=2), ParallelMode())


def test_a_two_dimensional_strategy_is_refused_where_it_is_given():
    with pytest.raises(ShardingError, match=r"strategy \(4, 2\) cuts 2 dimensions"):
        shard(nn.Linear(8, 8), parameter_plan={"weight": (4, 2)})
    with pytest.raises(ShardingError, match=r"strategy \(4, 2\) cuts 2 dimensions"):
        constrain(torch.zeros(4, 2), (4, 2))
    program = capture_model(Two(first=nn.Linear(IN, 16)))
    with pytest.raises(ShardingError, match=r"parameter 'l1.weight': strategy \(4, 2\) cuts 2"):
        split(program, Cluster(num_workers=4), ParallelMode(parameter_plan={"l1.weight": (4, 2)}))


def test_a_cut_that_is_not_the_group_size_is_refused():
    program = capture_model(Two(first=nn.Linear(IN, 16)))
    with pytest.raises(ShardingError, match=r"cuts dimension 0 into 4 but the group has 2"):
        split(program, Cluster(num_workers=2), ParallelMode(parameter_plan={"l1.weight": (4, 1)}))


def test_a_shard_label_on_a_rank_that_is_not_its_groups_first():
    model = Two()
    place(model.l2, rank=1)
    program = capture_model(model)
    with pytest.raises(PlanError, match=r"'l2.weight'.*labelled worker 1, which is not its "
                                        r"group's first rank.*label it w0"):
        split(program, Cluster(num_workers=2), ParallelMode())


def test_unknown_parameter_and_out_of_range_group():
    program = capture_model(Two())
    with pytest.raises(ShardingError, match=r"'l3.weight', which is not a parameter.*l1.weight"):
        split(program, Cluster(num_workers=2), ParallelMode(parameter_plan={"l3.weight": "S(0)"}))
    with pytest.raises(PlanError, match=r"group \[0, 1, 2\] names worker 2.*2 workers"):
        split(program, Cluster(num_workers=2), ParallelMode(groups=[[0, 1, 2]]))


def test_malformed_placement_text():
    with pytest.raises(ShardingError, match=r"malformed placement 'S\[1\]'"):
        constrain(torch.zeros(2, 2), "S[1]")


def test_an_op_without_a_strategy_runs_replicated_with_a_warning_naming_it(caplog):
    class Cumulative(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1 = ParallelLinear(IN, 16, dim=-1)
            self.l2 = nn.Linear(16, OUT)

        def forward(self, x):
            return self.l2(torch.cumsum(self.l1(x), dim=1))

    program = capture_model(Cumulative())
    with caplog.at_level("WARNING", logger="splitrun.splitter.parallel.propagate"):
        plan = split(program, Cluster(num_workers=2), ParallelMode())
    assert any("no sharding strategy for aten.cumsum" in r.getMessage() and "module 'Cumulative'"
               in r.getMessage() and "runs replicated"
               in r.getMessage() for r in caplog.records), caplog.text
    assert plan.parallel is not None and plan.parallel.collectives
