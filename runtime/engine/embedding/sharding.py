"""Which server holds each row of a cached table, and at which local index.

Ids are first hashed by an affine bijection of [0, V) (hot ids, often the
small ones, spread over all servers instead of piling onto the first), then
the hash space is cut into S contiguous slices, one per server.
"""

from __future__ import annotations

import math

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
        # ids < 2^31 and a < 2^31: the product fits in int64.
        return (ids.to(torch.int64) * self._a + self._b) % self.num_rows

    def server_of(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.bucketize(self.hashed(ids), self._inner_bounds, right=True)

    def local_index(self, ids: torch.Tensor, server: int) -> torch.Tensor:
        return self.hashed(ids) - self.bounds[server]

    def shard_size(self, server: int) -> int:
        return self.bounds[server + 1] - self.bounds[server]

    def ids_of(self, server: int) -> torch.Tensor:
        """The ids server `server` holds, in local-index order."""
        hashed = torch.arange(self.bounds[server], self.bounds[server + 1], dtype=torch.int64)
        return ((hashed - self._b) % self.num_rows * self._a_inverse) % self.num_rows
