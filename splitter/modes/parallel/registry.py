"""The op-strategy registry: for an aten op, the placements it can run under.

A strategy names one placement per output and one required placement per
tensor argument (in the order `tensor_args` lists them). Under a strategy the
op runs unchanged on every member's local pieces, except that size arguments
equal to a full output shape are replaced by the local shape (`rewrite.py`).

Covered: matrix products (`mm`, `addmm`, `bmm`), views and reshapes,
elementwise ops (with partial sums where the op is linear in them), `sum`,
`mean`, `embedding` and its backward, `_log_softmax`, `nll_loss` (replicated
only) and backwards, layer norm and its backward, the ops of splitrun's
functional optimizers and a parameter's multi-tensor update. An op with no
entry runs replicated, with a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import fx

from ...fx_facts import op_packet
from ...ops.multi_tensor import foreach_update
from .local_ops import (
    VOCAB_LOG_SOFTMAX,
    VOCAB_LOG_SOFTMAX_BACKWARD,
    VOCAB_LOG_SOFTMAX_BACKWARD_AFTER_NLL,
    AfterNllLoss,
    Exchange,
    vocab_embedding,
    vocab_embedding_backward,
    vocab_nll_loss,
    vocab_nll_loss_backward,
)
from .placement import P, Placement, R, S

__all__ = ["Exchange", "OpStrategy", "strategies_for", "tensor_args", "has_strategy",
           "value_shapes"]

logger = logging.getLogger(__name__)

_aten = torch.ops.aten

Shape = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class OpStrategy:
    outputs: tuple[Placement, ...]
    inputs: tuple[Placement, ...]
    # Runs instead of the op on each member: local(index, group_size, *args),
    # or an `Exchange` (members swap a small summary first), or `AfterNllLoss`
    # (reads the replicated inputs of the nll_loss_backward feeding it).
    local: Callable | Exchange | AfterNllLoss | None = None

    def __str__(self) -> str:
        outs = ", ".join(map(str, self.outputs))
        ins = ", ".join(map(str, self.inputs))
        how = "" if self.local is None else f" [{self.local.__name__}]"
        return f"({ins}) -> {outs}{how}"


def tensor_args(node: fx.Node) -> list[fx.Node]:
    """The node's tensor arguments in argument order, repeats included."""
    found: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), lambda n: found.append(n))
    return found


def value_shapes(node: fx.Node) -> list[Shape]:
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor):
        return [tuple(value.shape)]
    if isinstance(value, (tuple, list)):
        return [tuple(v.shape) if isinstance(v, torch.Tensor) else () for v in value]
    return [()]


# An entry: (node, input shapes, output shapes) -> strategies (unfiltered).
_Rule = Callable[[fx.Node, list[Shape], list[Shape]], list[OpStrategy]]
_RULES: dict[object, _Rule] = {}


def _register(*targets) -> Callable[[_Rule], _Rule]:
    def wrap(rule: _Rule) -> _Rule:
        for target in targets:
            _RULES[target] = rule
        return rule
    return wrap


def has_strategy(node: fx.Node) -> bool:
    return node.target in _RULES or op_packet(node) in _RULES


def strategies_for(node: fx.Node, group_size: int) -> list[OpStrategy]:
    """Every strategy of `node` whose shards divide evenly by `group_size`.

    The first is always the all-replicated one (the fallback).
    """
    args = tensor_args(node)
    in_shapes = [value_shapes(a)[0] for a in args]
    out_shapes = value_shapes(node)
    rule = _RULES.get(node.target) or _RULES.get(op_packet(node))
    replicated = OpStrategy(tuple(R for _ in out_shapes), tuple(R for _ in args))
    if rule is None:
        return [replicated]
    found = [replicated]
    for strategy in rule(node, in_shapes, out_shapes):
        if strategy in found:
            continue
        if len(strategy.inputs) != len(args) or len(strategy.outputs) != len(out_shapes):
            continue
        if not _consistent_repeats(args, strategy.inputs):
            continue
        if all(_divides(p, s, group_size) for p, s in zip(strategy.inputs, in_shapes)) and \
                all(_divides(p, s, group_size) for p, s in zip(strategy.outputs, out_shapes)):
            found.append(strategy)
    return found


def _divides(placement: Placement, shape: Shape, n: int) -> bool:
    if not placement.is_shard:
        return True
    return (placement.dim < len(shape) and shape[placement.dim] % n == 0
            and shape[placement.dim] >= n)


def _consistent_repeats(args: list[fx.Node], placements: Sequence[Placement]) -> bool:
    seen: dict[fx.Node, Placement] = {}
    for arg, placement in zip(args, placements):
        if seen.setdefault(arg, placement) != placement:
            return False
    return True


# -- elementwise ---------------------------------------------------------------

def _aligned(out_shape: Shape, in_shape: Shape, dim: int) -> Placement:
    """The placement an input broadcast to `out_shape` needs for an output S(dim)."""
    offset = len(out_shape) - len(in_shape)
    local = dim - offset
    if local < 0 or in_shape[local] == 1 and out_shape[dim] != 1:
        return R
    return S(local)


def _elementwise(in_shapes, out_shape, partial: Callable[[int], list[tuple]] | None):
    found = []
    for dim in range(len(out_shape)):
        found.append(OpStrategy((S(dim),), tuple(_aligned(out_shape, s, dim) for s in in_shapes)))
    if partial is not None:
        for ins in partial(len(in_shapes)):
            found.append(OpStrategy((P,), ins))
    return found


def _all_partial(num: int) -> list[tuple]:
    return [tuple(P for _ in range(num))]


def _one_partial(num: int) -> list[tuple]:
    return [tuple(P if i == k else R for i in range(num)) for k in range(num)]


def _first_partial(num: int) -> list[tuple]:
    return [tuple(P if i == 0 else R for i in range(num))]


_NONLINEAR = [
    _aten.relu, _aten.gelu, _aten.tanh, _aten.sigmoid, _aten.exp, _aten.log, _aten.sqrt,
    _aten.rsqrt, _aten.pow, _aten.rsub, _aten.where, _aten.threshold, _aten.gelu_backward,
    _aten.tanh_backward, _aten.sigmoid_backward, _aten.addcmul, _aten.addcdiv, _aten.maximum,
    _aten.minimum, _aten.sub.Scalar, _aten.add.Scalar, _aten.abs, _aten.sign, _aten.reciprocal,
    _aten.lt, _aten.gt, _aten.le, _aten.ge, _aten.eq, _aten.ne, _aten.clamp, _aten.silu,
    _aten.silu_backward, _aten.square, _aten.masked_fill, _aten.native_dropout_backward,
]
_LINEAR_ALL = [_aten.add.Tensor, _aten.sub.Tensor, _aten.neg, _aten.clone, _aten.detach,
               _aten.alias, _aten._to_copy, _aten.lerp.Scalar, _aten.mul.Scalar,
               _aten.div.Scalar]
_BILINEAR = [_aten.mul.Tensor]
_LINEAR_FIRST = [_aten.div.Tensor, _aten.threshold_backward]


@_register(*_NONLINEAR)
def _nonlinear(node, in_shapes, out_shapes):
    return _elementwise(in_shapes, out_shapes[0], None)


@_register(*_LINEAR_ALL)
def _linear_all(node, in_shapes, out_shapes):
    # x + c is not linear in x: a constant would be added once per member.
    if op_packet(node) in (_aten.add, _aten.sub) and \
            not all(isinstance(a, fx.Node) for a in node.args[:2]):
        return _elementwise(in_shapes, out_shapes[0], None)
    return _elementwise(in_shapes, out_shapes[0], _all_partial)


@_register(*_BILINEAR)
def _bilinear(node, in_shapes, out_shapes):
    return _elementwise(in_shapes, out_shapes[0], _one_partial)


@_register(*_LINEAR_FIRST)
def _linear_first(node, in_shapes, out_shapes):
    return _elementwise(in_shapes, out_shapes[0], _first_partial)


@_register(_aten.ones_like, _aten.zeros_like, _aten.empty_like, _aten.full_like)
def _like(node, in_shapes, out_shapes):
    # The result depends on the input's shape only: a partial input still has
    # the full shape, so its result is replicated.
    found = [OpStrategy((S(d),), (S(d),)) for d in range(len(out_shapes[0]))]
    return found + [OpStrategy((R,), (P,))]


# -- matrix products -------------------------------------------------------------

@_register(_aten.mm)
def _mm(node, in_shapes, out_shapes):
    return [OpStrategy((S(0),), (S(0), R)), OpStrategy((S(1),), (R, S(1))),
            OpStrategy((P,), (S(1), S(0))), OpStrategy((P,), (P, R)),
            OpStrategy((P,), (R, P))]


@_register(_aten.addmm)
def _addmm(node, in_shapes, out_shapes):
    out = out_shapes[0]
    bias = in_shapes[0]
    return [OpStrategy((S(0),), (_aligned(out, bias, 0), S(0), R)),
            OpStrategy((S(1),), (_aligned(out, bias, 1), R, S(1))),
            OpStrategy((P,), (P, S(1), S(0)))]


@_register(_aten.bmm)
def _bmm(node, in_shapes, out_shapes):
    return [OpStrategy((S(0),), (S(0), S(0))), OpStrategy((S(1),), (S(1), R)),
            OpStrategy((S(2),), (R, S(2))), OpStrategy((P,), (S(2), S(1))),
            OpStrategy((P,), (P, R)), OpStrategy((P,), (R, P))]


# -- views -------------------------------------------------------------------------

@_register(_aten.t)
def _t(node, in_shapes, out_shapes):
    ndim = len(in_shapes[0])
    flips = [OpStrategy((S(ndim - 1 - d),), (S(d),)) for d in range(ndim)]
    return flips + [OpStrategy((P,), (P,))]


@_register(_aten.transpose)
def _transpose(node, in_shapes, out_shapes):
    ndim = len(in_shapes[0])
    a, b = (d % ndim for d in node.args[1:3])
    swap = {a: b, b: a}
    return [OpStrategy((S(swap.get(d, d)),), (S(d),)) for d in range(ndim)] + \
        [OpStrategy((P,), (P,))]


@_register(_aten.permute)
def _permute(node, in_shapes, out_shapes):
    ndim = len(in_shapes[0])
    dims = [d % ndim for d in node.args[1]]
    return [OpStrategy((S(j),), (S(d),)) for j, d in enumerate(dims)] + \
        [OpStrategy((P,), (P,))]


def view_dim_map(in_shape: Shape, out_shape: Shape) -> dict[int, int]:
    """Input dims whose sharding survives a reshape, and where they land.

    Shapes are cut into groups of equal element count; in each group the
    outermost non-1 input dim maps to the outermost non-1 output dim. A shard
    of that input dim is a contiguous block of the group's elements, so it is
    a shard of the output dim when the sizes divide (checked by the caller).
    """
    mapping: dict[int, int] = {}
    i = j = 0
    while i < len(in_shape) and j < len(out_shape):
        gi, gj = [i], [j]
        size_in, size_out = in_shape[i], out_shape[j]
        while size_in != size_out:
            if size_in < size_out:
                i += 1
                if i >= len(in_shape):
                    return mapping
                gi.append(i)
                size_in *= in_shape[i]
            else:
                j += 1
                if j >= len(out_shape):
                    return mapping
                gj.append(j)
                size_out *= out_shape[j]
        first_in = next((d for d in gi if in_shape[d] != 1), None)
        first_out = next((d for d in gj if out_shape[d] != 1), None)
        if first_in is not None and first_out is not None:
            # A sharded dim of size k*N maps to one of size m*N only when the
            # block of the input is the block of the output.
            if in_shape[first_in] % out_shape[first_out] == 0 or \
                    out_shape[first_out] % in_shape[first_in] == 0:
                mapping[first_in] = first_out
        i, j = i + 1, j + 1
    return mapping


@_register(_aten.view, _aten._unsafe_view, _aten.reshape, _aten.unsqueeze, _aten.squeeze,
           _aten.flatten, _aten.unflatten, _aten.view_as)
def _view(node, in_shapes, out_shapes):
    mapping = view_dim_map(in_shapes[0], out_shapes[0])
    found = [OpStrategy((S(o),), (S(i),) + tuple(R for _ in in_shapes[1:]))
             for i, o in mapping.items() if _same_block(in_shapes[0], out_shapes[0], i, o)]
    return found + [OpStrategy((P,), (P,) + tuple(R for _ in in_shapes[1:]))]


def _same_block(in_shape: Shape, out_shape: Shape, i: int, o: int) -> bool:
    """Sharding dim i of the input is sharding dim o of the output: the number
    of elements before and inside the dims agree."""
    before_in = _prod(in_shape[:i])
    before_out = _prod(out_shape[:o])
    return before_in == before_out or (in_shape[i] == out_shape[o])


def _prod(shape) -> int:
    result = 1
    for s in shape:
        result *= s
    return result


@_register(_aten.expand)
def _expand(node, in_shapes, out_shapes):
    src, out = in_shapes[0], out_shapes[0]
    offset = len(out) - len(src)
    found = [OpStrategy((S(d + offset),), (S(d),)) for d in range(len(src))
             if src[d] == out[d + offset]]
    return found + [OpStrategy((P,), (P,))]


@_register(_aten.slice, _aten.select, _aten.cat)
def _index_other_dim(node, in_shapes, out_shapes):
    if node.target is _aten.cat.default:
        dim = node.args[1] if len(node.args) > 1 else 0
    else:
        dim = node.args[1] if len(node.args) > 1 else 0
    ndim = len(in_shapes[0])
    dim %= max(ndim, 1)
    removes = op_packet(node) is _aten.select
    found = []
    for d in range(ndim):
        if d == dim:
            continue
        out_dim = d - 1 if removes and d > dim else d
        found.append(OpStrategy((S(out_dim),), tuple(S(d) for _ in in_shapes)))
    return found + [OpStrategy((P,), tuple(P for _ in in_shapes))]


# -- reductions -------------------------------------------------------------------

def _reduced_dims(node, ndim: int) -> list[int]:
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dims is None or dims == []:
        return list(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    return [d % ndim for d in dims]


def _keepdim(node) -> bool:
    return bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))


@_register(_aten.sum, _aten.mean)
def _reduce(node, in_shapes, out_shapes):
    ndim = len(in_shapes[0])
    is_sum = op_packet(node) is _aten.sum
    dims = _reduced_dims(node, ndim) if node.target not in (_aten.sum.default, _aten.mean.default) \
        else list(range(ndim))
    keep = _keepdim(node) if node.target not in (_aten.sum.default, _aten.mean.default) else False
    found = [OpStrategy((P,), (P,))]
    for d in range(ndim):
        if d in dims:
            if is_sum:
                found.append(OpStrategy((P,), (S(d),)))
            continue
        out_dim = d if keep else d - sum(1 for r in dims if r < d)
        found.append(OpStrategy((S(out_dim),), (S(d),)))
    return found


# -- softmax and losses ------------------------------------------------------------

@_register(_aten._log_softmax, _aten._softmax)
def _softmax(node, in_shapes, out_shapes):
    ndim = len(in_shapes[0])
    dim = node.args[1] % ndim
    found = [OpStrategy((S(d),), (S(d),)) for d in range(ndim) if d != dim]
    if op_packet(node) is _aten._log_softmax:
        found.append(OpStrategy((S(dim),), (S(dim),), local=VOCAB_LOG_SOFTMAX))
    return found


@_register(_aten._log_softmax_backward_data, _aten._softmax_backward_data)
def _softmax_backward(node, in_shapes, out_shapes):
    ndim = len(in_shapes[0])
    dim = node.args[2] % ndim
    found = [OpStrategy((S(d),), (S(d), S(d))) for d in range(ndim) if d != dim]
    if op_packet(node) is _aten._log_softmax_backward_data:
        found.append(OpStrategy((S(dim),), (S(dim), S(dim)), local=VOCAB_LOG_SOFTMAX_BACKWARD))
        if len(in_shapes[0]) == 2 and AfterNllLoss.nll_backward_of(node) is not None:
            found.append(OpStrategy((S(dim),), (S(dim), S(dim)),
                                    local=VOCAB_LOG_SOFTMAX_BACKWARD_AFTER_NLL))
    return found


@_register(_aten.nll_loss_forward)
def _nll_loss(node, in_shapes, out_shapes):
    # Class-sharded log-probabilities, no class weights: each member adds the
    # targets it holds; the loss is a partial sum, the count replicated.
    if len(in_shapes) != 2 or len(in_shapes[0]) != 2:
        return []
    return [OpStrategy((P, R), (S(1), R), local=vocab_nll_loss)]


@_register(_aten.nll_loss_backward)
def _nll_loss_backward(node, in_shapes, out_shapes):
    if len(in_shapes) != 4 or len(in_shapes[1]) != 2:
        return []
    return [OpStrategy((S(1),), (R, S(1), R, R), local=vocab_nll_loss_backward)]


@_register(_aten.mse_loss, _aten.mse_loss_backward)
def _replicated_only(node, in_shapes, out_shapes):
    return []  # a mean over a shard needs the global count: replicated


# -- embedding ----------------------------------------------------------------------

@_register(_aten.embedding)
def _embedding(node, in_shapes, out_shapes):
    ids = in_shapes[1]
    last = len(out_shapes[0]) - 1
    found = [OpStrategy((S(last),), (S(1), R))]
    found += [OpStrategy((S(d),), (R, S(d))) for d in range(len(ids))]
    # Vocabulary-parallel: each member looks up the rows it holds.
    found.append(OpStrategy((P,), (S(0), R), local=vocab_embedding))
    return found


@_register(_aten.embedding_dense_backward)
def _embedding_backward(node, in_shapes, out_shapes):
    grad, ids = in_shapes[0], in_shapes[1]
    found = [OpStrategy((S(1),), (S(len(grad) - 1), R))]
    # Data-parallel lookups: each member's rows add up to the table's gradient.
    found += [OpStrategy((P,), (S(d), S(d))) for d in range(len(ids))]
    found.append(OpStrategy((S(0),), (R, R), local=vocab_embedding_backward))
    return found


# -- layer norm ------------------------------------------------------------------------

def _batch_dims(node, x_shape: Shape) -> range:
    normalized = node.args[1] if op_packet(node) is _aten.native_layer_norm else node.args[2]
    return range(len(x_shape) - len(normalized))


@_register(_aten.native_layer_norm)
def _layer_norm(node, in_shapes, out_shapes):
    found = []
    for d in _batch_dims(node, in_shapes[0]):
        found.append(OpStrategy((S(d), S(d), S(d)), (S(d),) + tuple(R for _ in in_shapes[1:])))
    return found


@_register(_aten.native_layer_norm_backward)
def _layer_norm_backward(node, in_shapes, out_shapes):
    found = []
    for d in _batch_dims(node, in_shapes[1]):
        # args: grad, x, mean, rstd (sharded with the batch), weight, bias
        ins = tuple(S(d) if k < 4 else R for k in range(len(in_shapes)))
        outs = tuple([S(d)] + [P for _ in out_shapes[1:]])
        found.append(OpStrategy(outs, ins))
    return found



# -- multi-tensor updates ---------------------------------------------------------------

@_register(foreach_update)
def _multi_tensor_update(node, in_shapes, out_shapes):
    # One parameter's update is elementwise: its parameter, gradient and state
    # sharded alike, the learning rate and step count (0-dim) replicated.
    if node.kwargs.get("num_params") != 1:
        return []
    num_tensors = len(in_shapes) - 2
    return [OpStrategy(tuple(S(d) for _ in out_shapes), (S(d),) * num_tensors + (R, R))
            for d in range(len(out_shapes[0]))]
