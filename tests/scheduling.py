"""How `make test` spreads the tests over its pytest-xdist workers.

The suite is CPU-bound on 2 cores: most of its time is end-to-end tests, each
starting 3-5 processes that import torch, next to in-process tests that
compute. The wall time is the CPU time over the cores only if the cores never
idle, so the scheduler keeps every worker busy to the end:

- Work units: an end-to-end test alone, or the tests of one xdist group
  (conftest.py's shared launches, Ray); in-process tests by file (their module
  fixtures are made once). conftest.py names each unit `e2e:...` or
  `in-process:...`. The workers write each test's unit to a file the
  scheduler reads (`UnitsFile`): pytest-xdist's own loadgroup puts the group
  into the test's node id, which pytest 9 no longer lets a plugin change, so
  with pytest 9.2 and xdist 3.8 its groups silently do nothing.
- Longest first (LPT): the units sorted by their recorded seconds
  (tests/durations.json), so no long test starts last. A unit not recorded
  counts as a typical one of its kind.
- At most `E2E_AT_ONCE` end-to-end units run at once while in-process work
  remains (their timing checks, a step count at a kill, a stall timeout, need
  slack), `E2E_AT_ONCE_ALONE` once only end-to-end work is left; a worker that
  would exceed it is shut down instead.
- A worker is given its next unit when it holds one test: xdist runs a
  worker's last test only once it knows what comes next (or that nothing
  does), so holding back work would stall that test.

    SPLITRUN_RECORD_DURATIONS=tests/durations.json python tests/run_suites.py

records the seconds (setup, call and teardown) of every test that ran, merged
into the file.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections import defaultdict

from xdist.scheduler import LoadGroupScheduling

DURATIONS = pathlib.Path(__file__).with_name("durations.json")
IN_PROCESS, E2E = "in-process:", "e2e:"
E2E_AT_ONCE = 2
E2E_AT_ONCE_ALONE = 3
# Seconds of a unit not recorded yet, per test, by kind (medians of the suite).
TYPICAL_S = {IN_PROCESS: 0.5, E2E: 15.0}


def unit_of(nodeid: str, group: str | None, end_to_end: bool) -> str:
    """The work unit a test runs in: its xdist group's or, without one, its
    file's (in-process) or its own (end-to-end); prefixed with its kind."""
    kind = E2E if end_to_end else IN_PROCESS
    if group is not None:
        return kind + group
    return kind + (nodeid if end_to_end else nodeid.split("::")[0])


def _kind(scope: str) -> str:
    return IN_PROCESS if scope.startswith(IN_PROCESS) else E2E


class UnitsFile:
    """Each test's work unit, from the workers (which collect) to the
    scheduler (in the controller, which does not): one JSON file per worker
    in a folder the controller makes and names in each worker's input."""

    KEY = "splitrun_units_dir"

    def __init__(self, folder: str) -> None:
        self.folder = pathlib.Path(folder)

    def write(self, worker_id: str, units: dict[str, str]) -> None:
        partial = self.folder / f".{worker_id}.json"
        partial.write_text(json.dumps(units))
        partial.rename(self.folder / f"{worker_id}.json")  # whole or absent

    def read(self) -> dict[str, str]:
        found = sorted(self.folder.glob("*.json"))
        if not found:
            raise RuntimeError(f"no worker wrote its tests' units to {self.folder}")
        return json.loads(found[0].read_text())


class LongestFirstScheduling(LoadGroupScheduling):
    """Work units handed out longest first (see the module)."""

    def __init__(self, config, log=None, units: UnitsFile | None = None) -> None:
        super().__init__(config, log)
        self.seconds = load_durations()
        self.units_file = units
        self.units: dict[str, str] = {}

    def schedule(self) -> None:
        if self.collection is None and self.units_file is not None:
            self.units = self.units_file.read()
        super().schedule()

    def _split_scope(self, nodeid: str) -> str:
        return self.units.get(nodeid, nodeid)

    def _unit_seconds(self, scope: str, nodeids) -> float:
        typical = TYPICAL_S[_kind(scope)]
        return sum(self.seconds.get(nodeid, typical) for nodeid in nodeids)

    def _running_e2e(self, besides) -> int:
        return sum(1 for node, units in self.assigned_work.items()
                   if node is not besides and not node.shutting_down
                   and any(_kind(scope) == E2E and not all(tests.values())
                           for scope, tests in units.items()))

    def _pick(self, node) -> str | None:
        """The scope to give `node` next, or None to shut it down."""
        in_process_left = any(_kind(scope) == IN_PROCESS for scope in self.workqueue)
        limit = E2E_AT_ONCE if in_process_left else E2E_AT_ONCE_ALONE
        e2e_allowed = self._running_e2e(node) < limit
        best = None
        for scope, tests in self.workqueue.items():
            if _kind(scope) == E2E and not e2e_allowed:
                continue
            seconds = self._unit_seconds(scope, tests)
            if best is None or seconds > best[0]:
                best = (seconds, scope)
        return None if best is None else best[1]

    def _assign_work_unit(self, node) -> None:
        scope = self._pick(node)
        if scope is None:
            node.shutdown()
            return
        work_unit = self.workqueue.pop(scope)
        self.assigned_work.setdefault(node, {})[scope] = work_unit
        collection = self.registered_collections[node]
        node.send_runtest_some([collection.index(nodeid)
                                for nodeid, done in work_unit.items() if not done])

    def _reschedule(self, node) -> None:
        if node.shutting_down:
            return
        if not self.workqueue:
            node.shutdown()
            return
        if self._pending_of(self.assigned_work[node]) > 1:
            return
        self._assign_work_unit(node)


def load_durations() -> dict[str, float]:
    try:
        return json.loads(DURATIONS.read_text())
    except FileNotFoundError:
        return {}


class DurationRecorder:
    """Adds up each test's setup, call and teardown seconds (in the xdist
    controller, which sees every worker's reports) and merges them into the
    file named by SPLITRUN_RECORD_DURATIONS at the end of the session."""

    def __init__(self, path: str) -> None:
        self.path = pathlib.Path(path)
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report) -> None:
        self.seconds[report.nodeid] += report.duration

    def pytest_sessionfinish(self, session) -> None:
        if hasattr(session.config, "workerinput"):
            return  # a worker: the controller writes
        try:
            recorded = json.loads(self.path.read_text())
        except FileNotFoundError:
            recorded = {}
        recorded.update({nodeid: round(s, 2) for nodeid, s in self.seconds.items()})
        self.path.write_text(json.dumps(dict(sorted(recorded.items())), indent=0) + "\n")


def recorder_from_env() -> DurationRecorder | None:
    path = os.environ.get("SPLITRUN_RECORD_DURATIONS")
    return DurationRecorder(path) if path else None
