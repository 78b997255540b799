"""Architecture checks the import linter cannot make: no module of `runtime/`,
`splitter/` or `launcher/` reads another module's private names (`obj._name` where `obj` is not
`self`/`cls` and `_name` is not defined in the reading module, or
`from module import _name`); the splitter's rooms each declare their floors in
setup.cfg, with no import let through (`ignore_imports`); and the packages'
lazy faces (`_EXPORTS`, strings the linter does not read) point only into
their own package, never under a name one of its submodules takes."""

from __future__ import annotations

import ast
import configparser
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
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
# torch's multi-tensor ops (`torch._foreach_add`): public ops, the ones
# torch.optim's own foreach algorithms call.
TORCH_FOREACH = re.compile(r"torch\._foreach_\w+")


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
            if TORCH_FOREACH.fullmatch(ast.unparse(node)):
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



# -- the splitter's floors --------------------------------------------------------

SETUP = configparser.ConfigParser()
SETUP.read(REPO / "setup.cfg")
SPLITTER = REPO / "splitter"


def _contracts() -> dict[str, configparser.SectionProxy]:
    return {name: SETUP[name] for name in SETUP.sections()
            if name.startswith("importlinter:contract:")}


def _dotted(package: pathlib.Path) -> str:
    return ".".join(["splitrun", *package.relative_to(REPO).parts])


def _splitter_packages() -> list[pathlib.Path]:
    return sorted(p.parent for p in SPLITTER.rglob("__init__.py"))


def _children(package: pathlib.Path) -> set[str]:
    return ({p.stem for p in package.glob("*.py") if p.stem != "__init__"}
            | {p.name for p in package.iterdir() if (p / "__init__.py").exists()})


@pytest.mark.parametrize("package", [p for p in _splitter_packages() if len(_children(p)) > 1],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_every_splitter_room_declares_its_floors(package):
    """A room of the splitter with more than one module has an exhaustive
    layers contract naming it, so each new module says which floor it is on."""
    name = _dotted(package)
    found = [c for c in _contracts().values()
             if c.get("type") == "layers" and c.get("containers", "").split() == [name]]
    assert found, f"{name} has no layers contract in setup.cfg; give it one (exhaustive = true)"
    assert all(c.get("exhaustive") == "true" for c in found), f"{name}'s layers are not exhaustive"


def test_no_contract_lets_an_import_through():
    loose = [name for name, c in _contracts().items() if "ignore_imports" in c]
    assert not loose, f"contracts with ignore_imports: {loose}; remove the import instead"


def test_every_splitter_package_is_installed():
    listed = set(SETUP["options"]["packages"].split())
    missing = [_dotted(p) for p in _splitter_packages() if _dotted(p) not in listed]
    assert not missing, f"setup.cfg's packages lack {missing}"


def test_no_cycles_covers_every_splitter_room():
    """acyclic_siblings is recursive (to `depth`, 10 by default) below its
    ancestors: the splitter's deepest room must lie within it."""
    contract = _contracts()["importlinter:contract:no-cycles"]
    assert "splitrun.splitter" in contract["ancestors"].split()
    depth = int(contract.get("depth", 10))
    deepest = max(len(p.relative_to(SPLITTER).parts) for p in _splitter_packages())
    assert deepest < depth


def _lazy_exports(path: pathlib.Path) -> dict[str, str] | None:
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and getattr(node.targets[0], "id", None) == "_EXPORTS"):
            return ast.literal_eval(node.value)
    return None


def _faces() -> list[pathlib.Path]:
    return sorted(p for room in ROOMS for p in (REPO / room).rglob("__init__.py")
                  if _lazy_exports(p) is not None)


@pytest.mark.parametrize("face", _faces(), ids=lambda p: str(p.relative_to(REPO)))
def test_a_lazy_face_points_into_its_package_and_shadows_no_submodule(face):
    """An export names a module of its own package (relative, existing). It
    never takes the name of one of the package's submodules: once that
    submodule is imported, the import system sets the package's attribute to
    the module, and the exported function is gone (`plan.picture_names`)."""
    package = face.parent
    children = _children(package)
    for name, where in _lazy_exports(face).items():
        assert where.startswith(".") and not where.startswith(".."), (
            f"{face.relative_to(REPO)}: {name!r} -> {where!r} leaves its package")
        parts = where[1:].split(".")
        target = package.joinpath(*parts)
        assert target.with_suffix(".py").exists() or (target / "__init__.py").exists(), (
            f"{face.relative_to(REPO)}: {name!r} -> {where!r}: no such module")
        assert name not in children, (
            f"{face.relative_to(REPO)}: {name!r} is also a submodule of {_dotted(package)}; "
            f"export it under another name (or import the submodule)")
