"""Architecture checks the import linter cannot make: no module of `runtime/`,
`splitter/` or `launcher/` reads another module's private names (`obj._name` where `obj` is not
`self`/`cls` and `_name` is not defined in the reading module, or
`from module import _name`)."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
ROOMS = ("runtime", "splitter", "launcher")
GENERATED = REPO / "runtime" / "rpc" / "wire"
PRIVATE = re.compile(r"_[a-z]\w*")
PRIVATE_IMPORT = re.compile(r"_[A-Za-z]\w*")

# Public despite the underscore: NamedTuple's API (plan.Channel is one).
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make"}
# torch's private names the code reads on purpose, each with its reason.
TORCH_PRIVATE = {
    "_input_nodes": "torch.fx.Node: all_input_nodes without copying a list per node",
    "_cdata": "torch storage handle, to read its reference count (guarded)",
    "_reparametrize_module": "torch.nn.utils.stateless: capture runs the module functionally",
    "_StorageInfo": "torch.distributed.checkpoint: where an item lies in a data file; the "
                    ".metadata worker 0 writes from the other processes' reports must hold "
                    "DCP's own type, or DCP cannot read it",
}
# The standard library's private names the launcher calls on purpose: a process
# that must end without the interpreter's teardown (seconds with torch and gRPC
# loaded, or a forked child that must never return into its template's loop).
STDLIB_PRIVATE = {
    "os._exit": "exit at once, without the interpreter's teardown",
    "atexit._run_exitfuncs": "a process ending with os._exit still runs its exit handlers",
    "threading._shutdown": "a forked process joins its non-daemon threads, as "
                           "multiprocessing's forked children do",
}
# aten ops whose names start with an underscore (`aten._to_copy`) are public op names.
ATEN_RECEIVER = re.compile(r"(^|\.)_?aten$")


def _modules() -> list[pathlib.Path]:
    return sorted(path for room in ROOMS for path in (REPO / room).rglob("*.py")
                  if GENERATED not in path.parents)


def _defined_names(tree: ast.Module) -> set[str]:
    """Every name this module defines: functions, classes, assigned variables and
    attributes, and names spelled as strings (`__slots__`, `setattr`)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)
    return names


def private_reads(path: pathlib.Path, root: pathlib.Path = REPO) -> list[str]:
    """`file:line: expression` for each read of another module's private name."""
    tree = ast.parse(path.read_text(), filename=str(path))
    defined = _defined_names(tree)
    where = path.relative_to(root)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and PRIVATE.fullmatch(node.attr):
            receiver = ast.unparse(node.value)
            if receiver in ("self", "cls") or node.attr in defined:
                continue
            if node.attr in NAMEDTUPLE_API or node.attr in TORCH_PRIVATE:
                continue
            if ATEN_RECEIVER.search(receiver) or ast.unparse(node) in STDLIB_PRIVATE:
                continue
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if PRIVATE_IMPORT.fullmatch(alias.name) and alias.name not in TORCH_PRIVATE:
                    module = "." * node.level + (node.module or "")
                    found.append(f"{where}:{node.lineno}: from {module} import {alias.name}")
    return sorted(set(found), key=lambda line: (line.split(":")[0], int(line.split(":")[1])))


@pytest.mark.parametrize("path", _modules(), ids=lambda path: str(path.relative_to(REPO)))
def test_no_module_reads_another_modules_private_names(path):
    found = private_reads(path)
    assert not found, ("private names of another module read here; make them public "
                       "(no underscore) or pass what is needed explicitly:\n" + "\n".join(found))


def test_the_check_finds_a_private_read(tmp_path):
    """The check itself: a cross-module read is found, a read of a name the module
    defines is not."""
    source = tmp_path / "probe.py"
    source.write_text("from .other import _helper\n"
                      "class A:\n"
                      "    def __init__(self):\n"
                      "        self._mine = 1\n"
                      "    def f(self, other, peer):\n"
                      "        return other._mine + peer._theirs\n")
    found = private_reads(source, root=tmp_path)
    assert found == ["probe.py:1: from .other import _helper",
                     "probe.py:6: peer._theirs"]

