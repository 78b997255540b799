"""Group a process's multi-tensor updates: one `foreach_update` call per group
of parameters with the same optimizer and settings, after the split.

Capture appends one `foreach_update` node per parameter (its optimizer set
`foreach=True`); which parameters share a process is known only once the
plan is made (a group's parameters may live on different servers). This
pass walks each process's schedule: the updates that run between the same
two messages (one stretch of `run` instructions) with equal settings,
learning rate and step count become one node (or one per GROUP_BYTES of
parameters, in schedule order), placed where the last of them was.
Nothing another process waits for moves later than a message did, so the
plan's messages and their order are unchanged, and since a multi-tensor
kernel computes every tensor alone (`ops.multi_tensor`), the results are
the same bits.

Requires: a finished plan and the program its names refer to.
Ensures: every grouped update's getitems read the new node at their
parameter's place; the graph stays in a topological order; the captured
program (the unsplit reference) is not touched (the graph is copied).
"""

from __future__ import annotations

import dataclasses
import operator
from collections import Counter

from torch import fx

from ..labels import MODULE_ANNOTATION
from ..ops.multi_tensor import foreach_update
from ..plan.model import Instruction, OpKind, SplitPlan
from ..program import Program, node_annotation, set_node_annotation

__all__ = ["group_updates"]

# The most parameter bytes one grouped call updates. A call makes all its new
# parameters and state before the old ones can go (a single-tensor chain puts
# each parameter's in place as it goes), so this bounds what a process holds
# beyond its state during an update: about three times this for Adam.
GROUP_BYTES = 64 << 20


def group_updates(plan: SplitPlan, program: Program) -> tuple[SplitPlan, Program]:
    """The plan and program with each process's updates grouped (see the module)."""
    if not any(n.target is foreach_update for n in program.graph.nodes):
        return plan, program
    program = _copied(program)
    nodes = {n.name: n for n in program.graph.nodes}
    # Every process's groups first, then the merges: an update several
    # processes run (replicated on the workers) is grouped only where they all
    # group it alike, and is never merged twice.
    found = list(dict.fromkeys(members for proc in plan.processes
                               for members in _groups_in(proc.schedule, nodes)))
    taken = Counter(member for members in found for member in members)
    # members -> the grouped node's name and its getitems' names, in graph order
    groups: dict[tuple[str, ...], tuple[str, list[str]]] = {}
    for members in found:
        if all(taken[member] == 1 for member in members):
            groups[members] = _merge(program.graph, [nodes[m] for m in members])
    if not groups:
        return plan, program
    program.graph_module.recompile()
    processes = tuple(dataclasses.replace(p, schedule=_rescheduled(p.schedule, groups))
                      for p in plan.processes)
    return dataclasses.replace(plan, processes=processes, _index={}), program


def _copied(program: Program) -> Program:
    graph = fx.Graph()
    returned = graph.graph_copy(program.graph, {})
    graph.output(returned)
    gm = fx.GraphModule(program.graph_module, graph, class_name=type(program.graph_module).__name__)
    return dataclasses.replace(program, graph_module=gm)


def _results(node: fx.Node) -> list[fx.Node] | None:
    """The getitems of a one-parameter update, or None if anything else reads it."""
    users = list(node.users)
    if not all(u.target is operator.getitem for u in users):
        return None
    return sorted(users, key=lambda u: u.args[1])


def _key(node: fx.Node) -> tuple:
    n = node.kwargs["num_params"]
    lr, step = node.args[-2], node.args[-1]
    return (tuple(sorted((k, repr(v)) for k, v in node.kwargs.items() if k != "num_params")),
            lr.name, step.name, n)


def _by_bytes(members: list[str], nodes) -> list[tuple[str, ...]]:
    """`members` in consecutive runs of at most GROUP_BYTES of parameters
    (one larger parameter alone)."""
    chunks: list[tuple[str, ...]] = []
    chunk: list[str] = []
    held = 0
    for name in members:
        value = nodes[name].meta["val"][0]
        size = value.numel() * value.element_size()
        if chunk and held + size > GROUP_BYTES:
            chunks.append(tuple(chunk))
            chunk, held = [], 0
        chunk.append(name)
        held += size
    if chunk:
        chunks.append(tuple(chunk))
    return chunks


def _groups_in(schedule, nodes) -> list[tuple[str, ...]]:
    """Per stretch of `run` instructions, the one-parameter updates with the
    same key whose results are read only after the stretch (by sends or as
    outputs), two or more each, in schedule order."""
    found: list[tuple[str, ...]] = []
    open_groups: dict[tuple, list[str]] = {}
    in_stretch: set[str] = set()

    def close() -> None:
        for members in open_groups.values():
            found.extend(chunk for chunk in _by_bytes(members, nodes) if len(chunk) >= 2)
        open_groups.clear()
        in_stretch.clear()

    for instr in schedule:
        if instr.kind is not OpKind.RUN:
            close()
            continue
        in_stretch.add(instr.target)
        node = nodes[instr.target]
        if node.target is not foreach_update or node.kwargs["num_params"] != 1:
            continue
        results = _results(node)
        if results is None or any(u.op != "output" for r in results for u in r.users):
            continue
        open_groups.setdefault(_key(node), []).append(instr.target)
    close()
    return found


def _merge(graph: fx.Graph, members: list[fx.Node]) -> tuple[str, list[str]]:
    """One update of all `members` (one parameter each), where the last was:
    its name and its getitems' names."""
    n = len(members)
    first = members[0]
    num_state = len(first.args) - 4
    params = [m.args[0] for m in members]
    grads = [m.args[1] for m in members]
    states = [m.args[2 + j] for j in range(num_state) for m in members]
    kwargs = {**first.kwargs, "num_params": n}
    with graph.inserting_before(members[-1]):
        grouped = graph.call_function(foreach_update, (*params, *grads, *states,
                                                       *first.args[-2:]), kwargs)
    metas = [m.meta["val"] for m in members]
    grouped.meta["val"] = (*[v[0] for v in metas],
                           *[v[1 + j] for j in range(num_state) for v in metas])
    label = node_annotation(members[-1])
    if label is not None:
        set_node_annotation(grouped, label)
    names = [(node_annotation(m, MODULE_ANNOTATION) or "").removeprefix("optimizer.")
             for m in members]
    set_node_annotation(grouped, f"optimizer.{{{','.join(names)}}}", MODULE_ANNOTATION)
    at, getitems = grouped, []
    for i, member in enumerate(members):
        for result in _results(member):
            index = result.args[1]
            result.args = (grouped, i if index == 0 else n + (index - 1) * n + i)
            at.append(result)  # after the grouped node, in a fixed order
            at = result
            getitems.append(result.name)
        graph.erase_node(member)
    return grouped.name, getitems


def _rescheduled(schedule, groups: dict[tuple[str, ...], tuple[str, list[str]]]) -> tuple:
    """The schedule with each group's members and their getitems replaced,
    at the last member's place, by the grouped node and the getitems."""
    last_of = {members[-1]: grouped for members, grouped in groups.items()}
    dropped = {m for members in groups for m in members}
    dropped |= {g for _, getitems in groups.values() for g in getitems}
    out = []
    for instr in schedule:
        if instr.kind is OpKind.RUN and instr.target in last_of:
            name, getitems = last_of[instr.target]
            out.append(Instruction(OpKind.RUN, name))
            out.extend(Instruction(OpKind.RUN, g) for g in getitems)
        elif instr.kind is OpKind.RUN and instr.target in dropped:
            continue
        else:
            out.append(instr)
    return tuple(out)
