"""TorchRec's and FBGEMM's ways of naming a table's optimizer, read as
splitrun's functional optimizers where the arithmetic is the same.

- `from_fused_params({"optimizer": EmbOptimType.EXACT_ADAGRAD,
  "learning_rate": 0.1})`: the `fused_params` a TorchRec sharder takes.
  EXACT_SGD (and SGD, the same sum of each row's gradients, which FBGEMM adds
  in another order on a GPU) is `optim.SGD`; EXACT_ADAGRAD is `optim.Adagrad`
  (FBGEMM's element-wise Adagrad: one accumulator per element, `w -= lr * g /
  (sqrt(sum) + eps)` on the rows looked up, FBGEMM's default eps 1e-8).
- an optimizer attached by `apply_optimizer_in_backward` (torchrec.optim's,
  or torch's `_apply_optimizer_in_backward`): torch's SGD, Adagrad, Adam and
  AdamW as `optim.from_torch` reads them; TorchRec's placeholders `SGD` and
  `Adagrad` as their EmbOptimType.

Refused in one line each: FBGEMM's ADAM (it adds eps after the bias
correction, `m_hat / (sqrt(v_hat) + eps)`, where the row-wise Adam of sparse
tables here is torch's SparseAdam, `m / (sqrt(v) + eps)` scaled), and
row-wise Adagrad (EXACT_ROWWISE_ADAGRAD, `torchrec.optim.RowWiseAdagrad`: one
accumulator per row), which splitrun does not have yet.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..errors import CaptureError
from . import optim

__all__ = ["from_fused_params", "in_backward_optimizer", "refuse_unknown_optimizer"]

# FBGEMM's defaults (SplitTableBatchedEmbeddingBagsCodegen).
_FBGEMM_LR = 0.01
_FBGEMM_EPS = 1e-8

_ROW_WISE_ADAGRAD = (
    "row-wise Adagrad (one accumulator per row, FBGEMM's EXACT_ROWWISE_ADAGRAD, "
    "torchrec.optim.RowWiseAdagrad) is not available in splitrun yet; train the table "
    "with element-wise Adagrad (EmbOptimType.EXACT_ADAGRAD, torch.optim.Adagrad or "
    "splitrun.splitter.optim.Adagrad: one accumulator per element) or SGD")
_ADAM = (
    "FBGEMM's ADAM adds eps after the bias correction (m_hat / (sqrt(v_hat) + eps)), while "
    "a sparse table's row-wise Adam here is torch's SparseAdam (m / (sqrt(v) + eps), then "
    "scaled): not the same update; use torch.optim.Adam / optim.Adam for SparseAdam's, or "
    "EXACT_ADAGRAD or EXACT_SGD")
# The fused_params keys an optimizer reads; any other key is refused.
_FUSED_KEYS = ("optimizer", "learning_rate", "lr", "eps", "weight_decay", "weight_decay_mode")


def from_fused_params(fused_params: Mapping[str, object]) -> optim.Optimizer:
    """The functional optimizer of a TorchRec sharder's `fused_params`
    (`{"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1}`); see the
    module docstring for which optimizers and settings are taken."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    params = dict(fused_params)
    kind = params.get("optimizer")
    if not isinstance(kind, EmbOptimType):
        raise CaptureError(f"fused_params['optimizer'] must be an fbgemm_gpu EmbOptimType "
                           f"(EmbOptimType.EXACT_SGD, ...), got {kind!r}")
    for key in params:
        if key not in _FUSED_KEYS:
            raise CaptureError(f"fused_params key {key!r} is not one splitrun's {kind.name} "
                               f"reads (it takes {', '.join(_FUSED_KEYS[1:])}); leave it out")
    lr = float(params.get("learning_rate", params.get("lr", _FBGEMM_LR)))
    decay, mode = params.get("weight_decay", 0.0), params.get("weight_decay_mode")
    if decay or (mode is not None and int(mode) != 0):
        raise CaptureError(f"fused_params of {kind.name} set weight decay (weight_decay="
                           f"{decay}, weight_decay_mode={mode}); a table's row-wise update "
                           f"here has none: leave them out")
    if kind in (EmbOptimType.EXACT_SGD, EmbOptimType.SGD):
        if "eps" in params:
            raise CaptureError(f"fused_params of {kind.name} set eps, which SGD has not")
        return optim.SGD(lr=lr)
    if kind is EmbOptimType.EXACT_ADAGRAD:
        return optim.Adagrad(lr=lr, eps=float(params.get("eps", _FBGEMM_EPS)))
    if kind in (EmbOptimType.EXACT_ROWWISE_ADAGRAD, EmbOptimType.ROWWISE_ADAGRAD):
        raise CaptureError(f"EmbOptimType.{kind.name}: {_ROW_WISE_ADAGRAD}")
    if kind is EmbOptimType.ADAM:
        raise CaptureError(f"EmbOptimType.ADAM: {_ADAM}")
    raise CaptureError(f"EmbOptimType.{kind.name} has no functional version in splitrun; "
                       f"tables take EXACT_SGD (or SGD) and EXACT_ADAGRAD")


def _is_torchrec(value) -> bool:
    kind = value if isinstance(value, type) else type(value)
    return kind.__module__.split(".")[0] == "torchrec"


def refuse_unknown_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Refuse, naming it, a TorchRec optimizer capture cannot read (the rest
    go to `optim.from_torch`)."""
    if not _is_torchrec(optimizer):
        return
    name = type(optimizer).__name__
    if name == "RowWiseAdagrad":
        raise CaptureError(f"torchrec.optim.RowWiseAdagrad: {_ROW_WISE_ADAGRAD}")
    if name in ("KeyedOptimizerWrapper", "CombinedOptimizer", "KeyedOptimizer",
                "OptimizerWrapper"):
        raise CaptureError(
            f"torchrec.optim.{name} is refused: pass the torch.optim optimizers it wraps "
            f"(several at once as optim.PerParameter(torch_optimizer, ...)); tables "
            f"trained by apply_optimizer_in_backward are read from their parameters")
    raise CaptureError(f"torchrec.optim.{name} has no functional version in splitrun; use "
                       f"SGD, Adam, AdamW or Adagrad (torch.optim or "
                       f"splitrun.splitter.optim), or optim.from_fused_params")


def in_backward_optimizer(name: str, param: torch.Tensor
                          ) -> tuple[optim.Optimizer, tuple] | None:
    """The optimizer `apply_optimizer_in_backward` attached to `param`, as a
    functional optimizer and a key that equal settings share; None if none."""
    # torch's _apply_optimizer_in_backward keeps them in these attributes,
    # which TorchRec's sharders read as well.
    classes = getattr(param, "_optimizer_classes", None)
    if not classes:
        return None
    kwargs_list = getattr(param, "_optimizer_kwargs", None) or [{}]
    if len(classes) > 1:
        raise CaptureError(f"parameter {name!r} has {len(classes)} optimizers applied in "
                           f"backward ({', '.join(c.__name__ for c in classes)}); give it one")
    kind, kwargs = classes[0], dict(kwargs_list[0])
    key = (kind, tuple(sorted((k, repr(v)) for k, v in kwargs.items())))
    where = f"parameter {name!r}'s in-backward optimizer {kind.__name__}"
    if _is_torchrec(kind):
        if kind.__name__ == "RowWiseAdagrad":
            raise CaptureError(f"{where}: {_ROW_WISE_ADAGRAD}")
        from fbgemm_gpu.split_embedding_configs import EmbOptimType

        fused = {"SGD": EmbOptimType.EXACT_SGD, "Adagrad": EmbOptimType.EXACT_ADAGRAD,
                 "Adam": EmbOptimType.ADAM}.get(kind.__name__)
        if fused is None:
            raise CaptureError(f"{where} has no functional version in splitrun; use SGD or "
                               f"Adagrad")
        try:
            return from_fused_params({"optimizer": fused, **kwargs}), key
        except CaptureError as exc:
            raise CaptureError(f"{where}: {exc}") from None
    if not (isinstance(kind, type) and issubclass(kind, torch.optim.Optimizer)):
        raise CaptureError(f"{where} is not a torch.optim optimizer")
    # The optimizer torch made for the parameter: its settings with defaults.
    made = getattr(param, "_in_backward_optimizers", None)
    instance = made[0] if made else kind([torch.nn.Parameter(torch.empty(0))], **kwargs)
    try:
        (functional, _), = optim.from_torch(instance)
    except CaptureError as exc:
        raise CaptureError(f"{where}: {exc}") from None
    return functional, key
