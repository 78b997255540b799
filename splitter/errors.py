"""The exception tree. Every error splitrun raises derives from `SplitrunError`.

Messages say where (process, node, channel, step), what was expected and what
came, and how to fix it. The runtime adds its own subclasses in
`splitrun.runtime.errors`.
"""

from __future__ import annotations

__all__ = [
    "SplitrunError",
    "LabelError",
    "CaptureError",
    "PlanError",
    "PlanParseError",
    "RowInitError",
]


class SplitrunError(Exception):
    """Root of every error raised by splitrun."""


class LabelError(SplitrunError):
    """A `(rank, role)` label that is malformed, unknown, or not allowed here."""


class CaptureError(SplitrunError):
    """A training step that cannot be captured into one graph."""


class PlanError(SplitrunError):
    """A split that cannot be made, or a plan that breaks its invariants."""


class RowInitError(SplitrunError):
    """A table's row initializer that is malformed or returns rows of the wrong shape."""


class PlanParseError(PlanError):
    """A plan's text form that does not parse."""
