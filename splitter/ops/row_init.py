"""A table's starting rows as a function of `(seed, table, id)` alone.

A counter-based generator (splitmix64 over the row's id and column, as JAX's
random keys work): any process makes any row without making the others, so a
server makes exactly its own rows, a worker makes none, a restarted server
makes the same rows again, and a test's reference makes the whole table the
same way. Rows are computed in float64 on the CPU and rounded once to the
table's dtype, so every process and every call agrees bit for bit.

    init = normal(std=0.01, seed=7)
    rows = init.rows(torch.tensor([3, 10**12]), dim=16, table="item")

Users reach them as `splitrun.splitter.RowInit.normal(...)` (and `.uniform`,
`.xavier_uniform`, `.zeros`, `.function`).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import RowInitError

__all__ = ["RowInit", "normal", "uniform", "xavier_uniform", "zeros", "row_function",
           "whole_table"]

_GOLDEN = 0x9E3779B97F4A7C15
_MIX_1 = 0xBF58476D1CE4E5B9
_MIX_2 = 0x94D049BB133111EB
# Ids are turned into rows in blocks of this many values: the int64 counters of a
# block stay a few MB whatever the number of ids asked for.
_BLOCK_VALUES = 1 << 20


def _signed(value: int) -> int:
    """`value` mod 2^64 as the int64 torch holds it (wrapping arithmetic)."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """A logical (unsigned) right shift of int64 `x`; torch's `>>` is arithmetic."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser: a bijection of 64-bit words that scatters every bit."""
    x = x + _signed(_GOLDEN)
    x = (x ^ _shift_right(x, 30)) * _signed(_MIX_1)
    x = (x ^ _shift_right(x, 27)) * _signed(_MIX_2)
    return x ^ _shift_right(x, 31)


def _table_key(seed: int, table: str) -> int:
    key = _mix(torch.tensor([_signed(seed * 0x100000001B3 ^ zlib.crc32(table.encode()))]))
    return int(key.item())


def _uniform01(ids: torch.Tensor, columns: int, key: int, stream: int) -> torch.Tensor:
    """[len(ids), columns] float64 in (0, 1]: 53 bits of the mix of (key, id, column)."""
    counters = _mix(ids.to(torch.int64).reshape(-1, 1) + key)
    counters = _mix(counters * columns + torch.arange(columns, dtype=torch.int64)
                    + _signed(stream * _GOLDEN))
    return (_shift_right(counters, 11) + 1).to(torch.float64) / float(1 << 53)


@dataclass(frozen=True)
class RowInit:
    """How a table's rows start. `rows(ids, dim, table)` gives the rows of `ids`."""

    kind: str
    seed: int = 0
    a: float = 0.0
    b: float = 1.0
    row_fn: Callable[[torch.Tensor], torch.Tensor] | None = None

    @staticmethod
    def normal(std: float = 1.0, mean: float = 0.0, seed: int = 0) -> RowInit:
        return normal(std, mean, seed)

    @staticmethod
    def uniform(low: float = -1.0, high: float = 1.0, seed: int = 0) -> RowInit:
        return uniform(low, high, seed)

    @staticmethod
    def xavier_uniform(gain: float = 1.0, seed: int = 0) -> RowInit:
        return xavier_uniform(gain, seed)

    @staticmethod
    def zeros() -> RowInit:
        return zeros()

    @staticmethod
    def function(function: Callable[[torch.Tensor], torch.Tensor]) -> RowInit:
        return row_function(function)

    def rows(self, ids: torch.Tensor, dim: int, table: str, *, num_rows: int | None = None,
             dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The starting rows of int64 `ids` of `table` ([len(ids), dim], `dtype`, CPU)."""
        if ids.dtype not in (torch.int64, torch.int32):
            raise RowInitError(f"row initializer of table {table!r}: ids must be int64, got "
                             f"{ids.dtype}; pass ids.to(torch.int64)")
        ids = ids.reshape(-1).cpu()
        if self.kind == "function":
            return self._from_function(ids, dim, table, dtype)
        out = torch.empty(len(ids), dim, dtype=dtype)
        if self.kind == "zeros" or len(ids) == 0:
            return out.zero_()
        key = _table_key(self.seed, table)
        low, high = self._bounds(table, num_rows, dim)
        block = max(1, _BLOCK_VALUES // max(dim, 1))
        for start in range(0, len(ids), block):
            part = ids[start:start + block]
            if self.kind == "normal":
                radius = torch.sqrt(-2.0 * torch.log(_uniform01(part, dim, key, 1)))
                angle = (2.0 * math.pi) * _uniform01(part, dim, key, 2)
                values = self.a + self.b * radius * torch.cos(angle)
            else:
                values = low + (high - low) * (1.0 - _uniform01(part, dim, key, 1))
            out[start:start + block] = values.to(dtype)
        return out

    def _bounds(self, table: str, num_rows: int | None, dim: int) -> tuple[float, float]:
        if self.kind != "xavier_uniform":
            return self.a, self.b
        if num_rows is None:
            raise RowInitError(f"row initializer of table {table!r}: xavier_uniform needs the "
                             f"table's row count, and this table declares none (a dynamic "
                             f"table); use normal(std=...) or uniform(...) for it")
        bound = self.b * math.sqrt(6.0 / (num_rows + dim))
        return -bound, bound

    def _from_function(self, ids: torch.Tensor, dim: int, table: str,
                       dtype: torch.dtype) -> torch.Tensor:
        rows = self.row_fn(ids.clone())
        if not isinstance(rows, torch.Tensor) or tuple(rows.shape) != (len(ids), dim):
            shape = tuple(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__
            raise RowInitError(f"row initializer of table {table!r} returned {shape} for "
                             f"{len(ids)} ids; expected ({len(ids)}, {dim}): one row of "
                             f"{dim} values per id")
        return rows.detach().to(device="cpu", dtype=dtype)


def normal(std: float = 1.0, mean: float = 0.0, seed: int = 0) -> RowInit:
    """Rows drawn from N(mean, std^2) (torch.nn.Embedding's default is std=1)."""
    return RowInit("normal", seed=seed, a=mean, b=std)


def uniform(low: float = -1.0, high: float = 1.0, seed: int = 0) -> RowInit:
    """Rows drawn from U(low, high) (TorchRec's default: +-sqrt(1/num_rows))."""
    if not low < high:
        raise RowInitError(f"uniform(low={low}, high={high}): low must be below high")
    return RowInit("uniform", seed=seed, a=low, b=high)


def xavier_uniform(gain: float = 1.0, seed: int = 0) -> RowInit:
    """U(+-gain * sqrt(6 / (num_rows + dim))), torch.nn.init.xavier_uniform_'s scale."""
    return RowInit("xavier_uniform", seed=seed, b=gain)


def zeros() -> RowInit:
    return RowInit("zeros")


def row_function(function: Callable[[torch.Tensor], torch.Tensor]) -> RowInit:
    """The user's own rows: `function(ids)` -> [len(ids), dim], deterministic in the ids."""
    if not callable(function):
        raise RowInitError(f"row_function needs a callable ids -> rows, got "
                         f"{type(function).__name__}")
    return RowInit("function", row_fn=function)


def whole_table(init: RowInit, num_rows: int, dim: int, table: str,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Every row of a bounded table at once: what a test's unsplit reference starts from."""
    return init.rows(torch.arange(num_rows, dtype=torch.int64), dim, table,
                     num_rows=num_rows, dtype=dtype)
