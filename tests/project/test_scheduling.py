"""The test scheduler (tests/scheduling.py) on fake workers: units longest
first, a group kept on one worker, the end-to-end limit, no worker left
holding a test it cannot start."""

import json
import types

from scheduling import E2E_AT_ONCE, LongestFirstScheduling, UnitsFile, unit_of


class FakeNode:
    def __init__(self, name):
        self.name = name
        self.gateway = types.SimpleNamespace(id=name)
        self.shutting_down = False
        self.sent: list[list[int]] = []

    def send_runtest_some(self, indices):
        self.sent.append(list(indices))

    def shutdown(self):
        self.shutting_down = True


def scheduler(tmp_path, tests, seconds, workers):
    """tests: nodeid -> (group or None, end_to_end)."""
    units = {nodeid: unit_of(nodeid, group, end_to_end)
             for nodeid, (group, end_to_end) in tests.items()}
    (tmp_path / "gw0.json").write_text(json.dumps(units))
    config = types.SimpleNamespace(getvalue=lambda name: [f"{workers}*popen"],
                                   option=types.SimpleNamespace(loadscopereorder=True))
    sched = LongestFirstScheduling(config, units=UnitsFile(tmp_path))
    sched.seconds = seconds
    nodes = [FakeNode(f"gw{i}") for i in range(workers)]
    for node in nodes:
        sched.add_node(node)
        sched.add_node_collection(node, list(tests))
    sched.schedule()
    return sched, nodes, list(tests)


def given(node, collection):
    return [collection[i] for batch in node.sent for i in batch]


def test_longest_units_first_and_a_group_on_one_worker(tmp_path):
    tests = {
        "tests/test_a.py::test_short": (None, False),
        "tests/test_a.py::test_other": (None, False),
        "tests/test_b.py::test_long": (None, False),
        "tests/test_ray.py::test_1": ("ray", True),
        "tests/test_ray.py::test_2": ("ray", True),
    }
    seconds = {"tests/test_a.py::test_short": 1, "tests/test_a.py::test_other": 1,
               "tests/test_b.py::test_long": 30, "tests/test_ray.py::test_1": 20,
               "tests/test_ray.py::test_2": 20}
    sched, (first, second), collection = scheduler(tmp_path, tests, seconds, workers=2)
    # Ray (40 s, one unit) first, then test_b (30 s); each worker then holds
    # two tests or is given the next unit.
    assert given(first, collection)[:2] == ["tests/test_ray.py::test_1",
                                            "tests/test_ray.py::test_2"]
    assert given(second, collection)[0] == "tests/test_b.py::test_long"
    assert given(second, collection)[1:] == ["tests/test_a.py::test_short",
                                             "tests/test_a.py::test_other"]


def test_end_to_end_units_at_once_are_limited_while_in_process_work_remains(tmp_path):
    tests = {f"tests/test_e2e.py::test_{i}": (None, True) for i in range(6)}
    tests.update({f"tests/test_unit{i}.py::test": (None, False) for i in range(4)})
    seconds = {nodeid: (50 if "e2e" in nodeid else 10) for nodeid in tests}
    sched, nodes, collection = scheduler(tmp_path, tests, seconds, workers=4)
    running_e2e = [node for node in nodes if "e2e" in given(node, collection)[0]]
    assert len(running_e2e) == E2E_AT_ONCE, "the others take in-process files"
    # No worker is left with one test and nothing after it unless shut down:
    # xdist starts a worker's last test only once it knows what follows.
    for node in nodes:
        assert len(given(node, collection)) >= 2 or node.shutting_down


def test_a_worker_is_shut_down_rather_than_exceed_the_limit_at_the_end(tmp_path):
    tests = {f"tests/test_e2e.py::test_{i}": (None, True) for i in range(8)}
    seconds = dict.fromkeys(tests, 50)
    sched, nodes, collection = scheduler(tmp_path, tests, seconds, workers=4)
    working = [node for node in nodes if not node.shutting_down]
    assert len(working) == 3, [node.name for node in nodes]
    assert sum(len(given(node, collection)) for node in nodes) <= len(tests)
