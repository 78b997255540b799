"""`python -m splitrun.launcher ...` is the `splitrun` command."""

from .cli import run

run()
