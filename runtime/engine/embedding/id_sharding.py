"""Which server owns each id of a dynamic table: splitmix64's finaliser of
the id, mod the number of servers. Ids are any int64, so the bounded tables'
affine bijection of [0, V) (sharding.py) does not apply; the mix spreads
consecutive and clustered ids (hashed ones, or small ones) evenly.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["IdSharding", "mix64"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX_1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX_2 = np.uint64(0x94D049BB133111EB)


def mix64(ids: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser of int64 `ids`, as uint64 (wrapping arithmetic)."""
    x = ids.astype(np.int64, copy=False).view(np.uint64) + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _MIX_1
    x = (x ^ (x >> np.uint64(27))) * _MIX_2
    return x ^ (x >> np.uint64(31))


class IdSharding:
    def __init__(self, num_servers: int) -> None:
        if num_servers < 1:
            raise ValueError(f"IdSharding needs at least one server, got {num_servers}")
        self.num_servers = num_servers

    def server_of(self, ids: np.ndarray) -> np.ndarray:
        if self.num_servers == 1:
            return np.zeros(ids.size, dtype=np.int64)
        return (mix64(ids) % np.uint64(self.num_servers)).astype(np.int64)

    def positions_by_server(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """For each server in rank order, the positions in `ids` (flat, CPU)
        of the ids it owns, ascending (as `RowSharding.positions_by_server`)."""
        flat = ids.reshape(-1).numpy()
        if self.num_servers == 1:
            return [torch.arange(flat.size)]
        owner = self.server_of(flat)
        return [torch.from_numpy(np.flatnonzero(owner == server))
                for server in range(self.num_servers)]

    def split_by_server(self, ids: np.ndarray, *aligned: np.ndarray) -> list[list[np.ndarray]]:
        """`ids` and arrays aligned with them cut into each server's part, in
        rank order (per server: [its ids, *their aligned values], in the order
        of `ids`)."""
        arrays = (ids, *aligned)
        if self.num_servers == 1:
            return [list(arrays)]
        owner = self.server_of(ids)
        return [[a.compress(owner == server) for a in arrays]
                for server in range(self.num_servers)]
