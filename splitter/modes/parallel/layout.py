"""What parallel mode decided, as plain data: the group, every value's
placement, where each state slot lives and which collectives a step runs.

`collect_state_dict` / `relocate_state_dict` move state between the full
`state_dict` form (what checkpoints hold) and the members' pieces (what each
worker holds), so a checkpoint written at one group size resumes at another.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ...errors import PlanError
from ...labels import Label
from ...ops.collectives import CollectiveBackend
from ...splitting.mode import ModeArtifacts, StatePiece
from .cost import CollectiveKind
from .placement import Placement
from .propagate import ShardingLayout

__all__ = ["Collective", "ParallelLayout", "member_key", "split_member_key",
           "collect_state_dict", "relocate_state_dict", "shard_of"]

_MEMBER_SEPARATOR = "@"


def member_key(key: str, label: Label) -> str:
    """The key of a member's piece of a state slot or feed: `l1.weight@w1`."""
    return f"{key}{_MEMBER_SEPARATOR}{label}"


def split_member_key(key: str) -> tuple[str, Label] | None:
    base, sep, tail = key.rpartition(_MEMBER_SEPARATOR)
    if not sep:
        return None
    try:
        return base, Label.parse(tail)
    except PlanError:
        return None


def shard_of(value: torch.Tensor, dim: int, index: int, num: int) -> torch.Tensor:
    """Member `index`'s slice of `value` along `dim`, as its own tensor."""
    return value.chunk(num, dim)[index].contiguous()


@dataclass(frozen=True, slots=True)
class Collective:
    """One change of placement the step makes (in the template's terms)."""

    kind: CollectiveKind
    value: str          # node of the template whose value moves
    src: Placement
    dst: Placement
    nbytes: int         # bytes all members send, per step
    is_forward: bool    # before the loss (else backward or optimizer)

    def __str__(self) -> str:
        return f"{self.value}: {self.src}->{self.dst} {self.kind.value} {self.nbytes} B"


@dataclass(frozen=True)
class ParallelLayout(ModeArtifacts):
    """The artifacts of parallel mode: groups of equal size, each named by its
    first member."""

    groups: tuple[tuple[Label, ...], ...]
    sharding: ShardingLayout
    state: dict[str, Placement]              # full state key -> placement
    state_shapes: dict[str, tuple[int, ...]]  # full shapes
    state_group: dict[str, int]              # full state key -> index of its group
    collectives: tuple[Collective, ...]
    backend: CollectiveBackend = CollectiveBackend.CHANNELS

    @property
    def uses_process_groups(self) -> bool:
        """Collectives run on torch.distributed process groups (one per group)."""
        return self.backend is CollectiveBackend.TORCH_DISTRIBUTED

    @property
    def group_size(self) -> int:
        return len(self.groups[0])

    @property
    def members(self) -> tuple[Label, ...]:
        """Every member of every group, groups in order."""
        return tuple(label for group in self.groups for label in group)

    def members_of(self, key: str) -> tuple[Label, ...]:
        """The group that holds state `key`."""
        return self.groups[self.state_group[key]]

    @property
    def bytes_per_step(self) -> int:
        return sum(c.nbytes for c in self.collectives)

    @property
    def process_groups(self) -> tuple[tuple[Label, ...], ...]:
        return self.groups if self.uses_process_groups else ()

    def state_piece(self, key: str) -> StatePiece | None:
        """A member's piece (`l1.weight@w1`): where it lies in the full tensor."""
        member = split_member_key(key)
        if member is None:
            return None
        base, label = member
        placement, holders = self.state[base], self.members_of(base)
        size = tuple(self.state_shapes[base])
        index = holders.index(label)
        if not placement.is_shard:
            return StatePiece(base, size, None, None, index == 0)
        cut = torch.empty(size, device="meta").chunk(len(holders), placement.dim)
        offsets = [0] * len(size)
        offsets[placement.dim] = sum(c.shape[placement.dim] for c in cut[:index])
        return StatePiece(base, size, tuple(offsets), tuple(cut[index].shape), index == 0)

    def split_state(self, full: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return relocate_state_dict(self, full)

    def full_state(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return collect_state_dict(self, state)

    def explain(self) -> str:
        lines = [self.sharding.explain(), "collectives per step:"]
        lines += [f"  {c}" for c in self.collectives] or ["  none"]
        return "\n".join(lines)


def relocate_state_dict(layout: ParallelLayout, full_state: Mapping[str, torch.Tensor],
                        label: Label | None = None) -> dict[str, torch.Tensor]:
    """The pieces of a full `state_dict` that `label` holds (every member's
    when `label` is None), under member keys (`l1.weight@w1`)."""
    labels = layout.members if label is None else (label,)
    for one in labels:
        if one not in layout.members:
            raise PlanError(
                f"{one.describe()} is not in the parallel group "
                f"{', '.join(str(m) for m in layout.members)}")
    pieces: dict[str, torch.Tensor] = {}
    n = layout.group_size
    for key, placement in layout.state.items():
        holders = layout.members_of(key)
        if key not in full_state:
            raise PlanError(f"state {key!r} is missing from the state dict to relocate; "
                            f"the step holds {', '.join(layout.state)}")
        value = full_state[key]
        expected = layout.state_shapes[key]
        if tuple(value.shape) != expected:
            raise PlanError(f"state {key!r} has shape {list(value.shape)}, the step expects "
                            f"{list(expected)} (the full, unsharded shape)")
        for member in labels:
            if member not in holders:
                continue
            index = holders.index(member)
            piece = shard_of(value, placement.dim, index, n) if placement.is_shard \
                else value.detach().clone()
            pieces[member_key(key, member)] = piece
    return pieces


def collect_state_dict(layout: ParallelLayout, shards: Mapping[str, torch.Tensor]
                       ) -> dict[str, torch.Tensor]:
    """The full `state_dict` from the members' pieces (keys `key@wN`):
    shards are concatenated in rank order, replicas taken from the first
    member. Keys that are not member keys pass through unchanged, so a state
    already whole (`run_threaded`'s, a job's gathered one) comes back as it is."""
    full: dict[str, torch.Tensor] = {k: v for k, v in shards.items()
                                      if split_member_key(k) is None}
    for key, placement in layout.state.items():
        if key in full and not any(member_key(key, member) in shards
                                   for member in layout.members_of(key)):
            continue  # already whole
        pieces = []
        for member in layout.members_of(key):
            name = member_key(key, member)
            if name not in shards:
                raise PlanError(f"state piece {name!r} is missing; collect needs every "
                                f"member's piece of {key!r}")
            pieces.append(shards[name])
        full[key] = torch.cat(pieces, placement.dim) if placement.is_shard else pieces[0]
    return full
