"""Functional optimizers: updates written as pure tensor ops, so capture can trace
them into the step's graph as ordinary nodes labelled with the parameter's owner.

By default (`foreach=True`, and a `torch.optim` optimizer's `foreach=None`)
an update is one call of torch's multi-tensor kernels
(`ops.multi_tensor.foreach_update`), equal to `torch.optim.X(...,
foreach=True)` bit for bit, and on the CPU to torch's default single-tensor
loop too; the splitter groups those calls per process
(`splitting.update_groups`). With `foreach=False` each update mirrors the
single-tensor algorithm of its `torch.optim` namesake op for op (its `update`
here), so a captured step tracks eager PyTorch to rounding.
Learning rate and step count are graph inputs (float64 scalars, as
torch computes them in Python floats), so schedules change them without a
re-capture.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import CaptureError

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "Adagrad", "PerParameter", "from_torch"]

HPARAM_DTYPE = torch.float64


def _like(scalar, tensor: torch.Tensor):
    """A float64 hyperparameter in the dtype of the tensor it scales.

    A 0-dim float64 tensor times a tensor with dimensions computes in the
    latter's dtype, but times a 0-dim float32 parameter (a learnable
    temperature) it promotes to float64. Casting first keeps every update in
    the parameter's dtype, for every shape, with the same rounding: a CPU
    kernel casts a 0-dim operand to the result's dtype anyway.
    """
    if isinstance(scalar, torch.Tensor) and scalar.dtype != tensor.dtype:
        return scalar.to(tensor.dtype)
    return scalar


class Optimizer(ABC):
    """A functional optimizer. `lr` may be changed between steps (schedules)."""

    lr: float
    state_names: ClassVar[tuple[str, ...]] = ()

    def init_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: self.init_state_entry(param, name) for name in self.state_names}

    def init_state_entry(self, param: torch.Tensor, name: str) -> torch.Tensor:
        """One entry of `init_state(param)`, made alone: a process makes only
        the state it owns, one tensor at a time."""
        if type(self).init_state is not Optimizer.init_state:  # a subclass's own
            return self.init_state(param)[name]
        return torch.zeros_like(param)

    @abstractmethod
    def update(self, param: torch.Tensor, grad: torch.Tensor,
               state: dict[str, torch.Tensor], lr: torch.Tensor,
               step: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Return the new parameter and state. `step` counts from 1."""


@dataclass
class SGD(Optimizer):
    lr: float
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    maximize: bool = False
    foreach: bool = True

    def __post_init__(self) -> None:
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise CaptureError("SGD: nesterov needs momentum > 0 and dampening = 0")
        # An instance attribute: only SGD with momentum keeps state.
        self.state_names = ("momentum_buffer",) if self.momentum else ()

    def update(self, param, grad, state, lr, step):
        grad = -grad if self.maximize else grad
        if self.weight_decay:
            grad = torch.add(grad, param, alpha=self.weight_decay)
        new_state = {}
        if self.momentum:
            buf = state["momentum_buffer"]
            running = torch.add(buf * self.momentum, grad, alpha=1 - self.dampening)
            # torch starts the buffer as a copy of the first gradient.
            buf = running if self.dampening == 0 else torch.where(step == 1, grad, running)
            new_state["momentum_buffer"] = buf
            grad = torch.add(grad, buf, alpha=self.momentum) if self.nesterov else buf
        return param + _like(-lr, grad) * grad, new_state


@dataclass
class Adam(Optimizer):
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    maximize: bool = False
    foreach: bool = True
    state_names: ClassVar[tuple[str, ...]] = ("exp_avg", "exp_avg_sq")
    _decoupled: ClassVar[bool] = False

    def update(self, param, grad, state, lr, step):
        beta1, beta2 = self.betas
        grad = -grad if self.maximize else grad
        if self.weight_decay:
            if self._decoupled:
                param = param * _like(1 - lr * self.weight_decay, param)
            else:
                grad = torch.add(grad, param, alpha=self.weight_decay)
        exp_avg = torch.lerp(state["exp_avg"], grad, 1 - beta1)
        exp_avg_sq = torch.addcmul(state["exp_avg_sq"] * beta2, grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1 ** step
        bias_correction2 = 1 - beta2 ** step
        step_size = lr / bias_correction1
        denom = exp_avg_sq.sqrt() / _like(bias_correction2.sqrt(), exp_avg_sq) + self.eps
        new_param = param + (_like(-step_size, exp_avg) * exp_avg) / denom
        return new_param, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


@dataclass
class AdamW(Adam):
    weight_decay: float = 1e-2
    _decoupled: ClassVar[bool] = True


@dataclass
class Adagrad(Optimizer):
    lr: float = 1e-2
    lr_decay: float = 0.0
    weight_decay: float = 0.0
    initial_accumulator_value: float = 0.0
    eps: float = 1e-10
    maximize: bool = False
    foreach: bool = True
    state_names: ClassVar[tuple[str, ...]] = ("sum",)

    def init_state_entry(self, param, name):
        return torch.full_like(param, self.initial_accumulator_value)

    def update(self, param, grad, state, lr, step):
        grad = -grad if self.maximize else grad
        if self.weight_decay:
            grad = torch.add(grad, param, alpha=self.weight_decay)
        clr = lr / (1 + (step - 1) * self.lr_decay)
        state_sum = torch.addcmul(state["sum"], grad, grad, value=1)
        std = state_sum.sqrt() + self.eps
        return param + (_like(-clr, grad) * grad) / std, {"sum": state_sum}


class PerParameter:
    """Several optimizers in one step, each over its own parameters: the
    tables with one, the dense layers with another, or each table its own.
    Each part is a functional optimizer paired with its parameters (an
    iterable of them, or a module: its parameters), or a `torch.optim`
    optimizer (its param groups, their learning rates read live).

        optim.PerParameter((optim.Adagrad(lr=0.1), rec.tables),
                           torch.optim.Adam(model.over_arch.parameters(), lr=1e-3))

    A parameter no part holds is not trained; one in two parts is refused."""

    def __init__(self, *parts) -> None:
        if not parts:
            raise CaptureError("PerParameter needs at least one optimizer")
        self.parts = tuple((p[0], list(p[1].parameters() if hasattr(p[1], "parameters")
                                       else p[1])) if isinstance(p, tuple) and len(p) == 2
                           else p for p in parts)


_UNSUPPORTED_FLAGS = ("amsgrad", "capturable", "differentiable", "fused")


def from_torch(optimizer: torch.optim.Optimizer) -> list[tuple[Optimizer, list[torch.Tensor]]]:
    """Translate a `torch.optim` optimizer into one functional optimizer per
    param group, paired with the group's parameters."""
    kind = type(optimizer)
    groups = []
    for index, group in enumerate(optimizer.param_groups):
        for flag in _UNSUPPORTED_FLAGS:
            if group.get(flag):
                raise CaptureError(
                    f"{kind.__name__} param group {index} sets {flag}=True, which "
                    f"splitrun's functional {kind.__name__} does not implement; "
                    f"turn it off")
        # foreach=True and None (torch's default): torch's multi-tensor
        # kernels, the same bits as torch's default on the CPU and on a GPU;
        # False: the single-tensor chain.
        foreach = group.get("foreach") is not False
        if kind is torch.optim.SGD:
            functional = SGD(lr=group["lr"], momentum=group["momentum"],
                             dampening=group["dampening"],
                             weight_decay=group["weight_decay"],
                             nesterov=group["nesterov"], maximize=group["maximize"],
                             foreach=foreach)
        elif kind in (torch.optim.Adam, torch.optim.AdamW):
            cls = AdamW if kind is torch.optim.AdamW else Adam
            functional = cls(lr=group["lr"], betas=tuple(group["betas"]), eps=group["eps"],
                             weight_decay=group["weight_decay"], maximize=group["maximize"],
                             foreach=foreach)
        elif kind is torch.optim.Adagrad:
            functional = Adagrad(lr=group["lr"], lr_decay=group["lr_decay"],
                                 weight_decay=group["weight_decay"],
                                 initial_accumulator_value=group["initial_accumulator_value"],
                                 eps=group["eps"], maximize=group["maximize"],
                                 foreach=foreach)
        else:
            raise CaptureError(
                f"optimizer {kind.__name__} has no functional version in splitrun; "
                f"use SGD, Adam, AdamW or Adagrad (torch.optim or splitrun.splitter.optim)")
        groups.append((functional, list(group["params"])))
    return groups
