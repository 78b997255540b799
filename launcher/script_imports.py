"""The installed modules a script imports first: the template (template.py)
imports them too, so that each forked process finds them imported.

A script's leading imports (the import statements before its first other
statement) run before anything the script does: importing them earlier, in
the template, is what would happen anyway, once instead of once per process
(scikit-learn, a dataset library: seconds each). Only modules installed
(site-packages, the standard library) count: the user's own modules may read
the per-process environment when imported. An import after the first other
statement (a script that sets a variable, then imports) is left to the script.
Like template.py, this module imports only the standard library.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sysconfig

__all__ = ["leading_imports", "installed"]


def leading_imports(source: str) -> list[str]:
    """The absolute modules imported by `source`'s leading import statements,
    in order: `import a.b` gives a.b; `from a import b` gives a and a.b (b may
    be a submodule: importing a.b fails where it is not)."""
    try:
        body = ast.parse(source).body
    except SyntaxError:
        return []  # the script's own process reports it
    modules: list[str] = []
    for index, statement in enumerate(body):
        if index == 0 and isinstance(statement, ast.Expr) and \
                isinstance(statement.value, ast.Constant):
            continue  # the docstring
        if isinstance(statement, ast.Import):
            modules += [alias.name for alias in statement.names]
        elif isinstance(statement, ast.ImportFrom) and statement.level == 0 and \
                statement.module != "__future__":
            modules.append(statement.module)
            modules += [f"{statement.module}.{alias.name}" for alias in statement.names
                        if alias.name != "*"]
        elif not isinstance(statement, ast.ImportFrom):
            break
    return list(dict.fromkeys(modules))


def installed(module: str) -> bool:
    """Whether `module`'s top-level package is installed (site-packages or the
    standard library), found without importing it."""
    try:
        spec = importlib.util.find_spec(module.partition(".")[0])
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    if spec.origin in ("built-in", "frozen"):
        return True
    places = spec.submodule_search_locations or ([spec.origin] if spec.origin else [])
    roots = {os.path.realpath(sysconfig.get_paths()[key])
             for key in ("purelib", "platlib", "stdlib", "platstdlib")}
    return bool(places) and all(
        any(os.path.realpath(place).startswith(root + os.sep) for root in roots)
        for place in places)
