"""`make test`: every test, in pytest-xdist workers, longest first.

The end-to-end tests (`-m slow`, each starting 3-5 processes) and the
in-process ones run in one session of WORKERS workers; tests/scheduling.py
hands out the work: longest units first (the seconds recorded in
tests/durations.json), at most two end-to-end tests at once while in-process
work remains (their timing checks, a step count at a kill, the stall timeout,
need slack) and three after, each worker given its next unit before its
current one ends. The workers spend much of their time waiting (processes
starting, heartbeats, deadlines), so there are more workers than cores.

    python tests/run_suites.py [PYTEST_ARGS...]

Exit status: pytest's ("no tests collected", as when PYTEST_ARGS pick none, is 5).
"""

from __future__ import annotations

import subprocess
import sys

WORKERS = 4


def command(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-n", str(WORKERS), "--dist", "loadgroup",
            *args]


def main(args: list[str]) -> int:
    return subprocess.call(command(args))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
