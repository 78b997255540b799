"""Copying whole rows of a table by index, bit for bit, at memory speed.

`index_copy_` on the CPU moves one element at a time; moved as 16-byte
elements (the rows viewed as complex128: a plain copy, no arithmetic, so
every bit pattern, NaNs and -0.0 included, arrives as it left) the same rows
go 2.2x faster, `index_select` 1.3x (measured: 1 150 rows of 128 float32
into or out of 125 000, one thread: 657 -> 299 us and 184 -> 138 us). That
is what the servers' write-backs and the workers' installs spend their time
on. Rows that cannot be viewed so (a width in bytes not a multiple of 16, an
unaligned or strided buffer, another device) take the plain ops.
"""

from __future__ import annotations

import torch

__all__ = ["copy_rows_", "gather_rows"]

_WIDE = torch.complex128
_WIDE_BYTES = 16


def _wide(rows: torch.Tensor) -> torch.Tensor | None:
    """`rows` ([n, dim]) viewed as 16-byte elements, or None if it cannot be."""
    if (rows.device.type != "cpu" or rows.dim() != 2 or rows.stride(1) != 1
            or rows.is_complex() or rows.shape[1] * rows.element_size() % _WIDE_BYTES
            or rows.stride(0) * rows.element_size() % _WIDE_BYTES
            or rows.storage_offset() * rows.element_size() % _WIDE_BYTES
            or rows.untyped_storage().data_ptr() % _WIDE_BYTES):
        return None
    return rows.view(_WIDE)


def copy_rows_(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.index_copy_(0, index, src)` for rows: `dst[index[i]] = src[i]`
    (`index` distinct)."""
    wide_dst = _wide(dst)
    wide_src = _wide(src) if src.dtype == dst.dtype else None
    if wide_dst is None or wide_src is None:
        dst.index_copy_(0, index, src.to(dst.dtype))
        return
    wide_dst.index_copy_(0, index, wide_src)


def gather_rows(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`rows.index_select(0, index)`, a new [len(index), dim] tensor."""
    wide = _wide(rows)
    if wide is None:
        return rows.index_select(0, index)
    return wide.index_select(0, index).view(rows.dtype)
