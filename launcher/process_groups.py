"""Signalling a launched process together with the process group it leads."""

from __future__ import annotations

import os

__all__ = ["signal_with_group"]


def signal_with_group(pid: int, sig: int) -> None:
    """Send `sig` to the process group `pid` leads (the process and its
    descendants: a data loader's workers), or to the process alone where it
    leads no group yet.

    A process forked from a template a moment ago leads no group until it
    calls setsid, and signalling only the group then reached no one (a
    standing template left such a worker running after its launcher was
    SIGKILLed). Once it leads one, it gets the signal once, through the group.
    `pid` must be an unreaped child, of the caller or of a template that keeps
    it unreaped, so it cannot name another process."""
    try:
        os.killpg(pid, sig)
        return
    except ProcessLookupError:
        pass  # no group with that id yet
    except PermissionError:
        return
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # gone
