"""The keys of tests/durations.json against the tests pytest collects.

tests/scheduling.py hands the work out longest first by the seconds recorded
per node id; a test whose id has no seconds counts as a typical one of its
kind (TYPICAL_S), so a test that moved to another file without its seconds
is scheduled as if it took 0.5 s or 15 s.

    python tests/durations_keys.py            # what is not recorded, what is stale
    python tests/durations_keys.py --rekey    # and move the seconds of moved tests

--rekey gives a collected test without seconds the seconds of a recorded id
no collected test has, with the same test name (and parameters) in a file of
the same name anywhere under tests/, the one with `_e2e` at the end of its
name and the one without counting as one (a file's end-to-end half is
tests/e2e/test_foo_e2e.py): `tests/test_foo.py::test_x[a]` ->
`tests/launcher/test_foo.py::test_x[a]` or `tests/e2e/test_foo_e2e.py::test_x[a]`.
A test that matches several stale ids is left alone and named. Exit status 1
if a collected test is still without seconds that --rekey could have given it.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
from collections import defaultdict

from scheduling import DURATIONS

REPO = pathlib.Path(__file__).resolve().parents[1]


def collected() -> list[str]:
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q"], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    ids = [line for line in done.stdout.splitlines() if "::" in line]
    if done.returncode != 0 or not ids:
        raise SystemExit(f"pytest --collect-only failed ({done.returncode}):\n"
                         f"{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return ids


def _stem_and_name(nodeid: str) -> tuple[str, str]:
    """`tests/e2e/test_foo_e2e.py::test_x[a]` -> ("test_foo", "test_x[a]")."""
    path, _, name = nodeid.partition("::")
    return pathlib.PurePosixPath(path).stem.removesuffix("_e2e"), name


def moves(stale: list[str], unrecorded: list[str]) -> tuple[dict[str, str], list[str]]:
    """{stale id: collected id} for every unambiguous match, and the
    collected ids that matched several stale ones."""
    by_name = defaultdict(list)
    for nodeid in stale:
        by_name[_stem_and_name(nodeid)].append(nodeid)
    found, ambiguous = {}, []
    for nodeid in unrecorded:
        candidates = by_name.get(_stem_and_name(nodeid), [])
        if len(candidates) == 1:
            found[candidates[0]] = nodeid
        elif candidates:
            ambiguous.append(nodeid)
    return found, ambiguous


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rekey", action="store_true",
                        help="move the seconds of moved tests to their new ids")
    args = parser.parse_args(argv)
    seconds = json.loads(DURATIONS.read_text())
    ids = collected()
    present = set(ids)
    unrecorded = [nodeid for nodeid in ids if nodeid not in seconds]
    stale = [nodeid for nodeid in seconds if nodeid not in present]
    found, ambiguous = moves(stale, unrecorded)
    if args.rekey and found:
        for old, new in found.items():
            seconds[new] = seconds.pop(old)
        # As DurationRecorder writes it.
        DURATIONS.write_text(json.dumps(dict(sorted(seconds.items())), indent=0) + "\n")
        print(f"moved the seconds of {len(found)} tests to their new ids")
        unrecorded = [nodeid for nodeid in unrecorded if nodeid not in found.values()]
        stale = [nodeid for nodeid in stale if nodeid not in found]
        found = {}
    print(f"{len(ids)} tests collected, {len(ids) - len(unrecorded)} with recorded seconds, "
          f"{len(unrecorded)} without (scheduled as TYPICAL_S); {len(stale)} recorded ids "
          f"no collected test has")
    for old, new in sorted(found.items()):
        print(f"  moved, not re-keyed (run with --rekey): {old} -> {new}")
    for nodeid in ambiguous:
        print(f"  several recorded ids could be {nodeid}: re-key it by hand")
    return 1 if found or ambiguous else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
