"""Row-wise optimizer updates for sparse gradients (`nn.Embedding(sparse=True)`).

A sparse gradient is `(indices, values)`: row `indices[i]` of the table gets
`values[i]`, duplicates adding up. Each update first coalesces (sums the values
of duplicate rows), then touches only those rows, as torch does for sparse
gradients: SGD and Adagrad give the same result as their dense versions, Adam
is lazy (torch.optim.SparseAdam: moments of untouched rows do not decay).

They are graph nodes whose output shapes depend on data (`unique`), so they are
plain functions called by the executor rather than traced aten ops. Each
returns new tensors: in a plan the old table may still be on its way to a peer.
The in-place twins (`sparse_sgd_`, `sparse_adagrad_`, `sparse_adam_`) serve
the embedding cache and the servers' table shards, which send only copies of
their rows.

`padding_idx` (an embedding's padding row): that row is left alone, as torch
leaves it (it gets no gradient, so no update and, for Adam, no moment decay).
"""

from __future__ import annotations

import math

import torch

__all__ = ["coalesce", "sparse_sgd", "sparse_adagrad", "sparse_adam", "sparse_sgd_",
           "sparse_adagrad_", "sparse_adam_", "IN_PLACE", "ROW_WISE_UPDATES"]


def coalesce(indices: torch.Tensor, values: torch.Tensor,
             padding_idx: int | None = None, *, is_coalesced: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique rows (sorted, `padding_idx` left out) and the summed values of each.

    `is_coalesced`: the caller already summed each row's values (the indices
    are unique): they are returned as they are, `padding_idx` still left out."""
    if padding_idx is not None:
        keep = indices.reshape(-1) != padding_idx
        indices, values = indices.reshape(-1)[keep], values.reshape(-1, *values.shape[1:])[keep]
    if is_coalesced:
        return indices.reshape(-1), values.reshape(-1, *values.shape[1:])
    rows, inverse = torch.unique(indices.reshape(-1), sorted=True, return_inverse=True)
    summed = torch.zeros((rows.numel(), *values.shape[1:]), dtype=values.dtype,
                         device=values.device)
    summed.index_add_(0, inverse, values.reshape(-1, *values.shape[1:]))
    return rows, summed


def _like(scalar, tensor: torch.Tensor):
    """A float64 hyperparameter in the dtype of the rows it scales, so every
    update keeps the table's dtype."""
    if isinstance(scalar, torch.Tensor) and scalar.dtype != tensor.dtype:
        return scalar.to(tensor.dtype)
    return scalar


def _sgd_rows(indices, values, lr, maximize, padding_idx=None, is_coalesced=False):
    """(rows, their gradient, the factor to add it with: -lr). Adding with
    `alpha` rounds `row - lr * grad` once (a fused multiply-add), as FBGEMM's
    fused SGD does: the embedding cache's fused bags equal this bit for bit."""
    rows, grad = coalesce(indices, values, padding_idx, is_coalesced=is_coalesced)
    grad = -grad if maximize else grad
    return rows, grad, -float(lr)


def _adagrad_rows(indices, values, lr, step, state_sum, lr_decay, eps, maximize,
                  padding_idx=None, is_coalesced=False):
    """(rows, what to add to them, their new sums): the dense Adagrad's ops on
    the touched rows (untouched rows would not move)."""
    rows, grad = coalesce(indices, values, padding_idx, is_coalesced=is_coalesced)
    grad = -grad if maximize else grad
    clr = lr / (1 + (step - 1) * lr_decay)
    row_sum = torch.addcmul(state_sum.index_select(0, rows), grad, grad, value=1)
    std = row_sum.sqrt() + eps
    return rows, (_like(-clr, grad) * grad) / std, row_sum


def sparse_sgd(param, indices, values, lr, step, *, maximize: bool = False,
               padding_idx: int | None = None):
    rows, grad, alpha = _sgd_rows(indices, values, lr, maximize, padding_idx)
    return (param.index_add(0, rows, grad, alpha=alpha),)


def sparse_adagrad(param, indices, values, lr, step, state_sum, *, lr_decay: float = 0.0,
                   eps: float = 1e-10, maximize: bool = False, padding_idx: int | None = None):
    rows, delta, row_sum = _adagrad_rows(indices, values, lr, step, state_sum, lr_decay, eps,
                                         maximize, padding_idx)
    return param.index_add(0, rows, delta), state_sum.index_copy(0, rows, row_sum)


def sparse_sgd_(param, indices, values, lr, step, *, maximize: bool = False,
                padding_idx: int | None = None, is_coalesced: bool = False) -> None:
    """`sparse_sgd`, in place: for tables their owner does not send meanwhile.
    The in-place twins take `is_coalesced=True` for unique indices whose
    values are already summed per row (see `coalesce`)."""
    rows, grad, alpha = _sgd_rows(indices, values, lr, maximize, padding_idx, is_coalesced)
    param.index_add_(0, rows, grad, alpha=alpha)


def sparse_adagrad_(param, indices, values, lr, step, state_sum, *, lr_decay: float = 0.0,
                    eps: float = 1e-10, maximize: bool = False,
                    padding_idx: int | None = None, is_coalesced: bool = False) -> None:
    """`sparse_adagrad`, in place."""
    rows, delta, row_sum = _adagrad_rows(indices, values, lr, step, state_sum, lr_decay, eps,
                                         maximize, padding_idx, is_coalesced)
    param.index_add_(0, rows, delta)
    state_sum.index_copy_(0, rows, row_sum)


def _adam_rows(indices, values, lr, step, exp_avg, exp_avg_sq, betas, eps, maximize,
               padding_idx=None, is_coalesced=False):
    """(rows, what to add to them, their new moments): lazy Adam, as
    torch.optim.SparseAdam; the bias corrections use the global step count."""
    beta1, beta2 = betas
    rows, grad = coalesce(indices, values, padding_idx, is_coalesced=is_coalesced)
    grad = -grad if maximize else grad
    old_avg = exp_avg.index_select(0, rows)
    old_avg_sq = exp_avg_sq.index_select(0, rows)
    avg = old_avg + (grad - old_avg) * (1 - beta1)
    avg_sq = old_avg_sq + (grad.pow(2) - old_avg_sq) * (1 - beta2)
    step_value = float(step)
    bias_correction1 = 1 - beta1 ** step_value
    bias_correction2 = 1 - beta2 ** step_value
    step_size = float(lr) * math.sqrt(bias_correction2) / bias_correction1
    update = (avg / (avg_sq.sqrt() + eps)) * -step_size
    return rows, update, avg, avg_sq


def sparse_adam(param, indices, values, lr, step, exp_avg, exp_avg_sq, *,
                betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                maximize: bool = False, padding_idx: int | None = None):
    rows, update, avg, avg_sq = _adam_rows(indices, values, lr, step, exp_avg, exp_avg_sq,
                                           betas, eps, maximize, padding_idx)
    return (param.index_add(0, rows, update), exp_avg.index_copy(0, rows, avg),
            exp_avg_sq.index_copy(0, rows, avg_sq))


def sparse_adam_(param, indices, values, lr, step, exp_avg, exp_avg_sq, *,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 maximize: bool = False, padding_idx: int | None = None,
                 is_coalesced: bool = False) -> None:
    """`sparse_adam`, in place: the same ops on the same rows."""
    rows, update, avg, avg_sq = _adam_rows(indices, values, lr, step, exp_avg, exp_avg_sq,
                                           betas, eps, maximize, padding_idx, is_coalesced)
    param.index_add_(0, rows, update)
    exp_avg.index_copy_(0, rows, avg)
    exp_avg_sq.index_copy_(0, rows, avg_sq)


# The in-place twin of each functional update, for caches and table shards.
IN_PLACE = {"sgd": sparse_sgd_, "adagrad": sparse_adagrad_, "adam": sparse_adam_}


ROW_WISE_UPDATES = frozenset({sparse_sgd, sparse_adagrad, sparse_adam})
