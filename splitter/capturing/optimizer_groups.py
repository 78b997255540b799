"""Which functional optimizer updates which parameter: capture's reading of
the optimizer it is given.

- one functional optimizer (`splitter.optim`): every trainable parameter;
- a `torch.optim` optimizer: one functional optimizer per param group, its
  learning rates read live every step (LR schedulers keep working);
- `optim.PerParameter(...)`: several of those at once, each over its own
  parameters (the tables with one optimizer, the dense layers with another,
  or each table its own), a parameter in two of them refused;
- and, over any of these, an optimizer TorchRec's (torch's)
  `apply_optimizer_in_backward` attached to a parameter, which that
  parameter trains with, as in eager PyTorch (the hook steps it and clears
  its gradient, so the other optimizer skips it); TorchRec's and FBGEMM's
  spellings are read by `torchrec_optim`.

A parameter no optimizer holds is not trained, as in PyTorch.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import CaptureError
from ..program import ParamGroup
from . import optim
from .torchrec_optim import in_backward_optimizer, refuse_unknown_optimizer

__all__ = ["OptimizerGroups", "optimizer_groups"]


class OptimizerGroups:
    """Which functional optimizer updates which parameter, and the lr feeds."""

    def __init__(self) -> None:
        self.functional: list[optim.Optimizer] = []
        self.param_group: dict[str, int] = {}
        # Per group, the torch optimizer and its group index whose lr is read
        # live each step; None: the functional optimizer's own lr.
        self.lr_sources: list[tuple[torch.optim.Optimizer, int] | None] = []

    def add(self, functional: optim.Optimizer, names: list[str],
            lr_source: tuple[torch.optim.Optimizer, int] | None = None) -> None:
        index = len(self.functional)
        self.functional.append(functional)
        self.lr_sources.append(lr_source)
        for name in names:
            self.param_group[name] = index

    def for_param(self, name: str) -> optim.Optimizer | None:
        index = self.param_group.get(name)
        return None if index is None else self.functional[index]

    @staticmethod
    def lr_key(index: int) -> str:
        return "lr" if index == 0 else f"lr.{index}"

    def describe(self, trainable: list[str]) -> tuple[ParamGroup, ...]:
        """Each param group's optimizer, settings and parameters (in the order
        of `trainable`), for checkpoints in torch's optimizer format."""
        return tuple(
            ParamGroup(type(functional).__name__, tuple(functional.state_names),
                       tuple(n for n in trainable if self.param_group.get(n) == index),
                       {k: v for k, v in vars(functional).items()
                        if not k.startswith("_") and k != "state_names"})
            for index, functional in enumerate(self.functional))

    def hparams(self, step: int) -> dict[str, torch.Tensor]:
        feeds = {}
        for source in self.lr_sources:
            if source is not None:
                # The update runs in the graph, so the torch optimizer's step()
                # is never called; tell its LR scheduler that steps do happen.
                source[0]._opt_called = True
        for index, (functional, source) in enumerate(zip(self.functional, self.lr_sources)):
            lr = functional.lr if source is None else source[0].param_groups[source[1]]["lr"]
            feeds[self.lr_key(index)] = torch.tensor(float(lr), dtype=optim.HPARAM_DTYPE)
        feeds["step"] = torch.tensor(float(step + 1), dtype=optim.HPARAM_DTYPE)
        return feeds


def optimizer_groups(optimizer, params: dict[str, nn.Parameter]) -> OptimizerGroups:
    """The groups of `optimizer` (see the module docstring) over `params`."""
    groups = OptimizerGroups()
    if optimizer is None:
        return groups
    parts = optimizer.parts if isinstance(optimizer, optim.PerParameter) else (optimizer,)
    name_of = {id(p): name for name, p in params.items()}
    owner: dict[str, str] = {}  # parameter -> which part holds it, for messages
    for number, part in enumerate(parts):
        where = (f"optim.PerParameter part {number}"
                 if isinstance(optimizer, optim.PerParameter) else None)
        for functional, members, lr_source in _part_groups(part, params, where):
            names = []
            for p in members:
                name = name_of.get(id(p))
                what = where or type(part).__name__
                if name is None and isinstance(part, torch.optim.Optimizer):
                    raise CaptureError(f"{what} param group {lr_source[1]} holds a tensor of "
                                       f"shape {tuple(p.shape)} that is not a parameter of "
                                       f"the model")
                if name is None:
                    raise CaptureError(f"{what} holds a tensor of shape {tuple(p.shape)} that "
                                       f"is not a parameter of the model")
                if name in owner:
                    raise CaptureError(f"parameter {name!r} is in two optimizers ({owner[name]} "
                                       f"and {what}); give each parameter one")
                owner[name] = what
                names.append(name)
            groups.add(functional, names, lr_source)
    _apply_in_backward(groups, params)
    return groups


def _part_groups(part, params: dict[str, nn.Parameter], where: str | None):
    """(functional optimizer, its parameters, its live lr source) of one part."""
    if isinstance(part, optim.Optimizer):
        if where is not None:
            raise CaptureError(f"{where} is a bare {type(part).__name__}; pair a functional "
                               f"optimizer with its parameters: (optimizer, params)")
        return [(part, [p for p in params.values() if p.requires_grad], None)]
    if isinstance(part, tuple) and len(part) == 2 and isinstance(part[0], optim.Optimizer):
        functional, members = part
        members = members.parameters() if isinstance(members, nn.Module) else members
        return [(functional, [p for p in members if p.requires_grad], None)]
    if isinstance(part, torch.optim.Optimizer):
        refuse_unknown_optimizer(part)
        return [(functional, list(group_params), (part, index))
                for index, (functional, group_params) in enumerate(optim.from_torch(part))]
    raise CaptureError(
        f"{where or 'optimizer'} must be a torch.optim optimizer, one of "
        f"splitrun.splitter.optim's{', or an (optimizer, params) pair' if where else ''}, "
        f"got {type(part).__name__}")


def _apply_in_backward(groups: OptimizerGroups, params: dict[str, nn.Parameter]) -> None:
    """Parameters with an optimizer attached by `apply_optimizer_in_backward`
    train with it (one group per optimizer and settings), not with the
    optimizer capture was given."""
    before = set(groups.param_group.values())
    added: dict[tuple, int] = {}
    for name, param in params.items():
        marked = in_backward_optimizer(name, param)
        if marked is None:
            continue
        functional, key = marked
        if key not in added:
            groups.add(functional, [])
            added[key] = len(groups.functional) - 1
        groups.param_group[name] = added[key]
    # Groups the marks emptied would still feed an lr; drop them.
    emptied = before - set(groups.param_group.values())
    if emptied:
        used = [i for i in range(len(groups.functional)) if i not in emptied]
        renumber = {old: new for new, old in enumerate(used)}
        groups.functional = [groups.functional[i] for i in used]
        groups.lr_sources = [groups.lr_sources[i] for i in used]
        groups.param_group = {n: renumber[i] for n, i in groups.param_group.items()}
