"""Execution modes: the hooks that make one splitter serve several jobs.

As in MindSpore's `graph_splitter.h`, a mode may relabel or add nodes before the
split (`prebuild`), groups inter-process edges into fused channels (`fuse`),
and may adjust the finished plan (`postbuild`). The base `Mode` is the
default: no rewrite, exact label match, fusion by source segment. The modes
that refine it live in `modes/`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from ..initial_state import copy_state
from ..labels import Cluster, Label
from ..plan.model import ChannelKind, ModeKind, SplitPlan
from ..program import OutputKind, OutputSpec, Program

__all__ = ["Edge", "ChannelDraft", "ModeArtifacts", "StatePiece", "Mode",
           "fuse_by_source_segment"]

STEP_START = -1  # position of values that exist before the step runs (state, feeds)
# Step-start values up to this size piggyback on a later message (see fuse).
PIGGYBACK_MAX_BYTES = 64 * 1024


@dataclass(slots=True)
class Edge:
    """One value crossing from `src` to `dst`: one receive per (value, dst)."""

    value: str          # producer node name on src
    src: Label
    dst: Label
    src_pos: int        # producer's position in the global order, or STEP_START
    src_segment: int    # index of the producer's segment, or STEP_START
    dst_pos: int        # first consumer's position on dst
    nbytes: int
    state_key: str | None = None  # set when the value is a state slot (data-sync)
    recv_name: str | None = None  # name on the receiver; None: the same as `value`


@dataclass(slots=True)
class ChannelDraft:
    src: Label
    dst: Label
    kind: ChannelKind
    edges: list[Edge] = field(default_factory=list)
    send_pos: int = STEP_START
    recv_pos: int = STEP_START


@dataclass(frozen=True, slots=True)
class StatePiece:
    """Where a state slot a mode keeps in pieces lies in the captured
    program's state: `key` of shape `size`; this piece covers `sizes` from
    `offsets` (both None for a whole replica, which its first holder writes
    into checkpoints)."""

    key: str
    size: tuple[int, ...]
    offsets: tuple[int, ...] | None
    sizes: tuple[int, ...] | None
    is_first_holder: bool

    @property
    def is_replica(self) -> bool:
        return self.offsets is None


@dataclass(frozen=True)
class ModeArtifacts:
    """The typed facts a mode's prebuild hands the runtime beside the
    rewritten program (which server owns what, which tables are cached).

    The runtime asks a split's artifacts only through what this base class
    declares, never by their type: the state as checkpoints hold it
    (`split_state`, `full_state`, `state_piece`), the cached tables
    (`tables`, `initial`, `fused_groups`) and the process groups its
    collectives run on (`process_groups`). The defaults describe a mode that
    does none of that (general mode's artifacts are this class itself)."""

    # Embedding-cache mode: the tables taken out of the graph (servers hold
    # their rows, workers cache them; `tuple[CachedTable, ...]`), their
    # starting values with their row-wise optimizer state, and the tables
    # whose caches share a buffer. Plain class attributes, not fields: the
    # mode's artifacts declare them as fields of their own.
    tables = ()
    initial = MappingProxyType({})
    fused_groups = ()

    @property
    def process_groups(self) -> tuple[tuple[Label, ...], ...]:
        """The groups whose collectives run on torch.distributed process
        groups (one each); none when collectives ride the plan's channels."""
        return ()

    def state_piece(self, key: str) -> StatePiece | None:
        """Where the rewritten program's state `key` lies in the captured
        program's state; None when it is a captured key itself (whole)."""
        return None

    def split_state(self, full: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A state keyed like the captured program (a checkpoint's, the initial
        one) as the rewritten program's state. The same (nothing made of an
        `InitialState`), unless the mode keeps state in pieces (parallel
        mode's shards)."""
        return copy_state(full)

    def full_state(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The inverse of `split_state`: what checkpoints and `finish()` hold."""
        return dict(state)


class Mode:
    """Base mode: exact label match, fusion by source segment."""

    kind: ModeKind = ModeKind.GENERAL

    def default_label(self, cluster: Cluster) -> Label:
        return Label.worker(0)

    def reject_label(self, label: Label, cluster: Cluster) -> str | None:
        """Why this mode cannot run an op on `label`, or None if it can."""
        return None

    def works_outside_the_plan(self, label: Label) -> bool:
        """True if `label` has work besides its share of the step (an
        embedding cache's table server), so an empty share is no mistake."""
        return False

    def prebuild(self, program: Program, cluster: Cluster
                 ) -> tuple[Program, ModeArtifacts]:
        """The program to split (rewritten if the mode adds or relabels nodes)
        and the mode's artifacts for the runtime."""
        return program, ModeArtifacts()

    def output_home(self, spec: OutputSpec, producer: Label, cluster: Cluster) -> Label:
        """Where an output is delivered: the loss goes to the default process
        (the driver shows it), everything else stays where it is computed."""
        if spec.kind is OutputKind.LOSS:
            return self.default_label(cluster)
        return producer

    def fuse(self, edges: list[Edge], cluster: Cluster) -> list[ChannelDraft]:
        return fuse_by_source_segment(edges)

    def postbuild(self, plan: SplitPlan, program: Program,
                  artifacts: ModeArtifacts) -> SplitPlan:
        return plan


def fuse_by_source_segment(edges: list[Edge]) -> list[ChannelDraft]:
    """Edges from A to B whose values are produced in the same segment of A ride
    one message, sent right after the last of them is produced and received
    right before the first of them is used.

    A segment is a maximal run of A's nodes in the global order, so every
    consumer on B comes after the segment's end: send < receive in the global
    order, which keeps the schedules deadlock-free. Small values that exist at
    step start (learning rate, step count, small state) ride the earliest
    message to the same process that is sent before they are needed, instead of
    costing a message of their own.
    """
    groups: dict[tuple, ChannelDraft] = {}
    small_start: list[Edge] = []
    for edge in edges:
        if edge.src_segment == STEP_START and edge.nbytes <= PIGGYBACK_MAX_BYTES:
            small_start.append(edge)
            continue
        _add_to_group(groups, (edge.src, edge.dst, edge.src_segment), edge)
    by_pair = defaultdict(list)
    for draft in groups.values():
        by_pair[(draft.src, draft.dst)].append(draft)
    for drafts in by_pair.values():
        drafts.sort(key=lambda d: d.send_pos)
    for edge in small_start:
        ride = next((d for d in by_pair[(edge.src, edge.dst)] if d.send_pos < edge.dst_pos), None)
        if ride is None:
            _add_to_group(groups, (edge.src, edge.dst, STEP_START), edge)
        else:
            ride.edges.append(edge)
            ride.recv_pos = min(ride.recv_pos, edge.dst_pos)
    return list(groups.values())


def _add_to_group(groups: dict[tuple, ChannelDraft], key: tuple, edge: Edge) -> None:
    draft = groups.get(key)
    if draft is None:
        draft = groups[key] = ChannelDraft(edge.src, edge.dst, ChannelKind.DATA,
                                           send_pos=edge.src_pos, recv_pos=edge.dst_pos)
    draft.edges.append(edge)
    draft.send_pos = max(draft.send_pos, edge.src_pos)
    draft.recv_pos = min(draft.recv_pos, edge.dst_pos)
