"""`python -m splitrun ...` is the `splitrun` command."""

from splitrun.launcher.cli import run

run()
