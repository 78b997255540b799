"""Placements of a value over a one-dimensional group of N workers.

`R`: every member holds the whole value. `S(d)`: member i holds the i-th of N
equal slices along dimension d. `P`: every member holds a value of the full
shape and the true value is their sum (a partial sum).

Users write placements as text (`"S(1)"`, `"R"`, `"P"`) or as MindSpore
strategy tuples (`(1, 4)`: dimension 1 cut into 4); `to_placement` turns
either into a `Placement` for a group of a given size.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from enum import Enum

from ...errors import PlanError

__all__ = [
    "PlacementKind",
    "Placement",
    "R",
    "P",
    "S",
    "ShardingError",
    "parse_placement",
    "is_placement_text",
    "to_placement",
]


class ShardingError(PlanError):
    """A sharding that cannot be honoured: malformed, uneven, or not 1-D."""


class PlacementKind(Enum):
    REPLICATE = "R"
    SHARD = "S"
    PARTIAL = "P"


@dataclass(frozen=True, slots=True, order=True)
class Placement:
    kind: PlacementKind
    dim: int = -1  # the sharded dimension (non-negative) for SHARD, else -1

    @property
    def is_shard(self) -> bool:
        return self.kind is PlacementKind.SHARD

    @property
    def is_replicate(self) -> bool:
        return self.kind is PlacementKind.REPLICATE

    @property
    def is_partial(self) -> bool:
        return self.kind is PlacementKind.PARTIAL

    def __str__(self) -> str:
        return f"S({self.dim})" if self.is_shard else self.kind.value

    def __repr__(self) -> str:
        return str(self)


R = Placement(PlacementKind.REPLICATE)
P = Placement(PlacementKind.PARTIAL)


def S(dim: int) -> Placement:  # noqa: N802 - reads like the notation
    return Placement(PlacementKind.SHARD, dim)


_TEXT_RE = re.compile(r"^\s*(?:(R)|(P)|S\(\s*(-?\d+)\s*\))\s*$")


def is_placement_text(text: str) -> bool:
    return _TEXT_RE.match(text) is not None


def parse_placement(text: str, ndim: int | None = None) -> Placement:
    """`"R"`, `"P"`, `"S(d)"`; a negative d counts from the end (needs `ndim`)."""
    match = _TEXT_RE.match(text)
    if match is None:
        raise ShardingError(
            f"malformed placement {text!r}; expected 'R' (replicated), 'P' (partial "
            f"sum) or 'S(d)' (sharded on dimension d), e.g. 'S(1)' or 'S(-1)'")
    if match.group(1):
        return R
    if match.group(2):
        return P
    return S(_normalise_dim(int(match.group(3)), ndim, text))


def _normalise_dim(dim: int, ndim: int | None, what: str) -> int:
    if dim >= 0:
        if ndim is not None and dim >= ndim:
            raise ShardingError(
                f"placement {what}: dimension {dim} is out of range for a "
                f"{ndim}-dimensional tensor")
        return dim
    if ndim is None:
        raise ShardingError(f"placement {what}: a negative dimension needs the tensor's rank")
    if dim < -ndim:
        raise ShardingError(
            f"placement {what}: dimension {dim} is out of range for a "
            f"{ndim}-dimensional tensor")
    return dim + ndim


def to_placement(spec: Placement | str | tuple | list, *, group_size: int,
                 ndim: int | None = None, what: str = "value") -> Placement:
    """A placement from text, a `Placement`, or a MindSpore strategy tuple.

    A tuple must have one entry per dimension; all 1 means replicated, exactly
    one entry equal to the group size means sharded there. Anything else (two
    cut dimensions, a cut that is not the group size) is a 2-D or partial
    strategy that a one-dimensional group cannot run.
    """
    if isinstance(spec, Placement):
        if spec.is_shard and ndim is not None:
            return S(_normalise_dim(spec.dim, ndim, f"{spec} of {what}"))
        return spec
    if isinstance(spec, str) and spec.strip().startswith("(") or \
            isinstance(spec, str) and spec.strip().startswith("["):
        try:
            spec = ast.literal_eval(spec.strip())
        except (ValueError, SyntaxError):
            raise ShardingError(f"{what}: malformed strategy {spec!r}") from None
    if isinstance(spec, str):
        try:
            return parse_placement(spec, ndim)
        except ShardingError as exc:
            raise ShardingError(f"{what}: {exc}") from None
    if isinstance(spec, (tuple, list)):
        cuts = list(spec)
        if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in cuts):
            raise ShardingError(
                f"{what}: strategy {tuple(spec)} must hold positive integers, one per dimension")
        if ndim is not None and len(cuts) != ndim:
            raise ShardingError(
                f"{what}: strategy {tuple(spec)} has {len(cuts)} entries but the tensor has "
                f"{ndim} dimensions; give one entry per dimension")
        split = [d for d, c in enumerate(cuts) if c > 1]
        if not split:
            return R
        if len(split) > 1:
            raise ShardingError(
                f"{what}: strategy {tuple(spec)} cuts {len(split)} dimensions; parallel mode "
                f"runs one-dimensional groups, so cut one dimension by the group size "
                f"({group_size}) and leave the others at 1")
        if cuts[split[0]] != group_size:
            raise ShardingError(
                f"{what}: strategy {tuple(spec)} cuts dimension {split[0]} into "
                f"{cuts[split[0]]} but the group has {group_size} workers; cut it into "
                f"{group_size} or change the group")
        return S(split[0])
    raise ShardingError(
        f"{what}: a placement must be 'R', 'P', 'S(d)', a Placement or a strategy tuple, "
        f"got {type(spec).__name__}")
