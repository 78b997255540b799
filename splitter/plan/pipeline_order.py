"""Pipeline schedules as plain data: the order of each process's micro-batch
actions, how many micro-batches it may hold, and the bubble in theory.

An action is one micro-batch's forward (F) or backward (B) through one stage.
GPipe and 1F1B give each process one stage, and name actions `F3`, `B0`.
Interleaved 1F1B gives each process several stages (virtual stages, or
chunks): with P processes and V chunks each, virtual stage v (of P*V, in
forward order) runs on process v mod P, and actions carry their virtual
stage as torch's `_Action` prints them: `2F3` is virtual stage 2's forward
of micro-batch 3.
"""

from __future__ import annotations

import re
from collections import defaultdict
from enum import Enum
from typing import NamedTuple

from ..errors import PlanError

__all__ = ["PipelineSchedule", "Action", "stage_actions", "interleaved_rounds",
           "max_in_flight", "theoretical_bubble"]


class PipelineSchedule(Enum):
    """The order in which a stage runs its micro-batches' forwards (F) and
    backwards (B): GPipe runs every forward, then every backward; 1F1B
    (PipeDream-flush) starts S-1-s forwards ahead on stage s, then alternates
    one forward and one backward, so at most S-s micro-batches are in flight;
    interleaved 1F1B (Megatron-LM's, as torch's ScheduleInterleaved1F1B
    orders it) does the same over several chunks per process."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"


_ACTION_RE = re.compile(r"^(\d*)([FB])(\d+)$")


class Action(NamedTuple):
    """One action: `stage` the virtual stage (None where each process is one
    stage), `phase` "F" or "B", `micro` the micro-batch."""

    stage: int | None
    phase: str
    micro: int

    def __str__(self) -> str:
        return f"{'' if self.stage is None else self.stage}{self.phase}{self.micro}"

    @classmethod
    def parse(cls, text: str) -> Action:
        match = _ACTION_RE.match(text)
        if match is None:
            raise ValueError(f"{text!r} is not an action (F3, B0, or 2F3 with a stage)")
        stage, phase, micro = match.groups()
        return cls(int(stage) if stage else None, phase, int(micro))


def interleaved_rounds(num_processes: int, num_microbatches: int) -> int:
    """Micro-batches per round of interleaved 1F1B: torch's flexible rule,
    max(1, M // P) rounds, which must divide M (Megatron-LM asks M % P == 0)."""
    rounds = max(1, num_microbatches // num_processes)
    if num_microbatches % rounds:
        fits = [m for m in range(num_processes, 4 * num_processes + 1)
                if m % max(1, m // num_processes) == 0][:6]
        raise PlanError(
            f"interleaved 1F1B over {num_processes} processes runs {num_microbatches} "
            f"micro-batches in {rounds} rounds of {num_microbatches // rounds}, which "
            f"leaves {num_microbatches % rounds} over; choose microbatches among {fits} "
            f"(a multiple of the number of processes always works)")
    return num_microbatches // rounds


def _interleaved_warmup(num_processes: int, process: int, num_microbatches: int,
                        num_chunks: int) -> int:
    """Forwards process `process` runs before its first backward: the last
    process runs its first V-1 rounds ahead, each process before it two
    more (one forward and one backward further from the loss)."""
    per_round = interleaved_rounds(num_processes, num_microbatches)
    warmup = (num_chunks - 1) * per_round + 2 * (num_processes - 1 - process)
    return min(warmup, num_microbatches * num_chunks)


def stage_actions(schedule: PipelineSchedule, num_processes: int, process: int,
                  num_microbatches: int, num_chunks: int = 1) -> list[Action]:
    """Process `process`'s actions under `schedule`, in order."""
    if schedule is PipelineSchedule.INTERLEAVED:
        return _interleaved_actions(num_processes, process, num_microbatches, num_chunks)
    forwards = [Action(None, "F", m) for m in range(num_microbatches)]
    backwards = [Action(None, "B", m) for m in range(num_microbatches)]
    if schedule is PipelineSchedule.GPIPE:
        return forwards + backwards
    warmup = min(num_processes - 1 - process, num_microbatches)
    actions = forwards[:warmup]
    for m in range(num_microbatches - warmup):
        actions += [forwards[warmup + m], backwards[m]]
    return actions + backwards[num_microbatches - warmup:]


def _interleaved_actions(num_processes: int, process: int, num_microbatches: int,
                         num_chunks: int) -> list[Action]:
    """Depth first, as torch's ScheduleInterleaved1F1B: a round of forwards
    through each chunk in turn, then one forward and one backward (the
    backwards through the chunks in reverse), then the remaining backwards."""
    per_round = interleaved_rounds(num_processes, num_microbatches)
    warmup = _interleaved_warmup(num_processes, process, num_microbatches, num_chunks)
    total = num_microbatches * num_chunks
    next_micro: dict[tuple[str, int], int] = defaultdict(int)

    def take(phase: str, chunk: int) -> Action:
        stage = chunk * num_processes + process
        micro = next_micro[(phase, stage)]
        next_micro[(phase, stage)] += 1
        return Action(stage, phase, micro)

    actions = []
    for op in range(total + warmup):
        if op < total:
            actions.append(take("F", (op // per_round) % num_chunks))
        if op >= warmup:
            actions.append(take("B", num_chunks - 1 - ((op - warmup) // per_round) % num_chunks))
    return actions


def max_in_flight(schedule: PipelineSchedule, num_processes: int, process: int,
                  num_microbatches: int, num_chunks: int = 1) -> int:
    """The most (stage, micro-batch) pairs whose activations process
    `process` holds at once: M under GPipe; P-p under 1F1B; under interleaved
    its warm-up forwards plus the one the steady state adds (each pair is one
    chunk's activations, 1/V of the process's layers)."""
    if schedule is PipelineSchedule.GPIPE:
        return num_microbatches
    if schedule is PipelineSchedule.ONE_F_ONE_B:
        return min(num_microbatches, num_processes - process)
    warmup = _interleaved_warmup(num_processes, process, num_microbatches, num_chunks)
    return min(num_microbatches * num_chunks, warmup + 1)


def theoretical_bubble(num_processes: int, num_microbatches: int, num_chunks: int = 1) -> float:
    """The idle fraction with equal stages: (P-1)/(V*M+P-1). For GPipe and
    1F1B (V = 1) the GPipe paper's (P-1)/(M+P-1); interleaving V chunks
    cuts the bubble's time by V (Narayanan et al. 2021, "Efficient
    Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
    section 2.2.2: bubble time fraction (1/V)(P-1)/M of the ideal time)."""
    idle = num_processes - 1
    return idle / (num_chunks * num_microbatches + idle)
