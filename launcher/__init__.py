"""The `splitrun` command: launch, join, plan, scheduler (`splitrun.launcher.cli`)."""
