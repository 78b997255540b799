"""One process's share of a split step, as straight-line Python generated once.

As `torch.fx`'s own code generation does for a `GraphModule`, the schedule
becomes one function: every value a local (`v_<node>`), every op's arguments
written into its call, every value `del`-ed after its last use, sends and
receives direct calls into the executor's helpers, each tiled run one call
(with the op-by-op code in its `else`, for a step whose inputs do not tile).
What the plan decides is decided here, once: last uses, which receive is the
step's first (it may wait between steps), which receives are
staleness-bounded, which keep what they bring (`Executor.keep_synced`).

Two functions come from one source: `step`, and `measured`, the same code
with the bookkeeping of the bytes the forward's values hold (`LiveBytes`),
run once per step shape to learn the step's peak.

An exception names its node without per-node cost: every call's line is in
`StepCode.lines`, and `StepCode.failed_at` reads the line the exception left
the generated code from. The source is registered with `linecache`, so
tracebacks show it; `StepCode.source` is the text.
"""

from __future__ import annotations

import itertools
import linecache
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import fx

__all__ = ["LiveBytes", "Op", "StepCode", "Where", "generate", "last_uses"]

_serial = itertools.count()


class LiveBytes:
    """The bytes of memory the forward's values a step computed or received
    hold, and their peak: each storage counted once however many views share
    it, never the storage of the state or the feeds the step started with."""

    __slots__ = ("_given", "_held", "_storages", "live", "peak")

    def __init__(self, given) -> None:
        self._given = {v.untyped_storage().data_ptr() for v in given
                       if isinstance(v, torch.Tensor)}
        self._held: dict[str, int] = {}               # value name -> storage
        self._storages: dict[int, list[int]] = {}    # storage -> [references, bytes]
        self.live = self.peak = 0

    def hold(self, name: str, value) -> None:
        if not isinstance(value, torch.Tensor):
            return
        storage = value.untyped_storage()
        pointer = storage.data_ptr()
        if pointer in self._given:
            return
        self._held[name] = pointer
        entry = self._storages.get(pointer)
        if entry is None:
            self._storages[pointer] = [1, storage.nbytes()]
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        else:
            entry[0] += 1

    def drop(self, name: str) -> None:
        pointer = self._held.pop(name, None)
        if pointer is None:
            return
        entry = self._storages[pointer]
        entry[0] -= 1
        if not entry[0]:
            self.live -= entry[1]
            del self._storages[pointer]


@dataclass(frozen=True)
class Op:
    """One instruction of the schedule, as the generator takes it.

    kind "run": `name` the node, `target` what it calls (a binding or the
    node's target). kind "send"/"recv": `name` the channel, `peer` the other
    end, `values` the node names sent or received; a receive may be
    `bounded` (staleness) or `synced` (a data-sync `keep_synced` keeps).
    """

    kind: str
    name: str
    target: Callable | None = None
    peer: object = None
    values: tuple[str, ...] = ()
    bounded: bool = False
    synced: bool = False


@dataclass(frozen=True)
class Where:
    """What the line an exception left the generated code from ran: a node
    (`node`, `target`) or a tiled run (`tiled`, the run)."""

    node: str | None = None
    target: Callable | None = None
    tiled: object = None


@dataclass
class StepCode:
    """The generated step. Both functions are called as
    `f(step, state, feeds, tile, timeout, first_timeout, between, idle)` and
    return `(outputs, state_updates)`; `measured` returns the step's peak
    activation bytes third."""

    source: str
    filename: str
    step: Callable
    measured: Callable
    lines: dict[int, Where] = field(default_factory=dict)

    def failed_at(self, exc: BaseException) -> Where | None:
        """The node (or tiled run) whose line `exc` left the generated code
        from; None if it came from a send, a receive or the bookkeeping."""
        tb, lineno = exc.__traceback__, None
        while tb is not None:
            if tb.tb_frame.f_code.co_filename == self.filename:
                lineno = tb.tb_lineno
            tb = tb.tb_next
        return None if lineno is None else self.lines.get(lineno)


class _Writer:
    """Source text and the globals it refers to."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.where: dict[int, Where] = {}
        self.globals: dict[str, object] = {}
        self._ids: dict[int, str] = {}

    def line(self, indent: int, text: str, where: Where | None = None) -> None:
        self.lines.append("    " * indent + text)
        if where is not None:
            self.where[len(self.lines)] = where

    def bind(self, value, hint: str) -> str:
        """A global name for `value` (the same one for the same object)."""
        name = self._ids.get(id(value))
        if name is None:
            name = self._ids[id(value)] = f"_{hint}{len(self._ids)}"
            self.globals[name] = value
        return name


def _value(name: str) -> str:
    return f"v_{name}"


def _literal(obj, writer: _Writer) -> str:
    """`obj` (a node's argument) as source: nodes by their local, simple
    literals as themselves, lists, tuples and dicts item by item, anything
    else a global."""
    if isinstance(obj, fx.Node):
        return _value(obj.name)
    kind = type(obj)
    if obj is None or kind in (bool, int, str):
        return repr(obj)
    if kind is float:
        return repr(obj) if math.isfinite(obj) else writer.bind(obj, "c")
    if kind is tuple:
        items = [_literal(o, writer) for o in obj]
        return f"({', '.join(items)}{',' if len(items) == 1 else ''})"
    if isinstance(obj, list):  # fx's immutable_list too
        return f"[{', '.join(_literal(o, writer) for o in obj)}]"
    if isinstance(obj, dict) and all(type(k) is str for k in obj):
        items = [f"{k!r}: {_literal(v, writer)}" for k, v in obj.items()]
        return f"{{{', '.join(items)}}}"
    return writer.bind(obj, "c")


def _call(node: fx.Node, target: Callable, writer: _Writer, device: torch.device) -> str:
    args = [_literal(a, writer) for a in node.args]
    for key, value in node.kwargs.items():
        if key == "device" and isinstance(value, torch.device):
            text = writer.bind(device, "device")  # graphs are captured on CPU
        else:
            text = _literal(value, writer)
        args.append(f"{key}={text}")
    name = getattr(target, "__name__", "op").replace(".", "_")
    if not name.isidentifier():
        name = "op"
    return f"{writer.bind(target, 'f_' + name + '_')}({', '.join(args)})"


def _unpack(names: Sequence[str]) -> str:
    if not names:
        return ""
    return ", ".join(_value(n) for n in names) + ("," if len(names) == 1 else "") + " = "


def last_uses(ops: Sequence[Op], nodes: Mapping[str, fx.Node]) -> dict[str, int]:
    """Value name -> the index of the last op that reads it (an op's
    argument or a sent value)."""
    last: dict[str, int] = {}
    for index, op in enumerate(ops):
        reads = ([a.name for a in nodes[op.name].all_input_nodes] if op.kind == "run"
                 else op.values if op.kind == "send" else ())
        for name in reads:
            last[name] = index
    return last


def generate(*, title: str, ops: Sequence[Op], nodes: Mapping[str, fx.Node],
             state: Mapping[str, str], feeds: Mapping[str, str],
             constants: Mapping[str, object], outputs: Mapping[str, str],
             updates: Mapping[str, str], forward: frozenset[str],
             tiled: Mapping[int, tuple[int, object]], helpers: Mapping[str, Callable],
             device: torch.device) -> StepCode:
    """The step of one process. `state`/`feeds`: key -> the node it is;
    `outputs`/`updates`: key -> the node delivered or kept as new state;
    `forward`: the values counted as activations; `tiled`: first index ->
    (last index, run) of runs tried tile by tile (`tiles.TiledRun`);
    `helpers`: the executor's `send`, `recv`, `recv_bounded`, `synced` and
    `put_state` (a new state value, put in place where it is made; the
    step returns only the updates no op makes)."""
    # A new state value is put in place as soon as it is made (`put_state`),
    # so the old one is freed at its last use, not at the end of the step (a
    # server holds one copy of its parameters and moments, not two); putting
    # it is one more use. Unchanged state (an update that is its input) is
    # returned at the end, as outputs are.
    made_at = {op.name: i for i, op in enumerate(ops) if op.kind == "run"}
    made_at.update({v: i for i, op in enumerate(ops) if op.kind == "recv" for v in op.values})
    put_early: dict[str, list[str]] = {}
    for key, node in updates.items():
        if node in made_at:
            put_early.setdefault(node, []).append(key)
    returned_updates = {k: n for k, n in updates.items() if n not in made_at}
    kept = set(outputs.values()) | set(returned_updates.values())
    last = last_uses(ops, nodes)
    for name in put_early:
        last[name] = max(last.get(name, -1), made_at[name])
    free_after: list[list[str]] = [[] for _ in ops]
    for name, index in last.items():
        if name not in kept and name not in constants:
            free_after[index].append(name)
    first_recv = next((i for i, op in enumerate(ops) if op.kind == "recv"), None)

    writer = _Writer()
    for name, value in constants.items():
        writer.globals[_value(name)] = value
    for helper, function in helpers.items():
        writer.globals[f"_{helper}"] = function
    writer.globals["_LiveBytes"] = LiveBytes
    device_name = writer.bind(device, "device")
    constant_values = writer.bind(tuple(constants.values()), "constants")

    def emit(measure: bool) -> None:
        def hold(indent, names):
            for name in names:
                if name in forward:
                    writer.line(indent, f"_live.hold({name!r}, {_value(name)})")

        def free(indent, names):
            if names:
                writer.line(indent, f"del {', '.join(_value(n) for n in names)}")
                if measure:
                    for name in names:
                        if name in forward:
                            writer.line(indent, f"_live.drop({name!r})")

        def put_free(indent, made, names):
            # What was read last frees first; a new state value is put, then freed.
            free(indent, [n for n in names if n not in put_early])
            for name in made:
                for key in put_early.get(name, ()):
                    writer.line(indent, f"_put_state({key!r}, {_value(name)})")
            free(indent, [n for n in names if n in put_early])

        def one(indent, index):
            op = ops[index]
            if op.kind == "run":
                node = nodes[op.name]
                writer.line(indent, f"{_value(op.name)} = {_call(node, op.target, writer, device)}",
                            Where(node=op.name, target=op.target))
                if measure:
                    hold(indent, [op.name])
            elif op.kind == "send":
                peer = writer.bind(op.peer, "peer")
                tensors = ", ".join(_value(n) for n in op.values)
                writer.line(indent, f"_send(step, {op.name!r}, {peer}, [{tensors}])")
            else:
                peer = writer.bind(op.peer, "peer")
                first = index == first_recv
                timeout = "first_timeout" if first else "timeout"
                if op.bounded:
                    call = f"_recv_bounded(step, {op.name!r}, {peer}, {len(op.values)}, {timeout})"
                else:
                    call = (f"_recv(step, {op.name!r}, {peer}, {len(op.values)}, {timeout}, "
                            f"{'between' if first else 'None'}, {'idle' if first else 'False'})")
                writer.line(indent, _unpack(op.values) + call)
                if op.synced and not op.bounded:
                    writer.line(indent, f"_synced({op.name!r}, step, "
                                        f"[{', '.join(_value(n) for n in op.values)}])")
                if measure:
                    hold(indent, op.values)
            made = [op.name] if op.kind == "run" else op.values if op.kind == "recv" else ()
            put_free(indent, made, free_after[index])

        name = "measured" if measure else "step"
        writer.line(0, f"def {name}(step, state, feeds, tile, timeout, first_timeout, between, "
                       f"idle):")
        for key, node in state.items():
            writer.line(1, f"{_value(node)} = state[{key!r}]")
        for key, node in feeds.items():
            writer.line(1, f"{_value(node)} = feeds[{key!r}].to({device_name}, "
                           f"non_blocking=True)")
        if measure:
            given = [_value(n) for n in (*state.values(), *feeds.values())]
            writer.line(1, f"_live = _LiveBytes(({', '.join(given)}{',' if given else ''}) + "
                           f"{constant_values})")
        index = 0
        while index < len(ops):
            if index in tiled:
                stop, run = tiled[index]
                members = [nodes[ops[i].name] for i in range(index, stop + 1)]
                produced = {n.name for n in members}
                inputs = dict.fromkeys(a.name for n in members for a in n.all_input_nodes
                                       if a.name not in produced)
                run_name = writer.bind(run, "tiled")
                env = ", ".join(f"{n!r}: {_value(n)}" for n in inputs)
                writer.line(1, f"if tile and {run_name}.can_tile(_env := {{{env}}}):")
                writer.line(2, f"{run_name}.run(_env)", Where(tiled=run))
                for n in members:
                    if n.name in kept or n.name in put_early or last.get(n.name, -1) > stop:
                        writer.line(2, f"{_value(n.name)} = _env[{n.name!r}]")
                writer.line(2, "del _env")
                put_free(2, [n.name for n in members],
                         [n for i in range(index, stop + 1) for n in free_after[i]
                          if n not in produced or n in put_early])
                writer.line(1, "else:")
                writer.line(2, "_env = None")
                for i in range(index, stop + 1):
                    one(2, i)
                index = stop + 1
                continue
            one(1, index)
            index += 1
        results = (f"{{{', '.join(f'{k!r}: {_value(n)}' for k, n in outputs.items())}}}, "
                   f"{{{', '.join(f'{k!r}: {_value(n)}' for k, n in returned_updates.items())}}}")
        writer.line(1, f"return {results}{', _live.peak' if measure else ''}")

    emit(False)
    writer.line(0, "")
    emit(True)
    source = "\n".join(writer.lines) + "\n"
    filename = f"<splitrun step {title} #{next(_serial)}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = dict(writer.globals)
    exec(compile(source, filename, "exec"), namespace)  # noqa: S102 - our own generated code
    return StepCode(source=source, filename=filename, step=namespace["step"],
                    measured=namespace["measured"], lines=writer.where)
