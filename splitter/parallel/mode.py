"""`ParallelMode`: a group of workers runs one step with its values sharded.

prebuild: check the labels (a group is named by its lowest rank), pin what
the user pinned, choose every value's placement (`propagate.py`) and rewrite
the step into one rank-local copy per member with collectives as ordinary
nodes (`rewrite.py`). The copy is made here rather than in `postbuild`, so
that the GraphSplitter itself sees every read of another member's value and
makes it a channel: fusion, lint and the no-deadlock invariant then hold for
the collectives as for any other edge. fuse and postbuild are the general
mode's.

What was decided is kept as `mode.layout` (a `ParallelLayout`): the placements,
the state's placements and the collectives with their bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from enum import Enum

from ..errors import PlanError
from ..labels import LABEL_ANNOTATION, Cluster, Label, Role
from ..modes import Mode
from ..plan import ModeKind
from ..program import InputKind, Program, node_annotation
from ..resolve import describe_node
from .layout import ParallelLayout
from .placement import Placement, ShardingError, to_placement
from .propagate import propagate
from .registry import value_shapes
from .rewrite import expand_program
from .solver import Policy

__all__ = ["ParallelMode", "CollectiveBackend"]

logger = logging.getLogger(__name__)


class CollectiveBackend(Enum):
    CHANNELS = "channels"            # sends and receives on splitrun channels
    TORCH_DISTRIBUTED = "torch_distributed"  # not built yet


class ParallelMode(Mode):
    """Tensor parallelism over `groups` of workers (default: all workers).

    `policy` picks the propagation rule (`"global"`, `"greedy"`, `"first"`);
    `parameter_plan` pins parameters by name (`{"l1.weight": "S(0)"}` or a
    strategy tuple such as `(2, 1)`).
    """

    kind = ModeKind.PARALLEL

    def __init__(self, groups: Sequence[Sequence[int]] | None = None, *,
                 policy: Policy | str = Policy.GLOBAL,
                 parameter_plan: Mapping[str, Placement | str | tuple] | None = None,
                 backend: CollectiveBackend | str = CollectiveBackend.CHANNELS) -> None:
        self.groups = None if groups is None else [list(g) for g in groups]
        self.policy = Policy.parse(policy)
        self.parameter_plan = dict(parameter_plan or {})
        self.backend = CollectiveBackend(backend)
        if self.backend is not CollectiveBackend.CHANNELS:
            raise PlanError(
                "parallel mode's torch.distributed backend is not built yet; use the "
                "default channel backend (backend='channels')")
        self.layout: ParallelLayout | None = None

    # -- groups --

    def _members(self, cluster: Cluster) -> tuple[Label, ...]:
        groups = self.groups or [list(range(cluster.num_workers))]
        seen: set[int] = set()
        for group in groups:
            if not group:
                raise PlanError("parallel mode: a group must hold at least one worker")
            for rank in group:
                if not isinstance(rank, int) or rank < 0 or rank >= cluster.num_workers:
                    raise PlanError(
                        f"parallel group {group} names worker {rank}, but the cluster has "
                        f"{cluster.num_workers} workers; launch with --workers "
                        f"{max(max(g) for g in groups) + 1} or change the groups")
                if rank in seen:
                    raise PlanError(f"worker {rank} is in two parallel groups; groups must "
                                    f"not overlap")
                seen.add(rank)
            if sorted(group) != list(group):
                raise PlanError(f"parallel group {group}: list its ranks in increasing order")
        if len(groups) > 1:
            raise PlanError(
                f"parallel mode with {len(groups)} groups (pipeline + tensor parallel) is "
                f"not built yet; run one group")
        if cluster.num_servers:
            raise PlanError("parallel mode runs on workers only; launch without servers")
        if len(seen) != cluster.num_workers:
            idle = sorted(set(range(cluster.num_workers)) - seen)
            logger.warning("workers %s are in no parallel group; they will idle", idle)
        return tuple(Label.worker(r) for r in groups[0])

    def _check_labels(self, program: Program, members: tuple[Label, ...]) -> None:
        first = members[0]
        for node in program.graph.nodes:
            text = node_annotation(node, LABEL_ANNOTATION)
            if text is None:
                continue
            try:
                label = Label.parse(text)
            except Exception:  # noqa: BLE001 - any malformed label is reported below
                raise PlanError(f"node {node.name}: malformed label {text!r}") from None
            where = describe_node(program, node)
            if label.role is not Role.WORKER:
                raise PlanError(f"{where} is placed on {label.describe()}; parallel mode "
                                f"runs on worker groups only")
            if label is first:
                continue
            if label in members:
                raise PlanError(
                    f"{where} is labelled {label.describe()}, which is not its group's first "
                    f"rank; a group is named by its lowest rank: label it {first} (worker "
                    f"{first.rank}) and every member runs its piece")
            raise PlanError(f"{where} is labelled {label.describe()}, which is in no parallel "
                            f"group ({', '.join(str(m) for m in members)})")

    def _pins(self, program: Program, group_size: int) -> dict[str, Placement]:
        pins: dict[str, Placement] = {}
        for key, spec in self.parameter_plan.items():
            try:
                inp = program.input_for_key(key)
            except KeyError:
                params = [s.key for s in program.inputs if s.kind is InputKind.PARAM]
                raise ShardingError(
                    f"parameter_plan names {key!r}, which is not a parameter of the step; "
                    f"it has {', '.join(params)}") from None
            node = next(iter(program.graph.find_nodes(op="placeholder", target=inp.node)))
            pins[inp.node] = to_placement(spec, group_size=group_size,
                                          ndim=len(value_shapes(node)[0]),
                                          what=f"parameter {key!r}")
        return pins

    # -- hooks --

    def default_label(self, cluster: Cluster) -> Label:
        return Label.worker(0)

    def prebuild(self, program: Program, cluster: Cluster) -> Program:
        members = self._members(cluster)
        self._check_labels(program, members)
        n = len(members)
        sharding = propagate(program, n, self._pins(program, n), self.policy)
        expanded, self.layout = expand_program(program, sharding, members)
        logger.info("parallel mode over %s: %d collectives, %d bytes per step (%s policy)",
                    ", ".join(str(m) for m in members), len(self.layout.collectives),
                    self.layout.bytes_per_step, self.policy.value)
        return expanded
