"""A table declared without a row count (a *dynamic* table): its ids are any
int64 (hashed user ids, feature crosses), rows are made on first sight by the
server owning the id, and two policies keep the server's rows bounded.

    DynamicTable(admit_after=3, expire_after_steps=1000, row_budget=1_000_000)

- admission: an id becomes a row once it was seen in `admit_after` steps
  (counted once a step, however often a step's batch looks it up). Before
  that it reads the initializer's row (zeros without one) and its gradient is
  dropped. `admit_after=1` is admission off.
- expiry: a row not touched for more than `expire_after_steps` steps is
  dropped (an id seen again starts over); past `row_budget` rows on one
  server, the least frequently seen rows not used by the step are dropped.
  `None`: off. Ids waiting for admission are forgotten after the same
  `expire_after_steps` without a sighting.

The exact rules, step by step, are the plain-Python reference in
runtime/engine/embedding/dynamic_reference.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import CaptureError

__all__ = ["DynamicTable"]


@dataclass(frozen=True)
class DynamicTable:
    admit_after: int = 1
    expire_after_steps: int | None = None
    row_budget: int | None = None

    def __post_init__(self) -> None:
        for name in ("admit_after", "expire_after_steps", "row_budget"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise CaptureError(f"DynamicTable({name}={value!r}): expected an int")
        if self.admit_after < 1:
            raise CaptureError(f"DynamicTable(admit_after={self.admit_after}): must be >= 1 "
                               f"(1: every id is a row on first sight)")
        if self.expire_after_steps is not None and self.expire_after_steps < 1:
            raise CaptureError(f"DynamicTable(expire_after_steps={self.expire_after_steps}): "
                               f"must be >= 1, or None for no expiry by age")
        if self.row_budget is not None and self.row_budget < 1:
            raise CaptureError(f"DynamicTable(row_budget={self.row_budget}): must be >= 1 "
                               f"rows per server, or None for no budget")

    @property
    def is_exact(self) -> bool:
        """Admission and expiry off: the table trains as a bounded one would."""
        return (self.admit_after == 1 and self.expire_after_steps is None
                and self.row_budget is None)
