"""Optimizer updates as torch's multi-tensor kernels: one call per group of
parameters with the same optimizer and settings on one process.

`foreach_update` is the node capture appends for each parameter whose
optimizer runs multi-tensor (one parameter per node), and the node the
splitter's `group_updates` pass makes of all such nodes of one process that
run between the same two messages (many parameters per node).

It runs the same `torch._foreach_*` kernels, in the same order and with the
same Python-float scalars, as torch's own multi-tensor algorithms
(`torch.optim.adam._multi_tensor_adam` and its SGD and Adagrad namesakes), so
the result equals `torch.optim.X(..., foreach=True).step()` bit for bit. On
the CPU a `_foreach_*` op loops over its tensors with the very kernels the
single-tensor algorithm (`foreach=False`, torch's CPU default) calls, with the
same scalars, so on the CPU it equals that too. On a GPU the kernels are fused
and compute each element alone. Either way a parameter's result does not
depend on which others share its call, so grouping changes no bit.

Out of place, unlike torch's: every result is a new tensor and no input is
written (the old parameters may still be on their way to a peer, and the
gradients may be views of a received message); no clone is made first, and
torch's Python wrappers (argument checks, grouping by device and dtype) are
not run each step.

Arguments, flat so a plan can name every value: `num_params` parameters,
their gradients, then each state slot's tensors (state-major: every
parameter's `exp_avg`, then every `exp_avg_sq`), then the learning rate and
the step count (0-dim float64 graph inputs; the step counts from 1). Returns
the new parameters, then the new state in the same order.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

__all__ = ["foreach_update", "STATE_NAMES", "MULTI_TENSOR_UPDATES"]


# Per optimizer, the state it keeps per parameter (SGD: only with momentum).
STATE_NAMES = {"SGD": ("momentum_buffer",), "Adam": ("exp_avg", "exp_avg_sq"),
               "AdamW": ("exp_avg", "exp_avg_sq"), "Adagrad": ("sum",)}


def _state_names(optimizer: str, settings: dict) -> tuple[str, ...]:
    if optimizer == "SGD" and not settings.get("momentum"):
        return ()
    return STATE_NAMES[optimizer]


def _sgd(params, grads, states, lr, step, *, momentum, dampening, weight_decay,
         nesterov, maximize):
    # torch.optim.sgd._multi_tensor_sgd, out of place.
    if maximize:
        grads = torch._foreach_neg(grads)
    if weight_decay != 0:
        grads = torch._foreach_add(grads, params, alpha=weight_decay)
    new_states = []
    if momentum != 0:
        if step == 1:  # torch starts each buffer as a copy of the gradient
            buffers = [g.detach().clone() for g in grads]
        else:
            buffers = torch._foreach_add(torch._foreach_mul(states[0], momentum), grads,
                                         alpha=1 - dampening)
        grads = torch._foreach_add(grads, buffers, alpha=momentum) if nesterov else buffers
        new_states = [buffers]
    return torch._foreach_add(params, grads, alpha=-lr), new_states


def _adam(params, grads, states, lr, step, *, betas, eps, weight_decay, maximize,
          decoupled):
    # torch.optim.adam._multi_tensor_adam (not capturable, no amsgrad), out of place.
    beta1, beta2 = betas
    if maximize:
        grads = torch._foreach_neg(grads)
    if weight_decay != 0:
        if decoupled:
            params = torch._foreach_mul(params, 1 - lr * weight_decay)
        else:
            grads = torch._foreach_add(grads, params, alpha=weight_decay)
    exp_avgs = torch._foreach_lerp(states[0], grads, 1 - beta1)
    exp_avg_sqs = torch._foreach_mul(states[1], beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    step_size = (lr / (1 - beta1 ** step)) * -1
    bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
    denominators = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denominators, bias_correction2_sqrt)
    torch._foreach_add_(denominators, eps)
    return torch._foreach_addcdiv(params, exp_avgs, denominators, step_size), [exp_avgs,
                                                                               exp_avg_sqs]


def _adagrad(params, grads, states, lr, step, *, lr_decay, weight_decay, eps, maximize,
             initial_accumulator_value=0.0):
    # torch.optim.adagrad._multi_tensor_adagrad (dense gradients), out of place.
    if maximize:
        grads = torch._foreach_neg(grads)
    if weight_decay != 0:
        grads = torch._foreach_add(grads, params, alpha=weight_decay)
    minus_clr = -lr / (1 + (step - 1) * lr_decay)
    sums = torch._foreach_addcmul(states[0], grads, grads, value=1)
    std = torch._foreach_sqrt(sums)
    torch._foreach_add_(std, eps)
    numerators = torch._foreach_mul(grads, minus_clr)
    return torch._foreach_addcdiv(params, numerators, std), [sums]


_ALGORITHMS = {"SGD": _sgd, "Adam": _adam, "AdamW": _adam, "Adagrad": _adagrad}


def foreach_update(*tensors: torch.Tensor, optimizer: str, num_params: int,
                   **settings) -> tuple[torch.Tensor, ...]:
    """One multi-tensor update of `num_params` parameters (see the module)."""
    algorithm = _ALGORITHMS.get(optimizer)
    if algorithm is None:
        raise ValueError(f"foreach_update: no multi-tensor {optimizer}; "
                         f"use SGD, Adam, AdamW or Adagrad")
    n = num_params
    names = _state_names(optimizer, settings)
    if len(tensors) != n * (2 + len(names)) + 2:
        raise ValueError(f"foreach_update({optimizer}) of {n} parameters takes "
                         f"{n * (2 + len(names)) + 2} tensors, got {len(tensors)}")
    params, grads = list(tensors[:n]), list(tensors[n:2 * n])
    states = [list(tensors[2 * n + j * n:2 * n + (j + 1) * n]) for j in range(len(names))]
    if tensors[0].is_meta or is_fake(tensors[0]):
        # Shapes only (a pass propagating fake or meta values, all of a call's
        # alike): the step's scalars have no values to read.
        return tuple(torch.empty_like(t) for t in (*params, *[t for s in states for t in s]))
    lr, step = float(tensors[-2]), float(tensors[-1])
    if optimizer in ("Adam", "AdamW"):
        settings = {**settings, "decoupled": optimizer == "AdamW"}
    new_params, new_states = algorithm(params, grads, states, lr, step, **settings)
    return (*new_params, *[t for slot in new_states for t in slot])


MULTI_TENSOR_UPDATES = frozenset({foreach_update})
