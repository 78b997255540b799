"""Copying whole rows of a table by index, bit for bit, at memory speed.

`index_copy_` and `index_select` on the CPU move one element at a time
(even viewed as 16-byte elements). Here a row is one numpy element of the
row's width in bytes (a `np.void` dtype): numpy's fancy indexing moves each
row with one `memcpy`, whatever its alignment and dtype (bfloat16 too: the
bytes are viewed, never converted), so every bit pattern, NaNs and -0.0
included, arrives as it left. Measured (1 000 rows of 128 float32 into or
out of 125 000, one thread): scatter 139 us (`index_copy_`), 55 us (as
complex128), 19 us here; gather 45 us (`index_select` as complex128), 23 us
here. Rows that misalign in memory cost no more (a row lent in place by a
shared-memory ring follows ids of any count). That is what the servers'
write-backs and pulls and the workers' installs and write-backs spend their
time on. `gather_rows_into` gathers into memory the caller has (a message's
slot in a shared-memory ring, `Transport.send_filled`): one copy, not a
gather and a copy. Rows that cannot be viewed so (another device, a row not
contiguous) take torch's ops. `RowArray` views a buffer that lives long (a
server's shard) once, for many copies indexed by numpy arrays: a server's
request moves a few hundred rows per table, where setting up the views each
time cost as much as the copies.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["RowArray", "copy_rows_", "gather_rows", "gather_rows_into"]


def _row_elements(rows: torch.Tensor) -> np.ndarray | None:
    """`rows` ([n, dim], CPU, each row contiguous) as a 1-d numpy array of n
    whole-row elements viewing the same memory, or None if it cannot be."""
    if (rows.device.type != "cpu" or rows.dim() != 2 or rows.shape[1] == 0
            or rows.stride(1) != 1 or rows.is_conj() or rows.is_neg()):
        return None
    row_bytes = rows.shape[1] * rows.element_size()
    as_bytes = rows.detach().view(torch.uint8).numpy()  # [n, row_bytes], the same memory
    return as_bytes.view(np.dtype((np.void, row_bytes))).reshape(rows.shape[0])


def copy_rows_(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.index_copy_(0, index, src)` for rows: `dst[index[i]] = src[i]`
    (`index` distinct, on the CPU for the fast path)."""
    if src.dtype != dst.dtype:
        src = src.to(dst.dtype)
    to_rows = _row_elements(dst)
    from_rows = _row_elements(src) if to_rows is not None else None
    if from_rows is None or index.device.type != "cpu":
        dst.index_copy_(0, index.to(dst.device), src.to(dst.device))
        return
    to_rows[index.numpy()] = from_rows


def gather_rows(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`rows.index_select(0, index)`, a new [len(index), dim] tensor."""
    elements = _row_elements(rows)
    if elements is None or index.device.type != "cpu":
        return rows.index_select(0, index.to(rows.device))
    gathered = elements[index.numpy()]  # a new array of whole rows
    as_bytes = torch.from_numpy(gathered.view(np.uint8).reshape(index.numel(), elements.itemsize))
    return as_bytes.view(rows.dtype)


def gather_rows_into(out: torch.Tensor, rows: torch.Tensor, index: torch.Tensor) -> None:
    """`out[i] = rows[index[i]]`: `torch.index_select(rows, 0, index, out=out)`
    for rows, straight into `out` ([len(index), dim], `rows`' dtype, CPU).
    An index outside `rows` is an `IndexError`, as fancy indexing's."""
    to_rows = _row_elements(out)
    from_rows = _row_elements(rows) if to_rows is not None else None
    if from_rows is None or index.device.type != "cpu" or out.dtype != rows.dtype:
        out.copy_(rows.index_select(0, index.to(rows.device)))
        return
    where = index.numpy()
    if where.size and (where.min() < -len(from_rows) or where.max() >= len(from_rows)):
        raise IndexError(f"row index out of range: {int(where.min())}..{int(where.max())} "
                         f"of {len(from_rows)} rows")
    # 'wrap': unbuffered into `out` (the default 'raise' gathers into a
    # temporary first); the bounds are checked above, negatives count from
    # the end as in fancy indexing.
    np.take(from_rows, where, axis=0, out=to_rows, mode="wrap")


class RowArray:
    """The rows of a CPU [n, dim] buffer (each row contiguous), viewed once
    as whole-row elements for `put` and `take_into` by numpy index. The
    caller checks its indices lie in [0, n): numpy counts negatives from the
    end (see `gather_rows_into`)."""

    __slots__ = ("rows", "dtype", "shape", "_elements")

    def __init__(self, rows: torch.Tensor) -> None:
        elements = _row_elements(rows)
        if elements is None:
            raise ValueError(f"RowArray needs CPU rows, each contiguous, got "
                             f"{rows.device.type} {list(rows.shape)} strides {rows.stride()}")
        self.rows, self.dtype, self.shape = rows, rows.dtype, tuple(rows.shape)
        self._elements = elements

    def put(self, index: np.ndarray, src: torch.Tensor) -> None:
        """`rows[index[i]] = src[i]` (`index` distinct, `src` [len(index), dim])."""
        from_rows = _row_elements(src) if src.dtype == self.dtype else None
        if from_rows is None:
            from_rows = _row_elements(src.to("cpu", self.dtype).contiguous())
        self._elements[index] = from_rows

    def take_into(self, out: torch.Tensor, index: np.ndarray) -> None:
        """`out[i] = rows[index[i]]` (`out` [len(index), dim])."""
        to_rows = _row_elements(out) if out.dtype == self.dtype else None
        if to_rows is None:
            out.copy_(self.rows.index_select(0, torch.from_numpy(index)))
            return
        # 'wrap': unbuffered into `out` (the caller checked the bounds).
        np.take(self._elements, index, axis=0, out=to_rows, mode="wrap")
