"""The `SplitPlan`: what each process runs, and the channels between them.

A plan is plain data. It names graph nodes by their fx names and state by its
keys, so every process that computes it from the same script gets the same
plan. Its forms and checks are functions over it, in modules that import this
one (never the reverse): the text form (`text.plan_to_text` /
`text.plan_from_text`, which parse back to an equal plan), the picture
(`dot.plan_to_dot`) and the invariants (`check.check_plan`). The program those
names refer to travels beside it, in a `SplitProgram` (see
`splitting.graph_splitter.split_program`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

from ..errors import PlanError
from ..labels import Cluster, Label
from .pipeline_order import PipelineSchedule, max_in_flight, theoretical_bubble

__all__ = [
    "ModeKind",
    "ChannelKind",
    "OpKind",
    "Channel",
    "Instruction",
    "ProcessPlan",
    "DataSync",
    "CollectiveEntry",
    "ParallelSummary",
    "CachedTableEntry",
    "PipelineSchedule",
    "PipelineSummary",
    "action_of",
    "actions_in",
    "SplitPlan",
]


class ModeKind(Enum):
    GENERAL = "general"
    PARAMETER_SERVER = "parameter_server"
    EMBEDDING_CACHE = "embedding_cache"
    PARALLEL = "parallel"


class ChannelKind(Enum):
    DATA = "data"
    CONTROL = "control"  # zero tensors: orders two processes where no data does


class OpKind(Enum):
    RUN = "run"
    SEND = "send"
    RECV = "recv"


class Channel(NamedTuple):
    """A fused Send/Recv pair: one message per step from `src` to `dst`.

    `values` are node names on the sender, `recv_names` the names the receiver
    binds them to (the same in general mode; per-worker slots in
    parameter-server mode). A NamedTuple: plans of 100k nodes make tens of
    thousands of these.
    """

    name: str
    src: Label
    dst: Label
    kind: ChannelKind
    values: tuple[str, ...] = ()
    recv_names: tuple[str, ...] = ()
    nbytes: int = 0


class Instruction(NamedTuple):
    kind: OpKind
    target: str  # node name for RUN, channel name for SEND and RECV

    def __str__(self) -> str:
        return f"{self.kind.value} {self.target}"


@dataclass(frozen=True, slots=True)
class ProcessPlan:
    """One process's share of the step.

    `state`: state keys it owns (holds between steps, updates, sends to readers).
    `feeds`: batch and hyperparameter keys it reads from its own feeds.
    `outputs`: output keys (loss, grads) delivered to it.
    """

    label: Label
    state: tuple[str, ...]
    feeds: tuple[str, ...]
    outputs: tuple[str, ...]
    schedule: tuple[Instruction, ...]

    @property
    def num_ops(self) -> int:
        return sum(1 for i in self.schedule if i.kind is OpKind.RUN)

    @property
    def is_idle(self) -> bool:
        return not self.schedule


@dataclass(frozen=True, slots=True)
class DataSync:
    """State `key`, updated by `owner`, read by `reader`: the new value reaches
    the reader through `channel` before the reader's first read of each step."""

    key: str
    owner: Label
    reader: Label
    channel: str


@dataclass(frozen=True, slots=True)
class CollectiveEntry:
    """One change of placement a parallel step makes: `value` (a node of the
    captured step) goes from placement `src` to `dst` (text forms: R, P, S(d))
    by a collective of `kind`, sending `nbytes` per step over all members."""

    kind: str
    value: str
    src: str
    dst: str
    nbytes: int

    def __str__(self) -> str:
        return f"{self.kind} {self.value} {self.src}->{self.dst} {self.nbytes}"


@dataclass(frozen=True, slots=True)
class CachedTableEntry:
    """A table an embedding-cache plan keeps on the servers (rows sliced by a
    hash of the id) and caches on every worker. Its rows travel outside the
    channels, between each worker and the servers: misses pulled, evicted
    dirty rows (or, with several workers, gradients) pushed; per worker and
    step at most `lookups` rows each way, each at most `row_bytes` (the row
    and its optimizer state). `lookups` is 0 where the ids are not a batch
    input, so not known before the step runs."""

    key: str
    num_rows: int
    row_bytes: int
    lookups: int
    cache_rows: int
    policy: str

    def __str__(self) -> str:
        return (f"{self.key} rows={self.num_rows} row_bytes={self.row_bytes} "
                f"lookups={self.lookups} cache_rows={self.cache_rows} policy={self.policy}")

    @classmethod
    def parse(cls, text: str) -> CachedTableEntry:
        key, *pairs = text.split()
        fields = dict(pair.split("=", 1) for pair in pairs)
        return cls(key, int(fields["rows"]), int(fields["row_bytes"]), int(fields["lookups"]),
                   int(fields["cache_rows"]), fields["policy"])


@dataclass(frozen=True, slots=True)
class ParallelSummary:
    """What a parallel-mode plan adds: its groups (each named by its first
    member), where each state slot lives and how it is sharded, and the
    collectives of one step."""

    groups: tuple[tuple[Label, ...], ...]
    shardings: tuple[tuple[str, str, Label], ...]  # (state key, placement, group name)
    collectives: tuple[CollectiveEntry, ...]

    def group_of(self, label: Label) -> tuple[Label, ...] | None:
        return next((g for g in self.groups if label in g), None)

    def explain(self) -> str:
        lines = ["groups: " + "  ".join("{" + ", ".join(map(str, g)) + "}" for g in self.groups)]
        lines.append("state:")
        lines += [f"  {key}: {placement} on group {group}" for key, placement, group
                  in self.shardings]
        total = sum(c.nbytes for c in self.collectives)
        lines.append(f"collectives per step ({len(self.collectives)}, {total} bytes):")
        lines += [f"  {c.value}: {c.src} -> {c.dst} {c.kind}, {c.nbytes} B"
                  for c in self.collectives] or ["  none"]
        return "\n".join(lines)


# A micro-batched node's name ends in its action: `addmm__F3` is micro-batch
# 3's forward, `mm_2__B0` micro-batch 0's backward, `addmm__2F3` virtual
# stage 2's forward of micro-batch 3 (interleaved).
_ACTION_RE = re.compile(r"__(\d*[FB]\d+)$")


def action_of(node_name: str) -> str | None:
    """The action (`"F3"`, `"B0"`, `"2F3"`) a micro-batched node belongs to,
    or None for a node run once per step (shared forward pieces, the optimizer)."""
    match = _ACTION_RE.search(node_name)
    return None if match is None else match.group(1)


def actions_in(schedule: tuple[Instruction, ...]) -> tuple[str, ...]:
    """The actions a process's schedule runs, in order: each maximal run of
    nodes of one action counts once (`("F0", "F1", "B0", ...)`)."""
    actions: list[str] = []
    for instr in schedule:
        if instr.kind is OpKind.RUN:
            action = action_of(instr.target)
            if action is not None and (not actions or actions[-1] != action):
                actions.append(action)
    return tuple(actions)


@dataclass(frozen=True, slots=True)
class PipelineSummary:
    """What a micro-batched plan adds: its schedule, the number of
    micro-batches, the processes in pipeline order (`stages`), per process
    the order of its actions (`"F0"`, `"B0"`; `"2F0"` with a virtual stage
    under interleaved 1F1B) as its schedule runs them, and the chunks each
    process holds (virtual stages; 1 but under interleaved 1F1B).
    `check_plan` re-derives the actions from the schedules and checks the
    micro-batches in flight against what the schedule promises."""

    schedule: PipelineSchedule
    num_microbatches: int
    stages: tuple[Label, ...]
    actions: tuple[tuple[str, ...], ...]  # one tuple per process, in stage order
    num_chunks: int = 1

    @property
    def num_virtual_stages(self) -> int:
        return len(self.stages) * self.num_chunks

    def process_of(self, virtual_stage: int) -> int:
        """The index (in `stages`) of the process that runs a virtual stage."""
        return virtual_stage % len(self.stages)

    def max_in_flight(self, stage: int) -> int:
        """The most (stage, micro-batch) pairs process `stage` may hold
        activations for."""
        return max_in_flight(self.schedule, len(self.stages), stage, self.num_microbatches,
                             self.num_chunks)

    def theoretical_bubble(self) -> float:
        """The idle fraction (P-1)/(V*M+P-1) with equal stages (V = 1 but
        under interleaved 1F1B); see `pipeline_order.theoretical_bubble`."""
        return theoretical_bubble(len(self.stages), self.num_microbatches, self.num_chunks)

    def explain(self) -> str:
        over = (f"{len(self.stages)} processes, {self.num_chunks} chunks each"
                if self.num_chunks > 1 else f"{len(self.stages)} stages")
        lines = [f"pipeline {self.schedule.value}, {self.num_microbatches} micro-batches "
                 f"over {over} (bubble in theory "
                 f"{self.theoretical_bubble():.2f}):"]
        lines += [f"  {stage}: {' '.join(actions)}"
                  for stage, actions in zip(self.stages, self.actions)]
        return "\n".join(lines)


@dataclass(frozen=True, eq=True)
class SplitPlan:
    mode: ModeKind
    cluster: Cluster
    processes: tuple[ProcessPlan, ...]
    channels: tuple[Channel, ...]
    data_syncs: tuple[DataSync, ...] = ()
    # Parallel mode: groups, shardings, collectives (None in other modes).
    parallel: ParallelSummary | None = None
    # Embedding-cache mode: the cached tables, whose rows travel outside the channels.
    cached_tables: tuple[CachedTableEntry, ...] = ()
    # General mode with micro-batches: the pipeline schedule (None otherwise).
    pipeline: PipelineSummary | None = None
    # Parameter-server mode: a worker at step c may read state that data-syncs
    # bring it at version >= c - staleness (0: the version of step c, exactly).
    staleness: int = 0
    # A short hash of the text form, computed once when the plan is made (the
    # split, `plan_from_text`; `text.plan_fingerprint`): two processes with the
    # same script and cluster agree on it, so the scheduler can refuse a
    # mismatched one. Empty for a plan put together by hand.
    fingerprint: str = field(default="", compare=False)
    _index: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._index["process"] = {p.label: p for p in self.processes}
        self._index["channel"] = {c.name: c for c in self.channels}

    # -- lookups --

    def process(self, label: Label) -> ProcessPlan:
        try:
            return self._index["process"][label]
        except KeyError:
            known = ", ".join(str(p.label) for p in self.processes)
            raise PlanError(
                f"no process {label} in this plan; it has {known}") from None

    def channel(self, name: str) -> Channel:
        try:
            return self._index["channel"][name]
        except KeyError:
            raise PlanError(f"no channel {name!r} in this plan") from None

    @property
    def labels(self) -> list[Label]:
        return [p.label for p in self.processes]

    def send_channels(self, label: Label) -> list[Channel]:
        return [c for c in self.channels if c.src == label]

    def recv_channels(self, label: Label) -> list[Channel]:
        return [c for c in self.channels if c.dst == label]

    def messages_per_step(self) -> int:
        return len(self.channels)

    def bytes_per_step(self) -> int:
        return sum(c.nbytes for c in self.channels)

    def row_bytes_per_step(self) -> int:
        """Embedding-cache mode: the most a worker's cached tables exchange with
        the servers in a step, each way (every lookup a miss); 0 otherwise."""
        return sum(t.lookups * t.row_bytes for t in self.cached_tables)

    # -- summaries --

    def explain(self) -> str:
        """Parallel mode: the groups, each state slot's placement and the
        collectives with their bytes (per node with alternatives:
        `ParallelLayout.explain()`, the split's artifacts)."""
        if self.parallel is None:
            return self.summary()
        return self.summary() + "\n" + self.parallel.explain()

    def summary(self) -> str:
        lines = [f"{self.mode.value} plan, {self.cluster}: "
                 f"{self.messages_per_step()} messages, "
                 f"{self.bytes_per_step()} bytes per step"]
        for proc in self.processes:
            sends = len(self.send_channels(proc.label))
            recvs = len(self.recv_channels(proc.label))
            lines.append(f"  {proc.label.describe()}: {proc.num_ops} ops, "
                         f"{sends} sends, {recvs} receives, {len(proc.state)} state")
        if self.pipeline is not None:
            lines.append(self.pipeline.explain())
        if self.cached_tables:
            tables = len(self.cached_tables)
            lines.append(f"  embedding rows of {tables} cached table{'s' if tables > 1 else ''}, "
                         f"outside these messages: up to {self.row_bytes_per_step()} bytes per "
                         f"step each way per worker (misses pulled, dirty rows pushed)")
        return "\n".join(lines)
