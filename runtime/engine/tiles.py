"""Runs a chain of elementwise ops tile by tile, so its intermediates stay in cache.

A server's optimizer update is a chain of elementwise ops over tensors the
size of a parameter: with SGD, momentum and two workers it sums and averages
the gradients, decays the momentum, adds, scales and adds again, 15 passes
over the parameter's bytes, every one through main memory. Run tile by tile
(every op of the chain on the first `TILE_ELEMENTS` elements, then every op
on the next ones), the intermediates of a tile stay in the cache and only the
chain's inputs and the values it keeps travel through memory. Measured on
the PS benchmark's model (6.7 M parameters, one thread): 20 ms op by op,
14 ms in tiles of 256 K elements.

Same kernels on the same elements, so the same bits: tiles are multiples of
the vector width, so every element takes the path (vectorized or scalar tail)
it takes in the whole op. That holds with one intra-op thread (as a process
of a cluster sharing a host has); with several, torch itself splits an op by
thread count, and so do its results.

A run qualifies when every op is either a scalar op (all tensor inputs and
the output 0-dim: the learning rate's sign and dtype) or a functional
pointwise aten op (`torch.Tag.pointwise`, with an out= variant) whose tensor
inputs are 0-dim or exactly the run's shape; scalar ops run once, first (they
read no tiled value). Random ops never qualify (tiled, they would draw their
numbers in another order). At run time a run whose inputs are not contiguous
CPU tensors of the planned shape and dtype runs op by op instead.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import fx
from torch.fx.operator_schemas import get_signature_for_torch_op

__all__ = ["TILE_ELEMENTS", "TiledRun", "find_tiled_runs"]

# 1 MiB of float32 per value: a tile's handful of values stay in the L2/L3
# cache, and one Python call per op and tile costs little beside it.
TILE_ELEMENTS = 1 << 18
# Chains over fewer elements gain nothing worth the bookkeeping.
MIN_TILED_ELEMENTS = 2 * TILE_ELEMENTS


@dataclass(frozen=True)
class _Op:
    name: str
    function: Callable  # the op's out= variant for tiled ops, the op itself for scalar ones
    args: tuple
    kwargs: Mapping


class _Value:
    """A reference to a value by name in an op's arguments."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


def _meta(node: fx.Node) -> torch.Tensor | None:
    value = node.meta.get("val")
    return value if isinstance(value, torch.Tensor) else None


def _schema(op):
    """The op's one schema, or None for what is not a deterministic pointwise
    aten op overload (a random op, tiled, would draw its numbers in another order)."""
    tags = getattr(op, "tags", ())
    if torch.Tag.pointwise not in tags or torch.Tag.nondeterministic_seeded in tags:
        return None
    _, schemas = get_signature_for_torch_op(op, return_schemas=True)
    return schemas[0] if schemas and len(schemas) == 1 else None


@functools.cache
def _out_variant(op) -> Callable | None:
    """`aten.add.out` for `aten.add.Tensor`, `aten.lerp.Scalar_out` for
    `aten.lerp.Scalar`: the overload that takes the same arguments and `out`."""
    schema = _schema(op)
    if schema is None or schema.is_mutable or len(schema.returns) != 1:
        return None
    packet = op.overloadpacket
    names = [a.name for a in schema.arguments]
    for overload in (f"{schema.overload_name}_out", "out"):
        if overload not in packet.overloads():
            continue
        candidate = getattr(packet, overload)
        _, schemas = get_signature_for_torch_op(candidate, return_schemas=True)
        arguments = schemas[0].arguments if schemas else ()
        if [a.name for a in arguments if not a.is_out] == names and \
                [a.name for a in arguments if a.is_out] == ["out"]:
            return candidate
    return None


def _tensor_inputs(node: fx.Node) -> list[torch.Tensor | None]:
    return [_meta(arg) for arg in node.all_input_nodes]


def _is_scalar_op(node: fx.Node) -> bool:
    out = _meta(node)
    if node.op != "call_function" or out is None or out.dim() != 0:
        return False
    return all(t is not None and t.dim() == 0 for t in _tensor_inputs(node))


def _tiles_over(node: fx.Node) -> torch.Size | None:
    """The shape `node` can be tiled over, or None."""
    out = _meta(node)
    if node.op != "call_function" or out is None or out.dim() == 0 or \
            _out_variant(node.target) is None:
        return None
    if any(isinstance(a, (list, tuple, dict)) for a in (*node.args, *node.kwargs.values())):
        return None
    for value in _tensor_inputs(node):
        if value is None or (value.dim() != 0 and value.shape != out.shape):
            return None
    return out.shape


class TiledRun:
    """Consecutive ops of one schedule, run tile by tile.

    `keep`: the values of the run read after it (they get whole tensors);
    the others live in tile-sized scratch tensors.
    """

    def __init__(self, nodes: list[fx.Node], keep: set[str]) -> None:
        self.names = [n.name for n in nodes]
        self.shape = next(_meta(n).shape for n in nodes if not _is_scalar_op(n))
        self.numel = self.shape.numel()
        produced = {n.name for n in nodes}
        self.keep = {name: _meta(n).dtype for name, n in zip(self.names, nodes)
                     if name in keep and not _is_scalar_op(n)}
        self._scalar_ops: list[_Op] = []
        self._tiled_ops: list[_Op] = []
        self._outer: dict[str, torch.dtype] = {}  # tiled inputs from before the run
        self._dtypes: dict[str, torch.dtype] = {}
        for node in nodes:
            args = fx.node.map_arg(node.args, lambda n: _Value(n.name))
            kwargs = dict(fx.node.map_arg(node.kwargs, lambda n: _Value(n.name)))
            if _is_scalar_op(node):
                self._scalar_ops.append(_Op(node.name, node.target, args, kwargs))
                continue
            self._dtypes[node.name] = _meta(node).dtype
            for arg in node.all_input_nodes:
                if arg.name not in produced and _meta(arg).dim() != 0:
                    self._outer[arg.name] = _meta(arg).dtype
            self._tiled_ops.append(_Op(node.name, _out_variant(node.target), args, kwargs))
        # Values the tiled ops read whole from the step (scalars, 0-dim inputs).
        self._whole = {a.name for op in self._tiled_ops
                       for a in (*op.args, *op.kwargs.values())
                       if isinstance(a, _Value) and a.name not in self._outer
                       and a.name not in self._dtypes}

    def can_tile(self, env: Mapping[str, object]) -> bool:
        """True if this step's inputs are contiguous CPU tensors of the planned
        shape and dtype (the outputs' dtypes were planned from them)."""
        for name, dtype in self._outer.items():
            value = env[name]
            if not (isinstance(value, torch.Tensor) and value.device.type == "cpu"
                    and value.shape == self.shape and value.dtype == dtype
                    and value.is_contiguous()):
                return False
        return True

    def run(self, env: dict[str, object]) -> None:
        """Compute the run's values into `env` (kept and scalar values only)."""
        for op in self._scalar_ops:
            env[op.name] = op.function(*_bind(op.args, env), **_bind_kwargs(op.kwargs, env))
        flat = {name: env[name].view(-1) for name in self._outer}
        for name, dtype in self.keep.items():
            whole = torch.empty(self.shape, dtype=dtype)
            env[name] = whole
            flat[name] = whole.view(-1)
        scratch = {op.name: torch.empty(min(TILE_ELEMENTS, self.numel), dtype=self._dtypes[op.name])
                   for op in self._tiled_ops if op.name not in self.keep}
        for start in range(0, self.numel, TILE_ELEMENTS):
            stop = min(start + TILE_ELEMENTS, self.numel)
            tile = {name: env[name] for name in self._whole}
            for name, whole in flat.items():
                tile[name] = whole[start:stop]
            for op in self._tiled_ops:
                out = tile[op.name] if op.name in self.keep else scratch[op.name][:stop - start]
                op.function(*_bind(op.args, tile), **_bind_kwargs(op.kwargs, tile), out=out)
                tile[op.name] = out


def _bind(args: Iterable, env: Mapping[str, object]) -> list:
    return [env[a.name] if isinstance(a, _Value) else a for a in args]


def _bind_kwargs(kwargs: Mapping, env: Mapping[str, object]) -> dict:
    return {k: env[v.name] if isinstance(v, _Value) else v for k, v in kwargs.items()}


def find_tiled_runs(nodes: list[fx.Node | None], kept_after: Callable[[str, int], bool]
                    ) -> list[tuple[int, int, TiledRun]]:
    """Runs worth tiling in a schedule: (first index, last index, run).

    `nodes[i]` is the node the schedule runs at position i (None for a send
    or receive); `kept_after(name, i)` says whether value `name` is read
    after position i (by an op, a send, or as an output or new state).
    """
    found = []
    index = 0
    while index < len(nodes):
        shape, members, start = None, [], index
        while index < len(nodes) and nodes[index] is not None:
            node = nodes[index]
            if _is_scalar_op(node):
                members.append(node)
            else:
                over = _tiles_over(node)
                if over is None or (shape is not None and over != shape):
                    break
                shape = over
                members.append(node)
            index += 1
        # Only the tiled ops and the scalar ops between them: trim scalar ops
        # at the ends (they may feed or follow other ops).
        while members and _is_scalar_op(members[-1]):
            members.pop()
        leading = 0
        while leading < len(members) and _is_scalar_op(members[leading]):
            leading += 1
        members = members[leading:]
        first = start + leading
        if shape is not None and members and shape.numel() >= MIN_TILED_ELEMENTS and \
                sum(not _is_scalar_op(n) for n in members) >= 2:
            last = first + len(members) - 1
            keep = {n.name for n in members if kept_after(n.name, last)}
            found.append((first, last, TiledRun(members, keep)))
        if index == start:
            index += 1
    return found
