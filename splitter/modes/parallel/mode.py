"""`ParallelMode`: a group of workers runs one step with its values sharded.

prebuild: check the labels (a group is named by its lowest rank), pin what
the user pinned, choose every value's placement (`propagate.py`) and rewrite
the step into one rank-local copy per member with collectives as ordinary
nodes (`rewrite.py`). The copy is made here rather than in `postbuild`, so
that the GraphSplitter itself sees every read of another member's value and
makes it a channel: fusion, lint and the no-deadlock invariant then hold for
the collectives as for any other edge. fuse and postbuild are the general
mode's.

What was decided comes back as the split's artifacts (a `ParallelLayout`):
the placements, where the state lives and the collectives with their bytes.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence

from ...errors import PlanError
from ...fx_facts import FOLLOWER_OPS, op_packet
from ...labels import LABEL_ANNOTATION, Cluster, Label, Role
from ...ops.collectives import CollectiveBackend
from ...plan.model import CollectiveEntry, ModeKind, ParallelSummary, SplitPlan
from ...program import InputKind, Program, node_annotation
from ...splitting.mode import Mode
from ...splitting.resolve import describe_node
from .layout import ParallelLayout
from .placement import Placement, ShardingError, to_placement
from .propagate import propagate
from .registry import value_shapes
from .rewrite import expand_program
from .solver import Policy

__all__ = ["ParallelMode", "CollectiveBackend"]

logger = logging.getLogger(__name__)


# A collective's fixed latency, as the bytes one rank sends meanwhile: 8 KiB is
# 8 µs at 1 GB/s, well below the latencies measured on loopback here (a 4-byte
# gloo all-reduce about 110 µs, a shared-memory channel round trip 132 µs) and
# far below NCCL's α/β on fast links. It only decides between layouts whose
# bytes differ by less than that per collective saved.
DEFAULT_COLLECTIVE_LATENCY_BYTES = 8192


class ParallelMode(Mode):
    """Tensor parallelism over `groups` of workers (default: all workers).

    `policy` picks the propagation rule (`"global"`, `"greedy"`, `"first"`);
    `parameter_plan` pins parameters by name (`{"l1.weight": "S(0)"}` or a
    strategy tuple such as `(2, 1)`). `backend`: collectives as splitrun
    channels (`"channels"`, the default) or on a `torch.distributed` process
    group per parallel group (`"torch_distributed"`: gloo on CPU, NCCL on CUDA),
    formed through the job's scheduler. `collective_latency_bytes`: what each
    collective costs a rank on top of its bytes when choosing placements (the
    α of the α-β model as the bytes a rank sends in that time; 0: bytes alone).
    """

    kind = ModeKind.PARALLEL

    def __init__(self, groups: Sequence[Sequence[int]] | None = None, *,
                 policy: Policy | str = Policy.GLOBAL,
                 parameter_plan: Mapping[str, Placement | str | tuple] | None = None,
                 backend: CollectiveBackend | str = CollectiveBackend.CHANNELS,
                 collective_latency_bytes: int = DEFAULT_COLLECTIVE_LATENCY_BYTES) -> None:
        self.groups = None if groups is None else [list(g) for g in groups]
        self.policy = Policy.parse(policy)
        self.parameter_plan = dict(parameter_plan or {})
        self.backend = CollectiveBackend.parse(backend)
        if not isinstance(collective_latency_bytes, int) or collective_latency_bytes < 0:
            raise PlanError(f"parallel mode: collective_latency_bytes must be a whole number "
                            f"of bytes >= 0, got {collective_latency_bytes!r}")
        self.collective_latency_bytes = collective_latency_bytes

    # -- groups --

    def _groups(self, cluster: Cluster) -> tuple[tuple[Label, ...], ...]:
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
        sizes = sorted({len(g) for g in groups})
        if len(sizes) > 1:
            raise PlanError(
                f"parallel groups {groups} have sizes {sizes}; groups of different sizes are "
                f"not supported: make every group the same size")
        if cluster.num_servers:
            raise PlanError("parallel mode runs on workers only; launch without servers")
        if len(seen) != cluster.num_workers:
            idle = sorted(set(range(cluster.num_workers)) - seen)
            logger.warning("workers %s are in no parallel group; they will idle", idle)
        return tuple(tuple(Label.worker(r) for r in group) for group in groups)

    def _group_of(self, program: Program, groups) -> dict[str, int]:
        """The group that runs each node: an explicit label names a group by its
        first member; unlabelled views follow their input; the rest runs in the
        group of worker 0. State lives with the group that updates it."""
        first = {group[0]: index for index, group in enumerate(groups)}
        member_of = {label: index for index, group in enumerate(groups) for label in group}
        default = member_of.get(Label.worker(0), 0)
        found: dict[str, int] = {}
        deferred = []
        for node in program.graph.nodes:
            if node.op in ("output", "get_attr"):
                continue
            if node.op == "placeholder":
                spec = program.input_spec(node.name)
                if spec.kind in (InputKind.BATCH, InputKind.HPARAM):
                    continue
            text = node_annotation(node, LABEL_ANNOTATION)
            if text is not None:
                found[node.name] = first[self._check_label(program, node, text, groups)]
            elif node.op == "placeholder":
                deferred.append(node)
            elif len(node.all_input_nodes) == 1 and \
                    op_packet(node) in FOLLOWER_OPS and \
                    node.all_input_nodes[0].name in found:
                found[node.name] = found[node.all_input_nodes[0].name]
            else:
                found[node.name] = default
        for node in deferred:
            spec = program.input_spec(node.name)
            update = program.state_output(spec.key)
            users = [u.name for u in node.users if u.name in found]
            if update is not None and update.node in found:
                found[node.name] = found[update.node]
            elif users:
                found[node.name] = found[users[0]]
            else:
                found[node.name] = default
        return found

    def _check_label(self, program: Program, node, text: str, groups) -> Label:
        try:
            label = Label.parse(text)
        except Exception:  # noqa: BLE001 - any malformed label is reported below
            raise PlanError(f"node {node.name}: malformed label {text!r}") from None
        where = describe_node(program, node)
        if label.role is not Role.WORKER:
            raise PlanError(f"{where} is placed on {label.describe()}; parallel mode "
                            f"runs on worker groups only")
        for group in groups:
            if label is group[0]:
                return label
            if label in group:
                raise PlanError(
                    f"{where} is labelled {label.describe()}, which is not its group's first "
                    f"rank; a group is named by its lowest rank: label it {group[0]} (worker "
                    f"{group[0].rank}) and every member runs its piece")
        names = ", ".join("{" + ", ".join(str(m) for m in g) + "}" for g in groups)
        raise PlanError(f"{where} is labelled {label.describe()}, which is in no parallel "
                        f"group ({names})")

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

    def prebuild(self, program: Program, cluster: Cluster) -> tuple[Program, ParallelLayout]:
        groups = self._groups(cluster)
        group_of = self._group_of(program, groups)
        n = len(groups[0])
        sharding = propagate(program, n, self._pins(program, n), self.policy, group_of,
                             collective_cost=n * self.collective_latency_bytes)
        expanded, layout = expand_program(program, sharding, groups, group_of, self.backend)
        logger.info("parallel mode over %s: %d collectives, %d bytes per step (%s policy, "
                    "%s backend)",
                    " ".join("{" + ",".join(str(m) for m in g) + "}" for g in groups),
                    len(layout.collectives), layout.bytes_per_step, self.policy.value,
                    self.backend.value)
        return expanded, layout

    def postbuild(self, plan: SplitPlan, program: Program,
                  artifacts: ParallelLayout) -> SplitPlan:
        """The plan gains its groups, shardings and collectives (plain data)."""
        summary = ParallelSummary(
            artifacts.groups,
            tuple((key, str(placement), artifacts.members_of(key)[0])
                  for key, placement in artifacts.state.items()),
            tuple(CollectiveEntry(c.kind.value, c.value, str(c.src), str(c.dst), c.nbytes)
                  for c in artifacts.collectives))
        return dataclasses.replace(plan, parallel=summary)
