"""The GraphSplitter: one program in, one `SplitPlan` out.

1. The mode's `prebuild` may add or relabel nodes.
2. Every node gets a label (`resolve.py`).
3. Segments: maximal runs of one label in the global topological order (the
   graph's node order, which every process computes identically).
4. Inter-process edges: one receive per (value, destination process).
5. The mode fuses edges into channels; a process with no inbound channel gets a
   control edge from the default process (its per-step trigger).
6. Each process's schedule is its nodes, sends and receives in global order.

Every process executes in the order of one global topological order and sends
never block, so the global order is a valid sequential schedule for the whole
split program: it cannot deadlock. `SplitPlan.lint()` re-checks this.
"""

from __future__ import annotations

import logging
from collections import defaultdict

import torch
from torch import fx

from .errors import PlanError
from .labels import Cluster, Label
from .modes import STEP_START, ChannelDraft, Edge, GeneralMode, Mode
from .plan import (
    Channel,
    ChannelKind,
    DataSync,
    Instruction,
    OpKind,
    ProcessPlan,
    SplitPlan,
)
from .program import InputKind, OutputKind, Program
from .resolve import resolve_labels

__all__ = ["GraphSplitter", "split"]

logger = logging.getLogger(__name__)

# Sort keys within one global position: receives before the node that needs
# them, the node, then sends of what it produced. Control edges come first.
_RECV, _RUN, _SEND = 0, 1, 2
_CONTROL_POS = STEP_START - 1


def _nbytes(node: fx.Node) -> int:
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return 0


class GraphSplitter:
    """Split `program` for `cluster` under `mode` (general mode by default)."""

    def __init__(self, program: Program, cluster: Cluster | None = None,
                 mode: Mode | None = None) -> None:
        self.cluster = cluster or Cluster()
        self.mode = mode or GeneralMode()
        self.source = program

    def split(self) -> SplitPlan:
        program = self.mode.prebuild(self.source, self.cluster)
        nodes = list(program.graph.nodes)
        labels = resolve_labels(program, self.cluster, self.mode)
        position = {node: i for i, node in enumerate(nodes)}
        segment = _segments(nodes, labels)
        edges = self._edges(program, nodes, labels, position, segment)
        drafts = self.mode.fuse(edges, self.cluster)
        drafts += self._control_drafts(nodes, labels, drafts)
        channels, sync_pairs = _name_channels(drafts)
        processes = self._processes(program, nodes, labels, channels, drafts)
        data_syncs = tuple(DataSync(key, src, dst, name) for key, src, dst, name in sync_pairs)
        plan = SplitPlan(self.mode.kind, self.cluster, processes, tuple(channels),
                         data_syncs, program=program)
        plan = self.mode.postbuild(plan, program)
        for proc in plan.processes:
            if proc.is_idle:
                logger.warning("%s holds no part of the step; it will idle",
                               proc.label.describe())
        return plan

    # -- edges --

    def _edges(self, program, nodes, labels, position, segment) -> list[Edge]:
        found: dict[tuple[fx.Node, Label], Edge] = {}

        def add(value: fx.Node, dst: Label, dst_pos: int) -> None:
            src = labels.get(value)
            if src is None or src == dst or (value, dst) in found:
                return
            is_input = value.op == "placeholder"
            spec = program.input_spec(value.name) if is_input else None
            found[(value, dst)] = Edge(
                value.name, src, dst,
                STEP_START if is_input else position[value],
                STEP_START if is_input else segment[value],
                dst_pos, _nbytes(value),
                spec.key if spec is not None and spec.kind.is_state else None)

        for node in nodes:
            if node.op != "call_function":
                continue
            dst, pos = labels[node], position[node]
            for value in node.all_input_nodes:
                add(value, dst, pos)
        end = len(nodes)
        by_name = {n.name: n for n in nodes}
        for spec in program.outputs:
            value = by_name[spec.node]
            src = labels.get(value)
            if src is None:
                continue
            if spec.kind is OutputKind.STATE:
                home = labels[by_name[program.input_for_key(spec.key).node]]
            else:
                home = self.mode.output_home(spec, src, self.cluster)
            add(value, home, end)
        return list(found.values())

    def _control_drafts(self, nodes, labels, drafts) -> list[ChannelDraft]:
        """A per-step trigger for every busy process nothing else feeds."""
        default = self.mode.default_label(self.cluster)
        fed = {d.dst for d in drafts}
        busy = {labels[n] for n in nodes if n.op == "call_function"}
        busy |= {d.src for d in drafts}
        return [ChannelDraft(default, label, ChannelKind.CONTROL,
                             send_pos=_CONTROL_POS, recv_pos=_CONTROL_POS)
                for label in sorted(busy - fed - {default}, key=Label.sort_key)]

    # -- schedules --

    def _processes(self, program, nodes, labels, channels, drafts) -> tuple[ProcessPlan, ...]:
        events: dict[Label, list[tuple]] = defaultdict(list)
        for i, node in enumerate(nodes):
            if node.op == "call_function":
                events[labels[node]].append((i, _RUN, "", Instruction(OpKind.RUN, node.name)))
        for channel, draft in zip(channels, drafts):
            if channel.kind is ChannelKind.CONTROL:
                send_key, recv_key = (_CONTROL_POS, _SEND), (_CONTROL_POS, _RECV + 3)
            else:
                send_key, recv_key = (draft.send_pos, _SEND), (draft.recv_pos, _RECV)
            events[channel.src].append((*send_key, channel.name,
                                        Instruction(OpKind.SEND, channel.name)))
            events[channel.dst].append((*recv_key, channel.name,
                                        Instruction(OpKind.RECV, channel.name)))

        state_of: dict[Label, list[str]] = defaultdict(list)
        feeds_of: dict[Label, set[str]] = defaultdict(set)
        for node in nodes:
            if node.op != "placeholder":
                continue
            spec = program.input_spec(node.name)
            if spec.kind.is_state:
                state_of[labels[node]].append(spec.key)
            elif spec.kind is InputKind.HPARAM:
                if node.users:
                    feeds_of[labels[node]].add(spec.key)
            else:  # batch: fed to every process that reads it
                for user in node.users:
                    if user.op == "call_function":
                        feeds_of[labels[user]].add(spec.key)
        outputs_of: dict[Label, list[str]] = defaultdict(list)
        by_name = {n.name: n for n in nodes}
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
            schedule = tuple(event[-1] for event in sorted(events[label], key=lambda e: e[:3]))
            processes.append(ProcessPlan(
                label, tuple(state_of[label]),
                tuple(sorted(feeds_of[label], key=feed_order.__getitem__)),
                tuple(outputs_of[label]), schedule))
        return tuple(processes)


def _segments(nodes: list[fx.Node], labels) -> dict[fx.Node, int]:
    """Index of the segment (maximal run of one label) of every call node."""
    segment: dict[fx.Node, int] = {}
    current, index = None, -1
    for node in nodes:
        if node.op != "call_function":
            continue
        label = labels[node]
        if label != current:
            current, index = label, index + 1
        segment[node] = index
    return segment


def _name_channels(drafts: list[ChannelDraft]):
    """Stable names `src->dst#k`, k counting channels of the pair in send order;
    control channels are `src->dst#c`. Sorts `drafts` in place to match."""
    drafts.sort(key=lambda d: (d.src.sort_key(), d.dst.sort_key(),
                               d.kind is ChannelKind.CONTROL, d.send_pos, d.recv_pos,
                               min((e.value for e in d.edges), default="")))
    counter: dict[tuple[Label, Label], int] = defaultdict(int)
    channels: list[Channel] = []
    sync_pairs = []
    for draft in drafts:
        pair = (draft.src, draft.dst)
        if draft.kind is ChannelKind.CONTROL:
            name = f"{draft.src}->{draft.dst}#c"
        else:
            name = f"{draft.src}->{draft.dst}#{counter[pair]}"
            counter[pair] += 1
        edges = sorted(draft.edges, key=lambda e: (e.src_pos, e.value))
        draft.edges = edges
        channels.append(Channel(name, draft.src, draft.dst, draft.kind,
                                tuple(e.value for e in edges),
                                tuple(e.recv_name for e in edges),
                                sum(e.nbytes for e in edges)))
        sync_pairs += [(e.state_key, e.src, e.dst, name) for e in edges if e.state_key]
    return channels, sync_pairs


def split(program: Program, cluster: Cluster | None = None, mode: Mode | None = None) -> SplitPlan:
    """`GraphSplitter(program, cluster, mode).split()`."""
    return GraphSplitter(program, cluster, mode).split()
