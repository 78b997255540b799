"""The `splitrun` command: launch, join, plan, scheduler."""

from .cli import main

__all__ = ["main"]
