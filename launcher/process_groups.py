"""Signalling a launched process together with the process group it leads."""

from __future__ import annotations

import os

__all__ = ["signal_with_group"]


def signal_with_group(pid: int, sig: int) -> None:
    """Send `sig` to the process group `pid` leads and to the process itself.

    The group takes its descendants (a data loader's workers). The process is
    signalled too because one forked from a template a moment ago leads no
    group until it calls setsid, and signalling only the group then reaches no
    one (a standing template left such a worker running after its launcher was
    SIGKILLed). `pid` must be an unreaped child, of the caller or of a template
    that keeps it unreaped, so it cannot name another process."""
    for send in (os.killpg, os.kill):
        try:
            send(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass  # no such group yet, or gone
