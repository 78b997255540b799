"""Which row-wise update (`ops/sparse_updates.py`) trains a sparse embedding
under a functional optimizer, with what settings; capture calls it for each
parameter whose gradient is sparse."""

from __future__ import annotations

from ..errors import CaptureError
from ..ops.sparse_updates import sparse_adagrad, sparse_adam, sparse_sgd
from . import optim

__all__ = ["sparse_update_for"]


def sparse_update_for(functional) -> tuple[callable, dict]:
    """The row-wise update matching a functional optimizer, and its settings."""
    name = type(functional).__name__
    if type(functional) is optim.SGD:
        if functional.momentum or functional.weight_decay:
            raise CaptureError(
                "SGD with momentum or weight decay cannot update a sparse embedding row by "
                "row; use sparse=False for that embedding, or plain SGD")
        return sparse_sgd, {"maximize": functional.maximize}
    if type(functional) is optim.Adagrad:
        if functional.weight_decay:
            raise CaptureError("Adagrad with weight decay does not support sparse gradients "
                               "(nor does torch); set weight_decay=0 or sparse=False")
        return sparse_adagrad, {"lr_decay": functional.lr_decay, "eps": functional.eps,
                                "maximize": functional.maximize}
    if type(functional) is optim.Adam:
        if functional.weight_decay:
            raise CaptureError("Adam on sparse gradients is lazy (SparseAdam) and has no "
                               "weight decay; set weight_decay=0 or sparse=False")
        return sparse_adam, {"betas": tuple(functional.betas), "eps": functional.eps,
                             "maximize": functional.maximize}
    raise CaptureError(f"{name} has no row-wise update for sparse gradients; use SGD, "
                       f"Adagrad or Adam, or sparse=False")
