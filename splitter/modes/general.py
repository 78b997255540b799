"""General mode: the model split across processes as it is labelled, and
optionally cut into micro-batches that flow through the stages on a pipeline
schedule (`microbatch.py`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..errors import PlanError
from ..labels import Cluster, Label
from ..plan.model import ModeKind, PipelineSchedule, PipelineSummary, SplitPlan, action_of
from ..program import Program
from ..splitting.mode import (
    STEP_START,
    ChannelDraft,
    Edge,
    Mode,
    ModeArtifacts,
    fuse_by_source_segment,
)
from .microbatch import LossReduction, microbatch_step

__all__ = ["GeneralMode", "PipelineArtifacts"]


@dataclass(frozen=True)
class PipelineArtifacts(ModeArtifacts):
    """A micro-batched general-mode split: its stages in forward order and
    the order of each stage's actions its schedule lays out."""

    schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B
    num_microbatches: int = 1
    stages: tuple[Label, ...] = ()
    actions: tuple[tuple[str, ...], ...] = ()
    loss_reduction: LossReduction = LossReduction.MEAN
    num_chunks: int = 1


class GeneralMode(Mode):
    """Pipeline-style splitting of a model across processes.

    With `microbatches=M` (> 1) the step's batch is cut into M micro-batches
    (rows along the first dimension of every batch input) that flow through
    the stages on `schedule`: "gpipe" (every forward, then every backward),
    "1f1b" (at most S-s micro-batches in flight on stage s of S) or
    "interleaved" (1F1B over several chunks per process, each process holding
    pieces of the model in turn, as torch's ScheduleInterleaved1F1B). Gradients
    are summed over the micro-batches and the optimizer runs once, so the
    step equals the unsplit one within float rounding (see `microbatch`)."""

    kind = ModeKind.GENERAL

    def __init__(self, microbatches: int = 1,
                 schedule: PipelineSchedule | str = PipelineSchedule.ONE_F_ONE_B) -> None:
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) \
                or microbatches < 1:
            raise PlanError(f"GeneralMode(microbatches={microbatches!r}): the number of "
                            f"micro-batches must be an integer of at least 1")
        try:
            schedule = PipelineSchedule(schedule)
        except ValueError:
            names = ", ".join(repr(s.value) for s in PipelineSchedule)
            raise PlanError(f"GeneralMode(schedule={schedule!r}): unknown schedule; "
                            f"choose one of {names}") from None
        self.microbatches = microbatches
        self.schedule = schedule

    def prebuild(self, program: Program, cluster: Cluster
                 ) -> tuple[Program, ModeArtifacts]:
        if self.microbatches == 1:
            return program, ModeArtifacts()
        step = microbatch_step(program, cluster, self, self.microbatches, self.schedule)
        return step.program, PipelineArtifacts(self.schedule, self.microbatches, step.stages,
                                               step.actions, step.loss_reduction,
                                               step.num_chunks)

    def fuse(self, edges: list[Edge], cluster: Cluster) -> list[ChannelDraft]:
        """As in the base mode, but a segment is also cut where one
        micro-batch's action ends and the next begins: each action's
        activations (or gradients) leave as soon as that action is done."""
        if self.microbatches > 1:
            pieces: dict[tuple[int, str | None], int] = {}
            for edge in edges:
                if edge.src_segment != STEP_START:
                    key = (edge.src_segment, action_of(edge.value))
                    edge.src_segment = pieces.setdefault(key, len(pieces))
        return fuse_by_source_segment(edges)

    def postbuild(self, plan: SplitPlan, program: Program,
                  artifacts: ModeArtifacts) -> SplitPlan:
        if not isinstance(artifacts, PipelineArtifacts):
            return plan
        summary = PipelineSummary(artifacts.schedule, artifacts.num_microbatches,
                                  artifacts.stages, artifacts.actions, artifacts.num_chunks)
        return dataclasses.replace(plan, pipeline=summary, _index={})
