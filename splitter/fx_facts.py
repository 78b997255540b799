"""Facts about one node of a captured graph that several passes read: the
bytes of its value, the size of its elements, its op without the overload
(`aten.add` for `aten.add.Tensor`), and whether it only views, reshapes or
indexes its one input (it then follows that input: `is_follower`). The values
are the fake tensors capture leaves in `node.meta["val"]`."""

from __future__ import annotations

import operator

import torch
from torch import fx

__all__ = ["value_nbytes", "value_itemsize", "op_packet", "FOLLOWER_OPS", "is_follower"]

# The element size assumed for a value without a tensor (a symbolic int, None).
_DEFAULT_ITEMSIZE = 4


def value_nbytes(node: fx.Node) -> int:
    """The bytes of `node`'s tensor value; 0 for anything else (a tuple, an int)."""
    value = node.meta.get("val")
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def value_itemsize(node: fx.Node) -> int:
    """The element size of `node`'s value (of its first if it makes a tuple);
    4 when it has no tensor."""
    value = node.meta.get("val")
    if isinstance(value, (tuple, list)):
        value = value[0]
    return value.element_size() if isinstance(value, torch.Tensor) else _DEFAULT_ITEMSIZE


def op_packet(node: fx.Node):
    """`node`'s target without its overload (`aten.add.Tensor` -> `aten.add`);
    a target that has none (a Python function) as it is."""
    return getattr(node.target, "overloadpacket", node.target)


_aten = torch.ops.aten

# Ops whose result depends on one input's data or only its shape: they run
# where that input is, instead of dragging it to the default process.
FOLLOWER_OPS = frozenset({
    _aten.view, _aten._unsafe_view, _aten.reshape, _aten.t, _aten.transpose,
    _aten.permute, _aten.expand, _aten.squeeze, _aten.unsqueeze, _aten.slice,
    _aten.select, _aten.detach, _aten.alias, _aten.as_strided, _aten.unflatten,
    _aten.flatten, _aten.clone, _aten._to_copy, _aten.ones_like, _aten.zeros_like,
    _aten.empty_like, _aten.full_like, _aten.split, _aten.unbind, _aten.chunk,
    operator.getitem,
})


def is_follower(node: fx.Node) -> bool:
    """`node` only views, reshapes or indexes its one input (FOLLOWER_OPS)."""
    return op_packet(node) in FOLLOWER_OPS and len(node.all_input_nodes) == 1
