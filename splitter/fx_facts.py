"""Facts about one node of a captured graph that several passes read: the
bytes of its value, the size of its elements, and its op without the overload
(`aten.add` for `aten.add.Tensor`). The values are the fake tensors capture
leaves in `node.meta["val"]`."""

from __future__ import annotations

import torch
from torch import fx

__all__ = ["value_nbytes", "value_itemsize", "op_packet"]

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
