"""What the wire says about a tensor: dtype names, `TensorSpec` (dtype and
shape), this machine's byte order, and the small helpers every room uses to
size and describe tensors.

Dtypes travel by name through a fixed table: a name from the network is
looked up, never evaluated.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from types import MappingProxyType

import torch

from ..errors import MessageRejected, TransportError

__all__ = [
    "DTYPES",
    "IS_LITTLE_ENDIAN",
    "TensorSpec",
    "is_wire_dtype",
    "dtype_name",
    "dtype_from_name",
    "describe_spec",
    "nbytes_of",
]

# The wire's dtype table. Adding a dtype here is a protocol change: every
# process of a job must run the same table.
DTYPES: MappingProxyType[str, torch.dtype] = MappingProxyType({
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
})
_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}

# Envelopes say which byte order their data is in; nothing is byte-swapped.
IS_LITTLE_ENDIAN = sys.byteorder == "little"


def is_wire_dtype(dtype: torch.dtype) -> bool:
    """True if the wire carries `dtype`."""
    return dtype in _NAMES


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of `dtype`; `TransportError` for one the wire cannot carry."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise TransportError(
            f"dtype {dtype} cannot be sent; the wire carries "
            f"{', '.join(DTYPES)}. Cast the tensor before it crosses processes") from None


def dtype_from_name(name: str) -> torch.dtype:
    """The dtype a wire name stands for; `MessageRejected` for an unknown name."""
    dtype = DTYPES.get(name)
    if dtype is None:
        raise MessageRejected(
            f"unknown dtype {name[:40]!r}; the wire carries {', '.join(DTYPES)} "
            f"(is the sender running another splitrun version?)")
    return dtype


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A tensor's dtype and shape: what an envelope says about it."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def __str__(self) -> str:
        return f"{_NAMES.get(self.dtype, str(self.dtype).removeprefix('torch.'))}" \
               f"{list(self.shape)}"

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorSpec:
        return cls(tensor.dtype, tuple(tensor.shape))


def describe_spec(spec: TensorSpec | None) -> str:
    """`float32[2, 3]`, or `any tensor` where a contract leaves the tensor open."""
    return "any tensor" if spec is None else str(spec)


def nbytes_of(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes of the tensors' data, together."""
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)
