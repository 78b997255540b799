"""Which server holds each row of a cached table, and at which local index.

Ids are first hashed by an affine bijection of [0, V) (hot ids, often the
small ones, spread over all servers instead of piling onto the first), then
the hash space is cut into S contiguous slices, one per server.

The hash runs on numpy views of the ids (int64 CPU tensors, as every caller
has them): a step's few thousand ids per table and server cost ~3x less
than through torch's ops and dispatch (the worker splits every table's
write-backs and pulls by server each step, each server maps them to its rows).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ...errors import CacheError

__all__ = ["RowSharding"]

# A large odd constant (2^64 / golden ratio, truncated): consecutive ids land
# far apart in the hash space.
_MULTIPLIER = 0x9E3779B97F4A7C15
_OFFSET = 0x5851F42D


class RowSharding:
    def __init__(self, num_rows: int, num_servers: int) -> None:
        if num_rows >= 1 << 31:
            raise CacheError(f"tables up to 2^31 rows are supported, got {num_rows}; split the "
                             f"table into several")
        self.num_rows = num_rows
        self.num_servers = num_servers
        multiplier = _MULTIPLIER % num_rows or 1
        while math.gcd(multiplier, num_rows) != 1:
            multiplier += 1
        self._a = multiplier
        self._b = _OFFSET % num_rows
        self._a_inverse = pow(multiplier, -1, num_rows) if num_rows > 1 else 0
        self.bounds = [server * num_rows // num_servers for server in range(num_servers + 1)]
        self._inner_bounds = torch.tensor(self.bounds[1:-1], dtype=torch.int64)

    def hashed(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.device.type != "cpu":
            # ids < 2^31 and a < 2^31: the product fits in int64.
            return (ids.to(torch.int64) * self._a + self._b) % self.num_rows
        return torch.from_numpy(self._hashed(ids))

    def _hashed(self, ids: torch.Tensor) -> np.ndarray:
        """The hash of CPU `ids`, a new int64 array (computed in place in it)."""
        flat = ids if ids.dtype == torch.int64 and ids.dim() == 1 else ids.reshape(-1).to(
            torch.int64)
        return self._hashed_array(flat.numpy()).reshape(ids.shape)

    def _hashed_array(self, ids: np.ndarray) -> np.ndarray:
        """The hash of int64 `ids` (flat), a new array (computed in place in it)."""
        hashed = ids * self._a
        hashed += self._b
        hashed %= self.num_rows
        return hashed

    def server_of(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.bucketize(self.hashed(ids), self._inner_bounds, right=True)

    def positions_by_server(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """For each server in rank order, the positions in `ids` (flat, CPU)
        of the ids it holds, ascending."""
        if self.num_servers == 1:
            return [torch.arange(ids.numel())]
        hashed = self._hashed(ids.reshape(-1))
        if self.num_servers == 2:
            second = hashed >= self.bounds[1]
            return [torch.from_numpy(np.flatnonzero(~second)),
                    torch.from_numpy(np.flatnonzero(second))]
        owner = np.searchsorted(self._inner_bounds.numpy(), hashed, side="right")
        order = np.argsort(owner, kind="stable")  # by server, ascending within each
        ends = np.cumsum(np.bincount(owner, minlength=self.num_servers))
        return [torch.from_numpy(part) for part in np.split(order, ends[:-1])]

    def split_by_server(self, ids: np.ndarray, *aligned: np.ndarray) -> list[list[np.ndarray]]:
        """`ids` (flat, int64) and arrays `aligned` with them, each cut into
        the parts each server holds, in rank order: per server, [its ids,
        *their aligned values], in the order of `ids` (numpy arrays: a
        step's parts cost a few microseconds each, not a torch call's ten)."""
        arrays = (ids, *aligned)
        if self.num_servers == 1:
            return [list(arrays)]
        hashed = self._hashed_array(ids)
        if self.num_servers == 2:
            second = hashed >= self.bounds[1]
            first = ~second
            return [[a.compress(first) for a in arrays], [a.compress(second) for a in arrays]]
        owner = np.searchsorted(self._inner_bounds.numpy(), hashed, side="right")
        order = np.argsort(owner, kind="stable")
        ends = np.cumsum(np.bincount(owner, minlength=self.num_servers))
        return [[a.take(part) for a in arrays] for part in np.split(order, ends[:-1])]

    def local_index(self, ids: torch.Tensor, server: int) -> torch.Tensor:
        if ids.device.type != "cpu":
            return self.hashed(ids) - self.bounds[server]
        return torch.from_numpy(self.local_rows(ids, server))

    def local_rows(self, ids: torch.Tensor, server: int, offset: int = 0) -> np.ndarray:
        """`local_index` of CPU `ids` plus `offset` (where the shard starts in
        a buffer it shares), as a new int64 array: a server's copies index
        with it."""
        local = self._hashed(ids)
        local += offset - self.bounds[server]
        return local

    def shard_size(self, server: int) -> int:
        return self.bounds[server + 1] - self.bounds[server]

    def ids_at(self, server: int, local: np.ndarray) -> torch.Tensor:
        """The ids of server `server`'s local rows `local` (int64): the
        inverse of `local_rows`."""
        hashed = local + self.bounds[server]
        hashed -= self._b
        hashed %= self.num_rows
        hashed *= self._a_inverse
        hashed %= self.num_rows
        return torch.from_numpy(hashed)

    def ids_of(self, server: int) -> torch.Tensor:
        """The ids server `server` holds, in local-index order."""
        hashed = torch.arange(self.bounds[server], self.bounds[server + 1], dtype=torch.int64)
        return ((hashed - self._b) % self.num_rows * self._a_inverse) % self.num_rows
