"""Optimizer updates as torch's multi-tensor kernels: one call per group of
parameters with the same optimizer and settings on one process.

`foreach_update` is the node capture appends for a parameter whose
optimizer asks for `foreach=True` (one parameter per node), and the node the
splitter's `group_updates` pass makes of all such nodes of one process that
run between the same two messages (many parameters per node). It calls
torch's own functional optimizers (`torch.optim.sgd.sgd`,
`torch.optim.adam.adam`, `torch.optim.adagrad.adagrad`) with `foreach=True`,
the very code `torch.optim.X(..., foreach=True).step()` runs, so the result
equals torch's bit for bit. On the CPU torch's `_foreach_*` ops loop over
the tensors with the single-tensor kernels, on a GPU they run fused kernels
that compute each element alone: either way a parameter's result does not
depend on which others share its call, so grouping changes no bit.

In place inside a graph: the parameters and the optimizer state are cloned
first and torch's update runs in place on the clones, so the node returns
new tensors (the old ones may still be on their way to a peer, as with the
row-wise updates). Gradients are read, never written (torch negates or
decays a copy).

Arguments, flat so a plan can name every value: `num_params` parameters,
their gradients, then each state slot's tensors (state-major: every
parameter's `exp_avg`, then every `exp_avg_sq`), then the learning rate and
the step count (0-dim float64 graph inputs; the step counts from 1). Returns
the new parameters, then the new state in the same order.
"""

from __future__ import annotations

import torch
from torch.optim.adagrad import adagrad
from torch.optim.adam import adam
from torch.optim.sgd import sgd

__all__ = ["foreach_update", "STATE_NAMES", "MULTI_TENSOR_UPDATES"]

# Per optimizer, the state it keeps per parameter (SGD: only with momentum).
STATE_NAMES = {"SGD": ("momentum_buffer",), "Adam": ("exp_avg", "exp_avg_sq"),
               "AdamW": ("exp_avg", "exp_avg_sq"), "Adagrad": ("sum",)}


def _state_names(optimizer: str, settings: dict) -> tuple[str, ...]:
    if optimizer == "SGD" and not settings.get("momentum"):
        return ()
    return STATE_NAMES[optimizer]


def _step_counts(step: float, num: int, device) -> list[torch.Tensor]:
    """torch's per-parameter step counts (float32 tensors) as they are before
    the update, which adds one."""
    return [torch.tensor(step - 1.0, dtype=torch.float32, device=device) for _ in range(num)]


def foreach_update(*tensors: torch.Tensor, optimizer: str, num_params: int,
                   **settings) -> tuple[torch.Tensor, ...]:
    """One multi-tensor update of `num_params` parameters (see the module)."""
    n = num_params
    names = _state_names(optimizer, settings)
    if len(tensors) != n * (2 + len(names)) + 2:
        raise ValueError(f"foreach_update({optimizer}) of {n} parameters takes "
                         f"{n * (2 + len(names)) + 2} tensors, got {len(tensors)}")
    params = [t.clone() for t in tensors[:n]]
    grads = list(tensors[n:2 * n])
    states = [[t.clone() for t in tensors[2 * n + j * n:2 * n + (j + 1) * n]]
              for j in range(len(names))]
    lr, step = float(tensors[-2]), float(tensors[-1])
    device = params[0].device if params else None
    if optimizer == "SGD":
        buffers = states[0] if names else [None] * n
        if names and step == 1:
            buffers = [None] * n  # torch starts each buffer as a copy of the gradient
        sgd(params, grads, buffers, foreach=True, lr=lr, momentum=settings["momentum"],
            dampening=settings["dampening"], weight_decay=settings["weight_decay"],
            nesterov=settings["nesterov"], maximize=settings["maximize"])
        states = [buffers] if names else []
    elif optimizer in ("Adam", "AdamW"):
        beta1, beta2 = settings["betas"]
        adam(params, grads, states[0], states[1], [], _step_counts(step, n, device),
             foreach=True, decoupled_weight_decay=optimizer == "AdamW", amsgrad=False,
             beta1=beta1, beta2=beta2, lr=lr, weight_decay=settings["weight_decay"],
             eps=settings["eps"], maximize=settings["maximize"])
    elif optimizer == "Adagrad":
        adagrad(params, grads, states[0], _step_counts(step, n, device), foreach=True,
                lr=lr, weight_decay=settings["weight_decay"], lr_decay=settings["lr_decay"],
                eps=settings["eps"], maximize=settings["maximize"])
    else:
        raise ValueError(f"foreach_update: no multi-tensor {optimizer}; "
                         f"use SGD, Adam, AdamW or Adagrad")
    return (*params, *[t for slot in states for t in slot])


MULTI_TENSOR_UPDATES = frozenset({foreach_update})
