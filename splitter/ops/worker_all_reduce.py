"""The marker of the workers' average of dense gradients (parameter-server
and embedding-cache modes with `dense="worker"`): one `all_reduce_mean` node
per step on every worker, which the runtime binds to an all-reduce on a
`torch.distributed` group of all the workers
(`runtime/engine/worker_all_reduce.py`)."""

from __future__ import annotations

import torch

from ..errors import PlanError

__all__ = ["all_reduce_mean"]


def all_reduce_mean(grads: list[torch.Tensor], *, num_workers: int) -> tuple[torch.Tensor, ...]:
    """Every worker's `grads`, averaged over the `num_workers` workers (bound
    by the runtime to an all-reduce among them)."""
    raise PlanError(f"all_reduce_mean of {len(grads)} gradients ran without a group of "
                    f"{num_workers} workers; run the program through splitrun's runtime")
