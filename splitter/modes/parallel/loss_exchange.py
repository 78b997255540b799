"""The vocabulary-parallel loss in one exchange.

Cross-entropy over class-sharded logits is `_log_softmax` (an `Exchange`:
each member sends its rows' log-sum-exp) then `nll_loss_forward`, whose
class-sharded form gives a partial sum that one more collective turns whole.
The loss needs nothing the exchange does not already carry but each member's
sum of its target logits, one number: sent along with the log-sum-exps, the
loss comes out whole on every member,

    loss = (sum over counted rows of log-sum-exp - sum of the target logits) / count,

and the all-reduce of the partial loss is gone (the same bytes, one collective
fewer). `fuse_loss_exchange` applies it to a chosen layout; `log_softmax_of`
is the pattern, also read by propagation, which charges that loss's P -> R
no collective of its own.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
from torch import fx

from .local_ops import (
    VOCAB_LOG_SOFTMAX,
    Exchange,
    local_ids,
    log_softmax_finish,
    log_softmax_summary,
    vocab_nll_loss,
)
from .placement import R

__all__ = ["log_softmax_of", "nll_of", "fuse_loss_exchange", "VOCAB_LOG_SOFTMAX_WITH_LOSS",
           "LossFromExchange", "VOCAB_NLL_LOSS_FROM_EXCHANGE"]

_aten = torch.ops.aten
_MEAN, _SUM = 1, 2  # nll_loss's reduction codes


def _through_views(node: fx.Node) -> fx.Node:
    """`node`'s source through same-shape views (`constrain` leaves those)."""
    while getattr(node, "target", None) in (_aten.view.default, _aten.alias.default) \
            and tuple(node.meta["val"].shape) == tuple(node.args[0].meta["val"].shape):
        node = node.args[0]
    return node


def log_softmax_of(nll: fx.Node) -> fx.Node | None:
    """The `_log_softmax` (over the last of 2 dimensions) whose output `nll`,
    an `nll_loss_forward` without class weights reducing by mean or sum,
    reads; None when `nll` is not such a loss, or when its target is computed
    after the log-softmax (the exchange could not carry it)."""
    if nll.target is not _aten.nll_loss_forward.default:
        return None
    logp, target, weight, reduction = nll.args[:4]
    if weight is not None or reduction not in (_MEAN, _SUM):
        return None
    source = _through_views(logp)
    if source.target is not _aten._log_softmax.default:
        return None
    shape = tuple(source.meta["val"].shape)
    if len(shape) != 2 or source.args[1] % 2 != 1:
        return None
    order = {node: i for i, node in enumerate(source.graph.nodes)}
    return source if order[target] < order[source] else None


def nll_of(log_softmax: fx.Node) -> fx.Node | None:
    """The loss `log_softmax_of` pairs with `log_softmax`, or None."""
    stack = list(log_softmax.users)
    while stack:
        user = stack.pop()
        if user.target in (_aten.view.default, _aten.alias.default):
            stack.extend(user.users)
        elif log_softmax_of(user) is log_softmax:
            return user
    return None


def _summary(index, num, x, dim, half_to_float, target, ignore_index):
    """This member's log-sum-exp per row, then the sum of the target logits it
    holds (rows whose target counts): one tensor of rows + 1 numbers."""
    lse = log_softmax_summary(index, num, x, dim, half_to_float)
    local, outside = local_ids(target, index, x.shape[-1])
    picked = x.gather(-1, local.unsqueeze(-1)).squeeze(-1)
    picked = picked.masked_fill(outside | (target == ignore_index), 0)
    return torch.cat([lse.reshape(-1), picked.sum().reshape(1)])


def _unstacked(summaries: tuple) -> tuple:
    """The members' summaries; the torch.distributed backend gathers them as
    one stacked [members, rows + 1] tensor."""
    if len(summaries) == 1 and summaries[0].dim() == 2:
        return tuple(summaries[0].unbind(0))
    return summaries


def _finish(index, num, args, *summaries):
    rows = summaries[0].numel() - 1
    return log_softmax_finish(index, num, args, *[s[:rows].reshape(rows, 1) for s in summaries])


VOCAB_LOG_SOFTMAX_WITH_LOSS = Exchange(
    "vocab_log_softmax_with_loss", _summary, _finish,
    lambda shapes, dim: shapes[0][0] + 1, dim_arg=1)


class LossFromExchange:
    """`nll_loss_forward` whose log-probabilities came from
    `VOCAB_LOG_SOFTMAX_WITH_LOSS`: the whole loss (R) on every member from the
    exchange's summaries, appended to the op's own arguments by the rewrite."""

    __name__ = "vocab_nll_loss_from_exchange"

    @staticmethod
    def __call__(index: int, num: int, logp: torch.Tensor, target: torch.Tensor, weight,
                 reduction: int, ignore_index: int, *summaries: torch.Tensor):
        summaries = _unstacked(summaries)
        rows = summaries[0].numel() - 1
        parts = [s[:rows] for s in summaries]
        top = parts[0]
        for other in parts[1:]:
            top = torch.maximum(top, other)
        top = top.masked_fill(top.isinf(), 0)
        total = None
        for part in parts:
            term = (part - top).exp()
            total = term if total is None else total + term
        lse = top + total.log()
        picked = summaries[0][rows]
        for other in summaries[1:]:
            picked = picked + other[rows]
        counted = target != ignore_index
        count = counted.sum().to(logp.dtype)
        loss = lse.masked_fill(~counted, 0).sum() - picked
        return (loss / count if reduction == _MEAN else loss), count


VOCAB_NLL_LOSS_FROM_EXCHANGE = LossFromExchange()


def fuse_loss_exchange(graph: fx.Graph, strategies: dict) -> dict:
    """`strategies` (node name -> OpStrategy) with every vocabulary-parallel
    loss that chose the two-collective form (`VOCAB_LOG_SOFTMAX` then
    `vocab_nll_loss`) in the one-exchange form; its loss comes out R."""
    fused = dict(strategies)
    for nll in graph.find_nodes(op="call_function", target=_aten.nll_loss_forward.default):
        source = log_softmax_of(nll)
        strategy = strategies.get(nll.name)
        if source is None or strategy is None or strategy.local is not vocab_nll_loss or \
                strategies[source.name].local is not VOCAB_LOG_SOFTMAX:
            continue
        fused[source.name] = dataclasses.replace(strategies[source.name],
                                                 local=VOCAB_LOG_SOFTMAX_WITH_LOSS)
        fused[nll.name] = dataclasses.replace(strategy, outputs=(R, R),
                                              local=VOCAB_NLL_LOSS_FROM_EXCHANGE)
        for user in nll.users:
            if user.target is operator.getitem and user.args[1] == 0:
                fused[user.name] = dataclasses.replace(strategies[user.name], outputs=(R,))
    return fused
