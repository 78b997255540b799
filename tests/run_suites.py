"""`make test`: the end-to-end tests (`-m slow`) and the others in two pytest
processes at once.

Both spend much of their time waiting (processes starting, heartbeats,
deadlines) rather than computing, so each runs in pytest-xdist workers: the
end-to-end tests with `--dist loadgroup`, which keeps together the tests that
share a launched job or must not overlap (conftest.py's groups); the others
with `--dist loadfile`, so a module's fixtures are made once. Two end-to-end
tests at once load the machine more than one did: their timing-sensitive
checks (a step count at a kill, the stall timeout) have less slack.
E2E_WORKERS = 1 runs them one after another. The end-to-end output streams; the other tests'
output comes after it, as one block. The exit status is the first failing
one's (0 when both pass; "no tests collected" in one of them, as when
PYTEST_ARGS pick tests of one kind, is no failure).

    python tests/run_suites.py [PYTEST_ARGS...]    # both get the same arguments
"""

from __future__ import annotations

import subprocess
import sys
import tempfile

# Bounds the in-process suite (about 5 minutes on 2 cores, each test also has
# pytest-timeout's deadline); after the end-to-end suite is done it gets this
# much more before it is stopped.
UNIT_SUITE_GRACE_S = 1800.0
NO_TESTS_COLLECTED = 5  # pytest.ExitCode.NO_TESTS_COLLECTED
# Tests at once (pytest-xdist workers) in each suite.
E2E_WORKERS = 2
UNIT_WORKERS = 2


def _pytest(marker: str, args: list[str]) -> list[str]:
    if marker == "slow":
        extra = ["-n", str(E2E_WORKERS), "--dist", "loadgroup"]
    else:  # one cache writer: the in-process suite leaves .pytest_cache alone
        extra = ["-n", str(UNIT_WORKERS), "--dist", "loadfile", "-p", "no:cacheprovider"]
    return [sys.executable, "-m", "pytest", "-q", "-m", marker, *extra, *args]


def main(args: list[str]) -> int:
    with tempfile.TemporaryFile(mode="w+", prefix="splitrun-unit-tests-") as unit_log:
        unit = subprocess.Popen(_pytest("not slow", args), stdout=unit_log,
                                stderr=subprocess.STDOUT)
        try:
            e2e_code = subprocess.call(_pytest("slow", args))
            try:
                unit_code = unit.wait(UNIT_SUITE_GRACE_S)
            except subprocess.TimeoutExpired:
                print(f"run_suites: the in-process tests ran {UNIT_SUITE_GRACE_S:g} s past the "
                      f"end-to-end ones; stopped", file=sys.stderr)
                unit_code = 1
        finally:
            if unit.poll() is None:  # interrupted, or over its deadline
                unit.terminate()
                try:
                    unit.wait(30)
                except subprocess.TimeoutExpired:
                    unit.kill()
                    unit.wait()
        unit_log.seek(0)
        print("\n==== the in-process tests (-m 'not slow'), run meanwhile ====", flush=True)
        sys.stdout.write(unit_log.read())
    print(f"\nrun_suites: end-to-end tests exit {e2e_code}, in-process tests exit {unit_code}",
          flush=True)
    failures = [code for code in (e2e_code, unit_code) if code not in (0, NO_TESTS_COLLECTED)]
    if failures:
        return failures[0]
    return NO_TESTS_COLLECTED if e2e_code == unit_code == NO_TESTS_COLLECTED else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
