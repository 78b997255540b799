"""The GraphSplitter: one program in, one `SplitPlan` out.

1. The mode's `prebuild` may add or relabel nodes.
2. Every node gets a label (`resolve.py`).
3. Segments: maximal runs of one label in the global topological order (the
   graph's node order, which every process computes identically).
4. Inter-process edges: one receive per (value, destination process).
5. The mode fuses edges into channels; a process with no inbound channel gets a
   control edge from the default process (its per-step trigger).
6. Each process's schedule is its nodes, sends and receives in global order.
7. The mode's `postbuild` may adjust the plan; then each process's
   multi-tensor updates are grouped (`update_groups`).

Every process executes in the order of one global topological order and sends
never block, so the global order is a valid sequential schedule for the whole
split program: it cannot deadlock. `plan.check.check_plan` re-checks this.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import operator
from collections import defaultdict
from dataclasses import dataclass, field

from torch import fx

from ..errors import PlanError
from ..fx_facts import value_nbytes
from ..labels import Cluster, Label, Role
from ..plan.check import check_plan
from ..plan.model import (
    Channel,
    ChannelKind,
    DataSync,
    Instruction,
    OpKind,
    ProcessPlan,
    SplitPlan,
)
from ..plan.text import with_fingerprint
from ..program import InputKind, OutputKind, Program
from .mode import STEP_START, ChannelDraft, Edge, Mode, ModeArtifacts
from .resolve import resolve_labels
from .update_groups import group_updates

__all__ = ["GraphSplitter", "SplitProgram", "split", "split_program"]

logger = logging.getLogger(__name__)

# Sort keys within one global position: receives before the node that needs
# them, the node, then sends of what it produced. Control edges come first.
_RECV, _RUN, _SEND = 0, 1, 2
_CONTROL_POS = STEP_START - 1
_EVENT_ORDER = operator.itemgetter(0, 1, 2)  # (position, kind, channel name)


@dataclass(frozen=True)
class SplitProgram:
    """A split ready to run: the plan (plain data), the program its node names
    refer to (the mode's rewrite of the captured one), and the mode's typed
    artifacts (a bare `ModeArtifacts` in general mode)."""

    plan: SplitPlan
    program: Program
    artifacts: ModeArtifacts = field(default_factory=ModeArtifacts)

    def lint(self) -> None:
        """The plan's invariants, dataflow included (see `check_plan`)."""
        check_plan(self.plan, self.program)


class GraphSplitter:
    """Split `program` for `cluster` under `mode` (by default the base `Mode`:
    general mode without micro-batches)."""

    def __init__(self, program: Program, cluster: Cluster | None = None,
                 mode: Mode | None = None) -> None:
        self.cluster = cluster or Cluster()
        self.mode = mode or Mode()
        self.source = program

    def split(self) -> SplitPlan:
        """The plan alone (plain data: print it, draw it, compare it)."""
        return self.split_program().plan

    def split_program(self) -> SplitProgram:
        """The plan with the program and artifacts the runtime runs it with."""
        # Splitting allocates many small objects next to a large graph; the
        # cyclic collector would rescan that graph again and again (40% of the
        # time at 100k nodes). Nothing here makes cycles that need it.
        with _gc_paused():
            result = self._split()
        for proc in result.plan.processes:
            if proc.is_idle and not self.mode.works_outside_the_plan(proc.label):
                logger.warning("%s holds no part of the step; it will idle",
                               proc.label.describe())
        return result

    def _split(self) -> SplitProgram:
        program, artifacts = self.mode.prebuild(self.source, self.cluster)
        labels = resolve_labels(program, self.cluster, self.mode)
        scan = _Scan(program, labels, self.mode, self.cluster)
        drafts = self.mode.fuse(scan.edges, self.cluster)
        drafts += self._control_drafts(scan.runs, drafts)
        channels, sync_pairs = _name_channels(drafts)
        processes = self._processes(program, scan, channels, drafts)
        data_syncs = tuple(DataSync(key, src, dst, name) for key, src, dst, name in sync_pairs)
        plan = SplitPlan(self.mode.kind, self.cluster, processes, tuple(channels),
                         data_syncs)
        plan, program = group_updates(self.mode.postbuild(plan, program, artifacts), program)
        return SplitProgram(with_fingerprint(plan), program, artifacts)

    def _control_drafts(self, runs, drafts) -> list[ChannelDraft]:
        """A per-step trigger for every busy process nothing else feeds, and
        for every server that sends to a server before its first receive.
        Servers have no loop of their own: a server serves a step when the
        step's first message comes. One that starts a step on its own also
        starts the step after the workers' last; what it sends a worker then
        is never read, but a server it sends to would run that step too (an
        extra update of its state)."""
        default = self.mode.default_label(self.cluster)
        fed = {d.dst for d in drafts}
        busy = set(runs) | {d.src for d in drafts}
        first_recv: dict[Label, int] = {}
        for d in drafts:
            first_recv[d.dst] = min(first_recv.get(d.dst, d.recv_pos), d.recv_pos)
        # At one position a receive comes before the sends (_EVENT_ORDER).
        starts_servers = {d.src for d in drafts
                          if d.src.role is Role.SERVER and d.dst.role is Role.SERVER
                          and d.send_pos < first_recv.get(d.src, d.send_pos + 1)}
        return [ChannelDraft(default, label, ChannelKind.CONTROL,
                             send_pos=_CONTROL_POS, recv_pos=_CONTROL_POS)
                for label in sorted(((busy - fed) | starts_servers) - {default},
                                    key=Label.sort_key)]

    def _processes(self, program, scan, channels, drafts) -> tuple[ProcessPlan, ...]:
        events: dict[Label, list[tuple]] = defaultdict(list)
        for channel, draft in zip(channels, drafts):
            if channel.kind is ChannelKind.CONTROL:
                send_key, recv_key = (_CONTROL_POS, _SEND), (_CONTROL_POS, _RECV + 3)
            else:
                send_key, recv_key = (draft.send_pos, _SEND), (draft.recv_pos, _RECV)
            events[channel.src].append((*send_key, channel.name,
                                        Instruction(OpKind.SEND, channel.name)))
            events[channel.dst].append((*recv_key, channel.name,
                                        Instruction(OpKind.RECV, channel.name)))

        labels, by_name = scan.labels, scan.by_name
        state_of: dict[Label, list[str]] = defaultdict(list)
        feeds_of: dict[Label, set[str]] = defaultdict(set)
        for spec in program.inputs:
            node = by_name[spec.node]
            if spec.kind.is_state:
                state_of[labels[node]].append(spec.key)
            elif spec.kind is InputKind.HPARAM:
                if node.users:
                    feeds_of[labels[node]].add(spec.key)
            else:  # batch: fed to every worker that reads it, or sent by the driver
                driver = self.mode.default_label(self.cluster)
                for user in node.users:
                    if user.op == "call_function":
                        reader = labels[user]
                        feeds_of[driver if reader.role is Role.SERVER else reader].add(spec.key)
        outputs_of: dict[Label, list[str]] = defaultdict(list)
        for spec in program.outputs:
            if spec.kind is OutputKind.STATE:
                continue
            src = labels.get(by_name[spec.node])
            if src is None:
                raise PlanError(
                    f"output {spec.key!r} is the batch input {spec.node} itself; "
                    f"outputs must be computed by the step")
            outputs_of[self.mode.output_home(spec, src, self.cluster)].append(spec.key)

        feed_order = {spec.key: i for i, spec in enumerate(program.inputs)}
        processes = []
        for label in self.cluster.labels():
            # Runs are already in global order; sorting merges sends and receives in.
            timeline = scan.runs.get(label, [])
            timeline += events[label]
            timeline.sort(key=_EVENT_ORDER)
            processes.append(ProcessPlan(
                label, tuple(state_of[label]),
                tuple(sorted(feeds_of[label], key=feed_order.__getitem__)),
                tuple(outputs_of[label]), tuple([event[3] for event in timeline])))
        return tuple(processes)


class _Scan:
    """One pass over the nodes in global order: segments, inter-process edges
    (one per value and destination process), and each process's run events.

    One pass, because walking a large fx graph costs more in cache misses than
    the work done per node.
    """

    def __init__(self, program: Program, labels, mode: Mode, cluster: Cluster) -> None:
        self.labels = labels
        graph = program.graph
        # Only inputs and outputs are looked up by name; a dict of every node
        # would cost one more pass over the graph.
        self.by_name = {node.name: node for node in graph.find_nodes(op="placeholder")}
        output_node = graph.output_node()
        outputs = list(zip(program.outputs, output_node.args[0]))
        self.by_name.update((spec.node, node) for spec, node in outputs)
        found: dict[tuple[fx.Node, Label], Edge] = {}
        # node -> (label, position, segment): one lookup per input instead of three.
        info: dict[fx.Node, tuple] = {
            node: (label, STEP_START, STEP_START) for node, label in labels.items()
            if node.op != "call_function"}
        runs: dict[Label, list[tuple]] = defaultdict(list)
        run, current, segment = OpKind.RUN, None, -1
        # Servers run no data loop: a batch input a server reads comes from
        # the default process (worker 0) at step start.
        driver = mode.default_label(cluster)

        def add(value: fx.Node, src: Label, dst: Label, src_pos: int, src_segment: int,
                dst_pos: int) -> None:
            key = None
            if value.op == "placeholder":
                spec = program.input_spec(value.name)
                key = spec.key if spec.kind.is_state else None
            found[(value, dst)] = Edge(value.name, src, dst, src_pos, src_segment, dst_pos,
                                       value_nbytes(value), key)

        pos = 0
        for pos, node in enumerate(graph.nodes):
            if node.op != "call_function":
                continue
            dst = labels[node]
            if dst is not current:
                current, segment = dst, segment + 1
            info[node] = (dst, pos, segment)
            runs[dst].append((pos, _RUN, "", Instruction(run, node.name)))
            for value in node.all_input_nodes:
                src, src_pos, src_segment = info[value]
                if src is None and dst.role is Role.SERVER and value.op == "placeholder":
                    src = driver
                if src is not None and src is not dst and (value, dst) not in found:
                    add(value, src, dst, src_pos, src_segment, pos)
        end = pos + 1
        for spec, value in outputs:
            src, src_pos, src_segment = info[value]
            if src is None:
                continue
            if spec.kind is OutputKind.STATE:
                home = labels[self.by_name[program.input_for_key(spec.key).node]]
            else:
                home = mode.output_home(spec, src, cluster)
            if src is not home and (value, home) not in found:
                add(value, src, home, src_pos, src_segment, end)
        self.edges = list(found.values())
        self.runs = runs


@contextlib.contextmanager
def _gc_paused():
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _name_channels(drafts: list[ChannelDraft]):
    """Stable names `src->dst#k`, k counting channels of the pair in send order;
    control channels are `src->dst#c`. Sorts `drafts` in place to match."""
    # Two drafts of one pair never share a send position (one per source
    # segment, one at step start, one control), so this order is total.
    drafts.sort(key=lambda d: (d.src.sort_key(), d.dst.sort_key(), d.kind is ChannelKind.CONTROL,
                               d.send_pos, d.recv_pos))
    counter: dict[tuple[Label, Label], int] = defaultdict(int)
    channels: list[Channel] = []
    sync_pairs = []
    edge_order = operator.attrgetter("src_pos", "value")
    for draft in drafts:
        pair = (draft.src, draft.dst)
        if draft.kind is ChannelKind.CONTROL:
            name = f"{draft.src}->{draft.dst}#c"
        else:
            name = f"{draft.src}->{draft.dst}#{counter[pair]}"
            counter[pair] += 1
        edges = draft.edges
        if len(edges) > 1:
            edges.sort(key=edge_order)
        nbytes = 0
        for edge in edges:
            nbytes += edge.nbytes
            if edge.state_key:
                sync_pairs.append((edge.state_key, edge.src, edge.dst, name))
        channels.append(Channel(name, draft.src, draft.dst, draft.kind,
                                tuple([e.value for e in edges]),
                                tuple([e.recv_name or e.value for e in edges]), nbytes))
    return channels, sync_pairs


def split(program: Program, cluster: Cluster | None = None, mode: Mode | None = None) -> SplitPlan:
    """`GraphSplitter(program, cluster, mode).split()`: the plan alone."""
    return GraphSplitter(program, cluster, mode).split()


def split_program(program: Program, cluster: Cluster | None = None,
                  mode: Mode | None = None) -> SplitProgram:
    """`GraphSplitter(program, cluster, mode).split_program()`: the plan with the
    program and artifacts to run it (what `run_threaded` and the runtime take)."""
    return GraphSplitter(program, cluster, mode).split_program()
