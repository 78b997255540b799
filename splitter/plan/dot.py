"""A plan as a Graphviz picture.

Each process is a coloured cluster of blocks (runs of its ops between
communication points); each channel is an edge from the block that sends it to
the block that receives it, labelled with its tensors and bytes per step.
Data-sync channels are dashed, control edges dotted. A parallel plan draws a
cluster per group around its members, and labels each edge with the placement
changes its values serve (`addmm_1: P→R all-reduce 256 B`). An embedding-cache
plan draws each worker's row cache and its row traffic with every server
(bold, both ways), which travels outside the channels. A micro-batched plan
names each block's actions (`F0 F1`) and adds a table of the schedule, one row
per stage and one column per time slot, whose empty cells are the bubble.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..labels import Role
from .model import ChannelKind, Instruction, OpKind, PipelineSummary, SplitPlan, actions_in
from .pipeline_order import Action

__all__ = ["plan_to_dot", "count_of"]

_COLOURS = ["#dbeafe", "#dcfce7", "#fef9c3", "#fce7f3", "#ede9fe", "#ffedd5",
            "#cffafe", "#e5e7eb"]
_MAX_NAMES = 4
# The pipeline table's cells: forwards blue, backwards red, idle slots white.
_SLOT_COLOURS = {"F": "#bfdbfe", "B": "#fecaca", "": "white"}


def _quote(text: str) -> str:
    # Node and channel names are identifiers; "\n" in labels is DOT's line break.
    return '"' + text.replace('"', '\\"') + '"'


def _size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes} B"


def count_of(number: int, noun: str) -> str:
    """`1 op`, `3 ops`."""
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _names(values: tuple[str, ...]) -> str:
    shown = ", ".join(values[:_MAX_NAMES])
    more = len(values) - _MAX_NAMES
    return shown + (f", +{more} more" if more > 0 else "")


def plan_to_dot(plan: SplitPlan,
                describe_ops: Callable[[Sequence[str]], str] | None = None,
                describe_values: Callable[[Sequence[str]], str] | None = None) -> str:
    """The picture of `plan`. `describe_ops(ops)` (optional) gives a block's
    label from its node names, and `describe_values(values)` a channel's
    from the names of the values it carries, as lines joined by `\\n`; by
    default the number of ops and the first few names."""
    lines = ["digraph splitrun_plan {", "  rankdir=LR;",
             '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];',
             '  edge [fontname="Helvetica", fontsize=9];']
    send_block: dict[str, str] = {}
    recv_block: dict[str, str] = {}
    group_of = {}
    if plan.parallel is not None:
        group_of = {label: group for group in plan.parallel.groups for label in group}
    open_group = None
    for index, proc in enumerate(plan.processes):
        group = group_of.get(proc.label)
        if group is not open_group:
            if open_group is not None:
                lines.append("  }")
            if group is not None:
                members = ", ".join(map(str, group))
                lines.append(f"  subgraph cluster_group_{group[0]} {{")
                lines.append(f"    label={_quote(f'group {group[0]}: {members}')}; "
                             f"style=dashed; color=\"#6b7280\";")
            open_group = group
        colour = _COLOURS[index % len(_COLOURS)]
        lines.append(f"  subgraph cluster_{proc.label} {{")
        lines.append(f"    label={_quote(proc.label.describe())}; style=filled; "
                     f"color={_quote(colour)};")
        previous = f"{proc.label}_start"
        lines.append(f"    {previous} [label={_quote('step start')}, shape=circle, "
                     f"fillcolor=white, fontsize=8];")
        blocks = _blocks(proc.schedule)
        for number, (ops, recvs, sends) in enumerate(blocks, start=1):
            name = previous
            if ops:
                name = f"{proc.label}_b{number}"
                text = (describe_ops(ops) if describe_ops is not None
                        else f"{count_of(len(ops), 'op')}\\n{_names(tuple(ops))}")
                if plan.pipeline is not None:
                    text = f"{' '.join(actions_in(_runs(ops))) or 'once per step'}\\n{text}"
                lines.append(f"    {name} [label={_quote(text)}, fillcolor=white];")
                lines.append(f"    {previous} -> {name} [style=invis];")
            recv_block.update((channel, name) for channel in recvs)
            send_block.update((channel, name) for channel in sends)
            previous = name
        if plan.cached_tables and proc.label.role is Role.WORKER:
            lines.append(f"    {proc.label}_rows [label={_quote(_cache_text(plan))}, "
                         f"shape=cylinder, fillcolor=white];")
        lines.append("  }")
    if open_group is not None:
        lines.append("  }")

    syncing = {s.channel for s in plan.data_syncs}
    for channel in plan.channels:
        src = send_block.get(channel.name, f"{channel.src}_start")
        dst = recv_block.get(channel.name, f"{channel.dst}_start")
        if channel.kind is ChannelKind.CONTROL:
            style, label = "dotted", f"{channel.name}\\ncontrol"
        else:
            style = "dashed" if channel.name in syncing else "solid"
            carried = (describe_values(channel.values) if describe_values is not None
                       else _names(channel.values))
            label = f"{channel.name}\\n{carried}\\n{_size(channel.nbytes)}/step"
            served = _collectives_of(plan, channel.values)
            if served:
                label = f"{channel.name}\\n{served}\\n{_size(channel.nbytes)}/step"
        lines.append(f"  {src} -> {dst} [label={_quote(label)}, style={style}];")
    lines += _row_traffic(plan)
    if plan.pipeline is not None:
        grid = _pipeline_grid(plan.pipeline)
        lines.append(f'  pipeline [shape=plaintext, style="", label=<{grid}>];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def _cache_text(plan: SplitPlan) -> str:
    tables = plan.cached_tables
    sizes = sorted({(t.cache_rows, t.policy) for t in tables})
    each = ", ".join(f"{rows} rows ({policy})" for rows, policy in sizes)
    return f"row cache\\n{count_of(len(tables), 'table')}: {each} each"


def _row_traffic(plan: SplitPlan) -> list[str]:
    """Each worker's cache to each server: the rows the cached tables move,
    outside the channels (an upper bound: every lookup a miss)."""
    if not plan.cached_tables:
        return []
    names = _names(tuple(t.key for t in plan.cached_tables))
    bound = plan.row_bytes_per_step()
    amount = (f"≤ {_size(bound)}/step each way, all servers" if bound
              else "as many rows as a step looks up")
    label = f"embedding rows: {names}\\nmisses pulled, dirty rows pushed\\n{amount}"
    workers = [p.label for p in plan.processes if p.label.role is Role.WORKER]
    servers = [p.label for p in plan.processes if p.label.role is Role.SERVER]
    return [f"  {w}_rows -> {s}_start [label={_quote(label)}, dir=both, style=bold, "
            f"color=\"#2563eb\", fontcolor=\"#1d4ed8\"];" for w in workers for s in servers]


def _collectives_of(plan: SplitPlan, values: tuple[str, ...]) -> str:
    """The placement changes a parallel plan's channel serves: its values are
    named `VALUE__...` after the captured step's node they carry pieces of."""
    if plan.parallel is None:
        return ""
    carried = {value.split("__", 1)[0] for value in values}
    found = [c for c in plan.parallel.collectives if c.value in carried]
    return "\\n".join(f"{c.value}: {c.src}→{c.dst} {c.kind} {_size(c.nbytes)}"
                       for c in found[:_MAX_NAMES])


def _blocks(schedule) -> list[tuple[list[str], list[str], list[str]]]:
    """Split a schedule into blocks: (ops, channels received just before them,
    channels sent just after them)."""
    blocks: list[tuple[list[str], list[str], list[str]]] = [([], [], [])]
    for instr in schedule:
        ops, recvs, sends = blocks[-1]
        if instr.kind is OpKind.RUN:
            if sends:  # a new run after sends starts a new block
                blocks.append(([instr.target], [], []))
            else:
                ops.append(instr.target)
        elif instr.kind is OpKind.RECV:
            if ops or sends:
                blocks.append(([], [instr.target], []))
            else:
                recvs.append(instr.target)
        else:
            sends.append(instr.target)
    return blocks


def _runs(ops: list[str]) -> tuple[Instruction, ...]:
    return tuple(Instruction(OpKind.RUN, op) for op in ops)


def _pipeline_grid(pipeline: PipelineSummary) -> str:
    """The schedule as a table, one row per process and one column per time
    slot, each action taking one slot; empty cells are the bubble. Slots come
    from running the processes' action orders with F(m) of a stage after the
    previous stage's F(m) and B(m) after the next stage's B(m)."""
    num_stages = len(pipeline.stages)
    last_stage = pipeline.num_virtual_stages - 1

    def stage_of(action: Action, process: int) -> int:
        return process if action.stage is None else action.stage

    def before(action: Action, process: int) -> tuple[int, Action] | None:
        """The (process, action) that must end before `action` can start."""
        stage = stage_of(action, process) + (-1 if action.phase == "F" else 1)
        if not 0 <= stage <= last_stage:
            return None
        named = stage if action.stage is not None else None
        return pipeline.process_of(stage), action._replace(stage=named)

    done: dict[tuple[int, Action], int] = {}
    cursor = [0] * num_stages
    free_at = [0] * num_stages
    actions = [[Action.parse(a) for a in row] for row in pipeline.actions]
    total = sum(len(a) for a in actions)
    while len(done) < total:
        moved = False
        for process, row in enumerate(actions):
            while cursor[process] < len(row):
                action = row[cursor[process]]
                waits_for = before(action, process)
                if waits_for is not None and waits_for[1] in actions[waits_for[0]]:
                    if waits_for not in done:
                        break
                    start = max(free_at[process], done[waits_for])
                else:
                    start = free_at[process]
                done[(process, action)] = free_at[process] = start + 1
                cursor[process] += 1
                moved = True
        if not moved:
            break  # check_plan reports schedules that cannot finish
    width = max(free_at, default=0)
    rows = [f'<tr><td colspan="{width + 1}"><b>{pipeline.schedule.value}, '
            f"{pipeline.num_microbatches} micro-batches"
            f"{f', {pipeline.num_chunks} chunks each' if pipeline.num_chunks > 1 else ''}"
            f": bubble in theory "
            f"{pipeline.theoretical_bubble():.0%}</b></td></tr>"]
    for stage, label in enumerate(pipeline.stages):
        cells: list[Action | None] = [None] * width
        for (where, action), end in done.items():
            if where == stage:
                cells[end - 1] = action
        row = "".join(f'<td bgcolor="{_SLOT_COLOURS[c.phase if c else ""]}">'
                      f'{c if c else "&nbsp;"}</td>' for c in cells)
        rows.append(f"<tr><td>{label}</td>{row}</tr>")
    return '<table border="0" cellborder="1" cellspacing="0">' + "".join(rows) + "</table>"
