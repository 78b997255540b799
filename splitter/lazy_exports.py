"""Package attributes imported on first use (PEP 562).

A package `__init__` that imported all of its public names would make
importing any one light module of the package (`splitrun.splitter.labels`)
import the heavy ones too: capture pulls in torch._dynamo, about 2 s of every
launcher start. So `splitter` and `runtime` resolve their public names when
they are first used instead.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(namespace: dict[str, Any], exports: Mapping[str, str]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """`__getattr__` and `__dir__` for the package whose `globals()` is
    `namespace`. `exports` maps each public name to the module it lives in,
    relative to the package (`".splitting.graph_splitter"`); a name that is
    the module itself, not one of its attributes, maps to that module
    (`"optim": ".capturing.optim"`).

        __getattr__, __dir__ = lazy_exports(globals(), {"split": ".splitting.graph_splitter"})
    """
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        where = exports.get(name)
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(where, package)
        is_module = where.rpartition(".")[2] == name and not hasattr(module, name)
        value = module if is_module else getattr(module, name)
        namespace[name] = value  # the next lookup is an ordinary attribute
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
