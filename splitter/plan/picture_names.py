"""The names the plan's picture gives a step's values: each op's module (as
the capture annotated it; a view or transpose of a module's value, which the
capture leaves unannotated, its input's) and each input's own name (a
parameter's key, `batch.0`, `lr`), instead of fx node names (`view_5`,
`p_mlp_0_weight`). `splitrun plan` writes them next to the plan's text."""

from __future__ import annotations

from ..fx_facts import is_follower
from ..program import Program

__all__ = ["picture_names"]


def picture_names(program: Program) -> dict[str, dict[str, str]]:
    """{"modules": node -> module path, "values": input node -> its key}."""
    modules: dict[str, str] = {}
    for node in program.graph.nodes:
        module = program.module_of(node)
        if module is None and is_follower(node):
            module = modules.get(node.all_input_nodes[0].name)
        if module is not None:
            modules[node.name] = module
    return {"modules": modules, "values": {spec.node: spec.key for spec in program.inputs}}
