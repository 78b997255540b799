"""Parallel mode: operator sharding (tensor parallelism) over a group of workers.

Mark what to shard (`shard`, `constrain`, the `Parallel*` layers, or the
mode's `parameter_plan`), capture the step as usual, and split it with
`ParallelMode`: propagation chooses every other value's placement so that the
step sends the fewest bytes, and the rewrite gives each member its piece with
the collectives as ordinary channels (or, with
`ParallelMode(backend="torch_distributed")`, on a gloo/NCCL process group per
parallel group).
"""

from ...ops.collectives import CollectiveBackend, CollectiveUnbound
from .api import (
    ParallelCrossEntropyLoss,
    ParallelEmbedding,
    ParallelLinear,
    constrain,
    convert_parallel_linear,
    shard,
)
from .cost import CollectiveKind, redistribute_bytes
from .layout import (
    Collective,
    ParallelLayout,
    collect_state_dict,
    member_key,
    relocate_state_dict,
)
from .mode import ParallelMode
from .placement import (
    P,
    Placement,
    PlacementKind,
    R,
    S,
    ShardingError,
    parse_placement,
    to_placement,
)
from .propagate import ShardingLayout, build_problem, propagate
from .registry import OpStrategy, strategies_for
from .solver import Policy, Problem, Use, Value, brute_force, solve, total_cost

__all__ = [
    "ParallelMode",
    "CollectiveBackend",
    "CollectiveUnbound",
    "Policy",
    "shard",
    "constrain",
    "ParallelLinear",
    "ParallelEmbedding",
    "ParallelCrossEntropyLoss",
    "convert_parallel_linear",
    "collect_state_dict",
    "relocate_state_dict",
    "member_key",
    "Placement",
    "PlacementKind",
    "R",
    "P",
    "S",
    "parse_placement",
    "to_placement",
    "ShardingError",
    "ShardingLayout",
    "ParallelLayout",
    "Collective",
    "CollectiveKind",
    "OpStrategy",
    "strategies_for",
    "redistribute_bytes",
    "propagate",
    "build_problem",
    "Problem",
    "Value",
    "Use",
    "solve",
    "brute_force",
    "total_cost",
]
