"""Labels say which process runs an operation: a `(rank, role)` pair.

`place()` labels a module (its forward and backward ops, and its parameters) or a
single parameter; `region()` labels the ops traced inside a code block. Labels
are stored as short strings (`"w1"`, `"s0"`) so they survive deep copies and
torch's tracing metadata unchanged.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from .errors import LabelError

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "Role",
    "Label",
    "place",
    "region",
    "placement_of",
    "Cluster",
    "ANY_SERVER",
    "LABEL_ANNOTATION",
    "MODULE_ANNOTATION",
]

# Keys of the annotation dict that `torch.fx.traceback.annotate` copies into
# `node.meta["custom"]` for forward ops and, on torch 2.13, their backward ops.
LABEL_ANNOTATION = "splitrun.label"
MODULE_ANNOTATION = "splitrun.module"

_PLACEMENT_ATTR = "_splitrun_label"


class Role(Enum):
    WORKER = "worker"
    SERVER = "server"
    # The scheduler runs membership only; placing an op there is an error.
    SCHEDULER = "scheduler"

    @property
    def short(self) -> str:
        return _ROLE_SHORT[self]

    @classmethod
    def parse(cls, value: Role | str) -> Role:
        if isinstance(value, Role):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            known = ", ".join(r.value for r in cls)
            raise LabelError(
                f"unknown role {value!r}; expected one of {known}") from None


_ROLE_SHORT = {Role.WORKER: "w", Role.SERVER: "s", Role.SCHEDULER: "sched"}
_SHORT_ROLE = {v: k for k, v in _ROLE_SHORT.items()}
_ROLE_ORDER = {Role.WORKER: 0, Role.SERVER: 1, Role.SCHEDULER: 2}
# Ranks of up to 9 digits: a label of 5000 digits is malformed, not a huge int.
_LABEL_RE = re.compile(r"^(w|s|sched)(\d{1,9})$")


class Label:
    """The process an op runs on. Sorts workers first, then servers, by rank.

    Labels are interned (one object per rank and role), so they hash and
    compare by identity: the splitter keys large dicts by them.
    """

    __slots__ = ("rank", "role", "_key")
    _interned: dict[tuple[int, Role], Label] = {}

    rank: int
    role: Role

    def __new__(cls, rank: int, role: Role | str = Role.WORKER) -> Label:
        role = Role.parse(role)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise LabelError(
                f"rank must be an integer >= 0, got {rank!r} for role {role.value}")
        label = cls._interned.get((rank, role))
        if label is None:
            label = object.__new__(cls)
            object.__setattr__(label, "rank", rank)
            object.__setattr__(label, "role", role)
            object.__setattr__(label, "_key", (_ROLE_ORDER[role], rank))
            label = cls._interned.setdefault((rank, role), label)
        return label

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError("Label is immutable")

    def __reduce__(self):
        return (Label, (self.rank, self.role))

    def __copy__(self) -> Label:
        return self

    def __deepcopy__(self, memo) -> Label:
        return self

    def __repr__(self) -> str:
        return f"Label({self.rank}, {self.role.value!r})"

    @classmethod
    def worker(cls, rank: int = 0) -> Label:
        return cls(rank, Role.WORKER)

    @classmethod
    def server(cls, rank: int = 0) -> Label:
        return cls(rank, Role.SERVER)

    @classmethod
    def parse(cls, text: str) -> Label:
        """Parse the short form, `"w0"`, `"s1"`."""
        match = _LABEL_RE.match(text.strip())
        if match is None:
            raise LabelError(
                f"malformed label {text[:40]!r}{'...' if len(text) > 40 else ''}; "
                f"expected a role letter and a rank of up to 9 digits, "
                f"like 'w0' (worker 0) or 's1' (server 1)")
        return cls(int(match.group(2)), _SHORT_ROLE[match.group(1)])

    def sort_key(self) -> tuple[int, int]:
        return self._key

    def __lt__(self, other: Label) -> bool:
        return self._key < other._key

    def __str__(self) -> str:
        return f"{_ROLE_SHORT[self.role]}{self.rank}"

    def describe(self) -> str:
        """Human form for messages and log prefixes: `worker 1`."""
        return f"{self.role.value} {self.rank}"


# The annotation of a server placement without a rank: the mode picks the
# server (balanced by bytes in parameter-server mode, server 0 otherwise).
ANY_SERVER = "s*"


def _placement_text(role: Role | str, rank: int | None) -> str:
    role = Role.parse(role)
    if rank is None:
        return ANY_SERVER if role is Role.SERVER else str(Label(0, role))
    return str(Label(rank, role))


def place(target: nn.Module | nn.Parameter, *, role: Role | str = Role.WORKER,
          rank: int | None = None) -> nn.Module | nn.Parameter:
    """Run a module (forward, backward, optimizer update of its parameters) or
    own a single parameter on the process `(rank, role)`.

    Without a rank: worker 0 for workers; for servers the mode chooses (in
    parameter-server mode the parameters are spread across servers by size).
    The innermost placement wins: a module placed inside a placed module keeps
    its own label. Returns `target`, so `place(nn.Linear(4, 4), rank=1)` can be
    used inline.
    """
    from torch import nn  # here, not at the top: the launcher uses labels without torch

    if not isinstance(target, (nn.Module, nn.Parameter)):
        raise LabelError(
            f"place() takes an nn.Module or nn.Parameter, got "
            f"{type(target).__name__}; use region() to place a block of code")
    try:
        text = _placement_text(role, rank)
    except LabelError as exc:
        what = type(target).__name__
        raise LabelError(f"place({what}, role={role!r}, rank={rank!r}): {exc}") from None
    setattr(target, _PLACEMENT_ATTR, text)
    return target


def placement_of(target: nn.Module | torch.Tensor) -> str | None:
    """The placement `place()` gave `target` ("w1", "s0", or "s*"), or None."""
    return getattr(target, _PLACEMENT_ATTR, None)


@contextlib.contextmanager
def region(*, role: Role | str = Role.WORKER, rank: int | None = None) -> Iterator[str]:
    """Label every op traced inside the block (and its backward ops)."""
    import torch.fx.traceback as fx_traceback  # see place()

    text = _placement_text(role, rank)
    with fx_traceback.annotate({LABEL_ANNOTATION: text}):
        yield text


@dataclass(frozen=True, slots=True)
class Cluster:
    """How many processes of each role the job runs."""

    num_workers: int = 1
    num_servers: int = 0

    def __post_init__(self) -> None:
        if self.num_workers < 1 or self.num_servers < 0:
            raise LabelError(
                f"a cluster needs at least 1 worker and 0 or more servers, got "
                f"workers={self.num_workers} servers={self.num_servers}")

    def size(self, role: Role) -> int:
        return {Role.WORKER: self.num_workers, Role.SERVER: self.num_servers}.get(role, 0)

    def labels(self) -> list[Label]:
        return ([Label.worker(r) for r in range(self.num_workers)]
                + [Label.server(r) for r in range(self.num_servers)])

    def __str__(self) -> str:
        return f"workers={self.num_workers} servers={self.num_servers}"
