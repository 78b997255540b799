"""Local implementations of strategies that an op cannot run unchanged.

Each takes the member's index and the group size first, then the op's own
arguments (with the member's local pieces); each process's executor calls it
in place of the op.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["vocab_embedding", "vocab_embedding_backward", "vocab_nll_loss",
           "vocab_nll_loss_backward", "Exchange", "VOCAB_LOG_SOFTMAX",
           "VOCAB_LOG_SOFTMAX_BACKWARD", "VOCAB_LOG_SOFTMAX_BACKWARD_AFTER_NLL", "AfterNllLoss",
           "local_ids", "log_softmax_summary", "log_softmax_finish"]

_aten = torch.ops.aten


def local_ids(ids: torch.Tensor, index: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids relative to this member's rows, and the mask of ids it does not hold."""
    local = ids - index * rows
    outside = (local < 0) | (local >= rows)
    return local.masked_fill(outside, 0), outside


def vocab_embedding(index: int, num: int, weight: torch.Tensor, ids: torch.Tensor,
                    padding_idx: int = -1, scale_grad_by_freq: bool = False,
                    sparse: bool = False) -> torch.Tensor:
    """Lookup in a table sharded by rows: the rows this member holds, zeros for
    the others, so the members' results add up to the whole lookup (P)."""
    local, outside = local_ids(ids, index, weight.shape[0])
    rows = _aten.embedding.default(weight, local)
    return rows.masked_fill(outside.unsqueeze(-1), 0)


def vocab_embedding_backward(index: int, num: int, grad: torch.Tensor, ids: torch.Tensor,
                             num_weights: int, padding_idx: int = -1,
                             scale_grad_by_freq: bool = False) -> torch.Tensor:
    """The gradient of this member's rows of a row-sharded table."""
    rows = num_weights // num
    local, outside = local_ids(ids, index, rows)
    start = index * rows
    local_padding = padding_idx - start if start <= padding_idx < start + rows else -1
    grad = grad.masked_fill(outside.unsqueeze(-1), 0)
    return _aten.embedding_dense_backward.default(grad, local, rows, local_padding,
                                                  scale_grad_by_freq)


# -- ops whose members exchange a small summary ------------------------------------

@dataclass(frozen=True)
class Exchange:
    """A strategy run in two steps: each member computes a small summary
    (`summarise(index, num, *args)`), every member receives every summary, and
    `finish(index, num, args, *summaries)` (summaries in rank order) gives the
    member's output. `summary_numel(in_shapes)` sizes a member's summary."""

    name: str
    summarise: Callable
    finish: Callable
    summary_numel: Callable[[list[tuple[int, ...]], int], int]  # (shapes, dim)
    dim_arg: int  # which argument of the op is the sharded (class) dimension

    @property
    def __name__(self) -> str:  # read by OpStrategy's text form
        return self.name

    def bytes(self, node, in_shapes: list[tuple[int, ...]], itemsize: int, num: int) -> int:
        """What the exchange sends per step, all members together."""
        dim = node.args[self.dim_arg] % len(in_shapes[0])
        return num * (num - 1) * self.summary_numel(in_shapes, dim) * itemsize + 1e-3


def _rows(shape: tuple[int, ...], dim: int) -> int:
    return math.prod(shape) // shape[dim]


def log_softmax_summary(index, num, x, dim, half_to_float=False):
    """This member's log-sum-exp of its classes, per row: one number per row."""
    top = x.amax(dim, keepdim=True)
    return top + (x - top).exp().sum(dim, keepdim=True).log()


def log_softmax_finish(index, num, args, *summaries):
    """The rows' log-sum-exp over every member's classes, from the members'
    own (the largest first, so no exponential overflows)."""
    x = args[0]
    top = summaries[0]
    for other in summaries[1:]:
        top = torch.maximum(top, other)
    top = top.masked_fill(top.isinf(), 0)  # rows of -inf everywhere stay -inf below
    total = None
    for summary in summaries:
        part = (summary - top).exp()
        total = part if total is None else total + part
    return x - (top + total.log())


def _log_softmax_backward_summary(index, num, grad, out, dim, dtype):
    return grad.sum(dim, keepdim=True)


def _log_softmax_backward_finish(index, num, args, *summaries):
    grad, out = args[0], args[1]
    total = summaries[0]
    for other in summaries[1:]:
        total = total + other
    return grad - out.exp() * total


# log-softmax over a sharded class dimension: each member sends its rows'
# log-sum-exp (one number per row, one message), every member forms the same
# log-sum-exp of the whole row from them.
VOCAB_LOG_SOFTMAX = Exchange(
    "vocab_log_softmax", log_softmax_summary, log_softmax_finish,
    lambda shapes, dim: _rows(shapes[0], dim), dim_arg=1)
VOCAB_LOG_SOFTMAX_BACKWARD = Exchange(
    "vocab_log_softmax_backward", _log_softmax_backward_summary,
    _log_softmax_backward_finish, lambda shapes, dim: _rows(shapes[0], dim), dim_arg=2)


def vocab_nll_loss(index: int, num: int, logp: torch.Tensor, target: torch.Tensor,
                   weight, reduction: int, ignore_index: int):
    """nll_loss over log-probabilities sharded by class: the classes this
    member holds contribute, so the members' losses add up to the loss (P);
    the count of counted targets is the same on every member (R)."""
    local, outside = local_ids(target, index, logp.shape[-1])
    counted = target != ignore_index
    picked = logp.gather(-1, local.unsqueeze(-1)).squeeze(-1)
    picked = picked.masked_fill(outside | ~counted, 0)
    total = counted.sum().to(logp.dtype)
    if reduction == 0:
        return -picked, total
    if reduction == 1:
        return -picked.sum() / total, total
    return -picked.sum(), total


def vocab_nll_loss_backward(index: int, num: int, grad: torch.Tensor, logp: torch.Tensor,
                            target: torch.Tensor, weight, reduction: int, ignore_index: int,
                            total_weight: torch.Tensor) -> torch.Tensor:
    local, outside = local_ids(target, index, logp.shape[-1])
    hit = ~(outside | (target == ignore_index))
    scale = grad / total_weight if reduction == 1 else grad
    values = (-scale * hit.to(logp.dtype)) if reduction == 0 else \
        -scale.expand(target.shape) * hit.to(logp.dtype)
    result = torch.zeros_like(logp)
    return result.scatter(-1, local.unsqueeze(-1), values.unsqueeze(-1))


class AfterNllLoss:
    """A log-softmax backward whose gradient comes from `nll_loss_backward`:
    the gradient's row sums are known on every member from the targets (minus
    the loss gradient over the count, where a target counts), so the class
    dimension stays sharded without an exchange. The op's own inputs come
    first; the nll backward's gradient, target and count are appended (all
    replicated)."""

    __name__ = "vocab_log_softmax_backward_after_nll"

    @staticmethod
    def nll_backward_of(node):
        """The nll_loss_backward (without class weights) whose gradient `node`
        differentiates, through same-shape views (`constrain`), or None."""
        grad = node.args[0]
        while getattr(grad, "target", None) in (_aten.view.default, _aten.alias.default) \
                and tuple(grad.meta["val"].shape) == tuple(grad.args[0].meta["val"].shape):
            grad = grad.args[0]
        if getattr(grad, "target", None) is _aten.nll_loss_backward.default \
                and grad.args[3] is None:
            return grad
        return None

    @staticmethod
    def extra_args(node) -> tuple:
        """(gradient of the loss, target, count, reduction, ignore_index) of the
        nll_loss_backward feeding `node`."""
        nll = AfterNllLoss.nll_backward_of(node)
        grad, _, target, _, reduction, ignore_index, total_weight = nll.args
        return grad, target, total_weight, reduction, ignore_index

    @staticmethod
    def __call__(index: int, num: int, grad: torch.Tensor, out: torch.Tensor, dim: int, dtype,
                 loss_grad: torch.Tensor, target: torch.Tensor, total_weight: torch.Tensor,
                 reduction: int, ignore_index: int) -> torch.Tensor:
        counted = (target != ignore_index).to(out.dtype)
        scale = loss_grad / total_weight if reduction == 1 else loss_grad
        row_sum = -(scale * counted)  # the row sums of `grad` over all members' classes
        return grad - out.exp() * row_sum.unsqueeze(dim)


VOCAB_LOG_SOFTMAX_BACKWARD_AFTER_NLL = AfterNllLoss()
