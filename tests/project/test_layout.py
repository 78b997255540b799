"""The tests mirror the code (docs/architecture.md, "Where the tests live"): every
test file lives in the folder of what it tests (tests/splitter/,
tests/runtime/<room>/, tests/launcher/, tests/bench/, tests/project/ for the
repository as a whole) or, when it starts processes end to end, in tests/e2e/,
whose conftest.py marks its tests `slow`; no test marks itself so."""

import ast
import pathlib

TESTS = pathlib.Path(__file__).resolve().parents[1]
REPO = TESTS.parent
# Folders that mirror no folder of the code.
OWN_FOLDERS = {"e2e", "project"}
# The code's folders a test folder mirrors, below or at its root.
CODE_ROOTS = {"splitter", "runtime", "launcher", "bench"}
HOW = ("a test file lives in the folder of the room it tests (tests/splitter/, "
       "tests/runtime/<room>/, tests/launcher/, tests/bench/, tests/project/), or in "
       "tests/e2e/ if it starts processes (its conftest.py marks those slow); helpers "
       "go to tests/support/. See docs/architecture.md, \"Where the tests live\".")


def _test_files() -> list[pathlib.Path]:
    return sorted(p for p in TESTS.rglob("test_*.py") if "__pycache__" not in p.parts)


def _misplaced(path: pathlib.Path) -> bool:
    folder = path.parent.relative_to(TESTS)
    if folder.as_posix() in OWN_FOLDERS:
        return False
    if not folder.parts or folder.parts[0] not in CODE_ROOTS or folder.as_posix() == "runtime":
        return True  # tests/ itself, tests/support/, or tests/runtime/ without a room
    return not (REPO / folder).is_dir()


def test_every_test_file_lives_in_the_folder_of_what_it_tests():
    misplaced = [str(p.relative_to(REPO)) for p in _test_files() if _misplaced(p)]
    assert not misplaced, f"{', '.join(misplaced)}: {HOW}"


def _slow_marks(path: pathlib.Path) -> list[int]:
    return [node.lineno for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute) and node.attr == "slow"
            and isinstance(node.value, ast.Attribute) and node.value.attr == "mark"]


def test_no_test_marks_itself_slow():
    """Slow is tests/e2e/'s mark: a slow test elsewhere would run in the
    in-process tier's folder, and one marked in tests/e2e/ says it twice."""
    marked = [f"{p.relative_to(REPO)}:{line}" for p in _test_files() for line in _slow_marks(p)]
    assert not marked, (f"{', '.join(marked)}: marked slow; move the test to tests/e2e/ "
                        f"(tests/e2e/test_<name>_e2e.py) and drop the mark: {HOW}")
