"""The plan's short text form, its parser and its fingerprint.
`plan_from_text(plan_to_text(p)) == p`.

    splitrun-plan 1
    mode general
    cluster workers=2 servers=0
    channel w0->w1#0 data 160: relu detach
    channel s0->w1#0 data 64: p_w>p_w.w1
    channel w0->w2#c control 0:
    sync l1.weight w0 -> w1 w0->w1#0
    process w0
      state l1.weight l1.bias
      feeds batch.0 lr step
      outputs loss
      run t addmm relu
      send w0->w1#0
    end

A value received under another name is written `sent>received`. A parallel
plan adds its groups, state shardings and collectives:

    group w0 w1
    shard l1.weight S(0) w0
    collective all-reduce addmm_1 P->R 256

A micro-batched plan adds its schedule and each stage's order of micro-batch
forwards (F) and backwards (B); its nodes' names end in their action
(`addmm__F0`):

    pipeline 1f1b microbatches=4
    stage w0: F0 F1 B0 F2 B1 F3 B2 B3
    stage w1: F0 B0 F1 B1 F2 B2 F3 B3

Interleaved 1F1B adds the chunks each process holds, and its actions name
their virtual stage (`2F0`, nodes `addmm__2F0`):

    pipeline interleaved microbatches=2 chunks=2
    stage w0: 0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1

A parameter-server plan with a staleness bound says it (`staleness 2`).
"""

from __future__ import annotations

import dataclasses
import hashlib

from ..errors import LabelError, PlanParseError
from ..labels import Cluster, Label
from .model import (
    CachedTableEntry,
    Channel,
    ChannelKind,
    CollectiveEntry,
    DataSync,
    Instruction,
    ModeKind,
    OpKind,
    ParallelSummary,
    PipelineSchedule,
    PipelineSummary,
    ProcessPlan,
    SplitPlan,
)

__all__ = ["plan_to_text", "plan_from_text", "plan_fingerprint", "with_fingerprint"]

_HEADER = "splitrun-plan 1"


def _value_token(sent: str, received: str) -> str:
    return sent if sent == received else f"{sent}>{received}"


def plan_fingerprint(plan: SplitPlan) -> str:
    """A short hash of the plan's text form (what `SplitPlan.fingerprint` holds)."""
    return hashlib.sha256(plan_to_text(plan).encode()).hexdigest()[:16]


def with_fingerprint(plan: SplitPlan) -> SplitPlan:
    """`plan` with its fingerprint computed: the last step of making a plan."""
    return dataclasses.replace(plan, fingerprint=plan_fingerprint(plan), _index={})


def plan_to_text(plan: SplitPlan) -> str:
    lines = [_HEADER, f"mode {plan.mode.value}",
             f"cluster workers={plan.cluster.num_workers} servers={plan.cluster.num_servers}"]
    if plan.parallel is not None:
        lines += [f"group {' '.join(map(str, g))}" for g in plan.parallel.groups]
        lines += [f"shard {key} {placement} {group}"
                  for key, placement, group in plan.parallel.shardings]
        lines += [f"collective {c}" for c in plan.parallel.collectives]
    lines += [f"cached_table {t}" for t in plan.cached_tables]
    if plan.pipeline is not None:
        pipeline = plan.pipeline
        chunks = f" chunks={pipeline.num_chunks}" if pipeline.num_chunks > 1 else ""
        lines.append(f"pipeline {pipeline.schedule.value} "
                     f"microbatches={pipeline.num_microbatches}{chunks}")
        lines += [f"stage {stage}: {' '.join(actions)}"
                  for stage, actions in zip(pipeline.stages, pipeline.actions)]
    if plan.staleness:
        lines.append(f"staleness {plan.staleness}")
    for c in plan.channels:
        values = " ".join(_value_token(s, r) for s, r in zip(c.values, c.recv_names))
        lines.append(f"channel {c.name} {c.kind.value} {c.nbytes}: {values}".rstrip())
    for s in plan.data_syncs:
        lines.append(f"sync {s.key} {s.owner} -> {s.reader} {s.channel}")
    for proc in plan.processes:
        lines.append(f"process {proc.label}")
        for field_name in ("state", "feeds", "outputs"):
            values = getattr(proc, field_name)
            if values:
                lines.append(f"  {field_name} {' '.join(values)}")
        run: list[str] = []
        for instr in proc.schedule:
            if instr.kind is OpKind.RUN:
                run.append(instr.target)
                continue
            if run:
                lines.append(f"  run {' '.join(run)}")
                run = []
            lines.append(f"  {instr.kind.value} {instr.target}")
        if run:
            lines.append(f"  run {' '.join(run)}")
        lines.append("end")
    return "\n".join(lines) + "\n"


def plan_from_text(text: str) -> SplitPlan:
    lines = text.splitlines()
    if not lines or lines[0].strip() != _HEADER:
        raise PlanParseError(f"line 1: expected {_HEADER!r}, got {lines[0] if lines else ''!r}")
    reader = _PlanReader()
    for number, raw in enumerate(lines[1:], start=2):
        line = raw.strip()
        if not line:
            continue
        word, _, rest = line.partition(" ")
        try:
            reader.read(word, rest)
        except PlanParseError:
            raise
        except (ValueError, KeyError, LabelError) as exc:
            raise PlanParseError(f"line {number}: {exc}: {raw!r}") from None
    return reader.plan()


class _PlanReader:
    """The parts of a plan as its lines give them, one line at a time
    (`read`); `plan()` puts them together once every line is read."""

    def __init__(self) -> None:
        self.mode: ModeKind | None = None
        self.cluster: Cluster | None = None
        self.channels: list[Channel] = []
        self.syncs: list[DataSync] = []
        self.processes: list[ProcessPlan] = []
        self.groups: list[tuple[Label, ...]] = []
        self.shardings: list[tuple[str, str, Label]] = []
        self.collectives: list[CollectiveEntry] = []
        self.tables: list[CachedTableEntry] = []
        self.pipeline: tuple[PipelineSchedule, int, int] | None = None
        self.stages: list[tuple[Label, tuple[str, ...]]] = []
        self.staleness = 0
        self.current: dict | None = None  # the process whose lines are being read
        self.top_level = {
            "mode": self._mode, "cluster": self._cluster, "channel": self._channel,
            "group": self._group, "shard": self._shard, "collective": self._collective,
            "cached_table": self._cached_table, "pipeline": self._pipeline,
            "stage": self._stage, "staleness": self._staleness, "sync": self._sync,
            "process": self._process}

    def read(self, word: str, rest: str) -> None:
        if self.current is not None:
            self._process_line(word, rest)
            return
        handler = self.top_level.get(word)
        if handler is None:
            raise ValueError(f"unknown line kind {word!r}")
        handler(rest)

    def _process_line(self, word: str, rest: str) -> None:
        current = self.current
        if word == "end":
            self.processes.append(ProcessPlan(
                current["label"], tuple(current["state"]), tuple(current["feeds"]),
                tuple(current["outputs"]), tuple(current["schedule"])))
            self.current = None
        elif word in ("state", "feeds", "outputs"):
            current[word] = rest.split()
        elif word == "run":
            current["schedule"].extend(Instruction(OpKind.RUN, n) for n in rest.split())
        elif word in ("send", "recv"):
            current["schedule"].append(Instruction(OpKind(word), rest.strip()))
        else:
            raise ValueError(f"unknown process line {word!r}")

    def _mode(self, rest: str) -> None:
        self.mode = ModeKind(rest.strip())

    def _cluster(self, rest: str) -> None:
        fields = dict(item.split("=") for item in rest.split())
        self.cluster = Cluster(int(fields["workers"]), int(fields["servers"]))

    def _channel(self, rest: str) -> None:
        head, _, values = rest.partition(":")
        name, kind, nbytes = head.split()
        src, dst = (Label.parse(x) for x in name.split("#")[0].split("->"))
        pairs = [tok.split(">", 1) if ">" in tok else (tok, tok) for tok in values.split()]
        self.channels.append(Channel(name, src, dst, ChannelKind(kind),
                                     tuple(p[0] for p in pairs), tuple(p[1] for p in pairs),
                                     int(nbytes)))

    def _group(self, rest: str) -> None:
        self.groups.append(tuple(Label.parse(x) for x in rest.split()))

    def _shard(self, rest: str) -> None:
        key, placement, group = rest.split()
        self.shardings.append((key, placement, Label.parse(group)))

    def _collective(self, rest: str) -> None:
        kind, value, change, nbytes = rest.split()
        src, dst = change.split("->")
        self.collectives.append(CollectiveEntry(kind, value, src, dst, int(nbytes)))

    def _cached_table(self, rest: str) -> None:
        self.tables.append(CachedTableEntry.parse(rest))

    def _pipeline(self, rest: str) -> None:
        schedule, *counts = rest.split()
        settings = dict(count.partition("=")[::2] for count in counts)
        if not 1 <= len(counts) <= 2 or "microbatches" not in settings \
                or not set(settings) <= {"microbatches", "chunks"}:
            raise ValueError("expected 'pipeline SCHEDULE microbatches=M [chunks=V]'")
        self.pipeline = (PipelineSchedule(schedule), int(settings["microbatches"]),
                         int(settings.get("chunks", 1)))

    def _stage(self, rest: str) -> None:
        stage, _, actions = rest.partition(":")
        self.stages.append((Label.parse(stage), tuple(actions.split())))

    def _staleness(self, rest: str) -> None:
        self.staleness = int(rest)

    def _sync(self, rest: str) -> None:
        key, owner, arrow, reader, channel = rest.split()
        if arrow != "->":
            raise ValueError("expected 'KEY OWNER -> READER CHANNEL'")
        self.syncs.append(DataSync(key, Label.parse(owner), Label.parse(reader), channel))

    def _process(self, rest: str) -> None:
        self.current = {"label": Label.parse(rest), "state": [], "feeds": [], "outputs": [],
                        "schedule": []}

    def plan(self) -> SplitPlan:
        if self.current is not None:
            raise PlanParseError(f"process {self.current['label']} has no 'end' line")
        if self.mode is None or self.cluster is None:
            raise PlanParseError("the plan needs a 'mode' and a 'cluster' line")
        parallel = None
        if self.groups or self.shardings or self.collectives:
            parallel = ParallelSummary(tuple(self.groups), tuple(self.shardings),
                                       tuple(self.collectives))
        summary = None
        if self.pipeline is not None:
            schedule, num_microbatches, num_chunks = self.pipeline
            summary = PipelineSummary(schedule, num_microbatches,
                                      tuple(s for s, _ in self.stages),
                                      tuple(a for _, a in self.stages), num_chunks)
        elif self.stages:
            raise PlanParseError("'stage' lines need a 'pipeline' line before them")
        return with_fingerprint(SplitPlan(self.mode, self.cluster, tuple(self.processes),
                                          tuple(self.channels), tuple(self.syncs), parallel,
                                          tuple(self.tables), summary, self.staleness))
