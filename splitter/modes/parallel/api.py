"""The user's side of parallel mode: `constrain`, `shard` and the parallel layers.

None of these shards anything by itself. Each leaves a placement on the values
it touches (a view of the value, annotated like `place()`'s regions, so the
annotation reaches the captured graph and the value's gradient); the mode
reads them as pins when it propagates. Models are built whole and sliced by
the mode, so initialisation equals the unsharded model's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.fx.traceback as fx_traceback
from torch import nn
from torch.nn import functional as F
from torch.nn.utils.stateless import _reparametrize_module

from .placement import Placement, ShardingError, is_placement_text, parse_placement
from .propagate import PLACEMENT_ANNOTATION

__all__ = [
    "constrain",
    "shard",
    "placement_text",
    "ParallelLinear",
    "ParallelEmbedding",
    "ParallelCrossEntropyLoss",
    "convert_parallel_linear",
]

_SHARD_ATTR = "_splitrun_shard"

Spec = Placement | str | tuple | list | None


def placement_text(spec: Placement | str | tuple | list) -> str:
    """The annotation text of a placement or strategy tuple.

    Tuples are checked for what a one-dimensional group can never run (two cut
    dimensions) here; whether a cut equals the group size is checked when the
    group is known.
    """
    if isinstance(spec, Placement):
        return str(spec)
    if isinstance(spec, str):
        if not is_placement_text(spec):
            parse_placement(spec)  # raises with the message
        return spec.strip()
    if isinstance(spec, (tuple, list)):
        cuts = list(spec)
        if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in cuts):
            raise ShardingError(f"strategy {tuple(spec)} must hold positive integers, one "
                                f"per dimension")
        if sum(1 for c in cuts if c > 1) > 1:
            raise ShardingError(
                f"strategy {tuple(spec)} cuts {sum(1 for c in cuts if c > 1)} dimensions; "
                f"parallel mode runs one-dimensional groups: cut one dimension by the "
                f"group size and leave the others at 1")
        return str(tuple(cuts))
    raise ShardingError(f"a placement must be 'R', 'P', 'S(d)', a Placement or a strategy "
                        f"tuple, got {type(spec).__name__}")


def constrain(x: torch.Tensor, placement: Placement | str | tuple) -> torch.Tensor:
    """Pin `x` (and its gradient) to `placement` inside a forward; returns a view."""
    text = placement_text(placement)
    with fx_traceback.annotate({PLACEMENT_ANNOTATION: text}):
        return x.view(x.shape)


def _constrain_all(values, specs: Sequence[Spec] | None, what: str):
    if specs is None:
        return values
    single = not isinstance(values, (tuple, list))
    items = [values] if single else list(values)
    tensors = [i for i, v in enumerate(items) if isinstance(v, torch.Tensor)]
    if len(specs) != len(tensors):
        raise ShardingError(
            f"{what} has {len(specs)} entries but the call has {len(tensors)} tensors; "
            f"give one entry (or None) per tensor")
    for index, spec in zip(tensors, specs):
        if spec is not None:
            items[index] = constrain(items[index], spec)
    return items[0] if single else type(values)(items)


def _check_specs(specs: Sequence[Spec] | None, what: str) -> None:
    if specs is None:
        return
    if not isinstance(specs, (tuple, list)):
        raise ShardingError(f"{what} must be a tuple with one entry per tensor, got "
                            f"{type(specs).__name__}")
    for spec in specs:
        if spec is not None:
            placement_text(spec)


def shard(target: nn.Module | Callable, in_strategy: Sequence[Spec] | None = None,
          out_strategy: Sequence[Spec] | None = None,
          parameter_plan: Mapping[str, Spec] | None = None) -> nn.Module | Callable:
    """Pin a module's or a function's inputs, outputs and parameters.

    Strategies are placements (`"S(1)"`, `"R"`) or MindSpore tuples (`(1, 4)`),
    one per tensor; None leaves that tensor to propagation. `parameter_plan`
    maps parameter names, relative to the module, to strategies. A module is
    marked in place (and returned); a function comes back wrapped.
    """
    _check_specs(in_strategy, "in_strategy")
    _check_specs(out_strategy, "out_strategy")
    if isinstance(target, nn.Module):
        plan = dict(parameter_plan or {})
        names = dict(target.named_parameters())
        for name, spec in plan.items():
            if name not in names:
                raise ShardingError(
                    f"parameter_plan names {name!r}, which is not a parameter of "
                    f"{type(target).__name__}; it has {', '.join(names) or 'none'}")
            placement_text(spec)
        previous = getattr(target, _SHARD_ATTR, None)
        if previous is not None:
            for handle in previous:
                handle.remove()
        handles = [target.register_forward_pre_hook(
                       _ShardHooks(in_strategy, plan).enter, with_kwargs=False),
                   target.register_forward_hook(_exit_hook(out_strategy))]
        setattr(target, _SHARD_ATTR, handles)
        return target
    if parameter_plan:
        raise ShardingError("parameter_plan applies to modules; a function has no parameters")
    if not callable(target):
        raise ShardingError(f"shard() takes an nn.Module or a function, got "
                            f"{type(target).__name__}")

    @functools.wraps(target)
    def sharded(*args, **kwargs):
        args = _constrain_all(tuple(args), in_strategy, "in_strategy")
        return _constrain_all(target(*args, **kwargs), out_strategy, "out_strategy")
    return sharded


class _ShardHooks:
    """Pre-hook: constrain the inputs and swap the planned parameters for
    constrained views of themselves until the forward returns."""

    def __init__(self, in_strategy, plan: dict[str, Spec]) -> None:
        self.in_strategy = in_strategy
        self.plan = plan

    def enter(self, module: nn.Module, args):
        if self.plan:
            swapped = {}
            for name, spec in self.plan.items():
                # During capture the parameters are traced tensors, not Parameters.
                value = functools.reduce(getattr, name.split("."), module)
                swapped[name] = constrain(value, spec)
            context = _reparametrize_module(module, swapped, strict=False)
            context.__enter__()
            module.__dict__.setdefault("_splitrun_open", []).append(context)
        if self.in_strategy is None:
            return None
        return _constrain_all(tuple(args), self.in_strategy, "in_strategy")


def _exit_hook(out_strategy):
    def hook(module: nn.Module, args, output):
        stack = module.__dict__.get("_splitrun_open")
        if stack:
            stack.pop().__exit__(None, None, None)
        if out_strategy is None:
            return None
        return _constrain_all(output, out_strategy, "out_strategy")
    return hook


# -- parallel layers (TorchShard's API) -------------------------------------------

class ParallelLinear(nn.Linear):
    """`nn.Linear` whose weight (torch's `[out, in]` layout) is sharded:
    `dim=-1` or `1`: column-parallel (output features split, output S(-1));
    `dim=0`: row-parallel (input features split, output summed);
    `dim=None`: replicated, an ordinary linear layer."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 dim: int | None = None, device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        if dim not in (None, 0, 1, -1):
            raise ShardingError(f"ParallelLinear dim must be None, 0 (row) or -1/1 (column), "
                                f"got {dim!r}")
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dim is None:
            return super().forward(x)
        if self.dim in (1, -1):  # column: output features split
            weight = constrain(self.weight, "S(0)")
            bias = None if self.bias is None else constrain(self.bias, "S(0)")
            return constrain(F.linear(x, weight, bias), "S(-1)")
        weight = constrain(self.weight, "S(1)")  # row: input features split
        return F.linear(constrain(x, "S(-1)"), weight, self.bias)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", dim={self.dim}"


class ParallelEmbedding(nn.Embedding):
    """`nn.Embedding` with its table sharded: `dim=1` (features, output S(-1))
    or `dim=0` (vocabulary rows)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *args, dim: int | None = None,
                 **kwargs) -> None:
        super().__init__(num_embeddings, embedding_dim, *args, **kwargs)
        if dim not in (None, 0, 1, -1):
            raise ShardingError(f"ParallelEmbedding dim must be None, 0 (vocabulary) or 1 "
                                f"(features), got {dim!r}")
        self.dim = dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.dim is None:
            return super().forward(ids)
        placement = "S(0)" if self.dim == 0 else "S(1)"
        weight = constrain(self.weight, placement)
        out = F.embedding(ids, weight, self.padding_idx, self.max_norm, self.norm_type,
                          self.scale_grad_by_freq, self.sparse)
        return constrain(out, "S(-1)") if self.dim != 0 else out


class ParallelCrossEntropyLoss(nn.CrossEntropyLoss):
    """Cross-entropy over logits whose classes stay sharded (`S(-1)`): each
    member sends its rows' max and sum of exponentials instead of its logits,
    and the loss is summed once, as a scalar. Class weights and label
    smoothing are not supported (use `nn.CrossEntropyLoss`)."""

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.weight is not None or self.label_smoothing:
            raise ShardingError("ParallelCrossEntropyLoss supports neither class weights nor "
                                "label smoothing; use nn.CrossEntropyLoss for those")
        log_probs = constrain(F.log_softmax(constrain(logits, "S(-1)"), dim=-1), "S(-1)")
        return F.nll_loss(log_probs, target, ignore_index=self.ignore_index,
                          reduction=self.reduction)


def convert_parallel_linear(module: nn.Module, dim: int | None = -1) -> nn.Module:
    """Turn every `nn.Linear` in `module` into a `ParallelLinear(dim=dim)` with
    the same weights (in place; returns `module`)."""
    if isinstance(module, nn.Linear) and not isinstance(module, ParallelLinear):
        return _as_parallel(module, dim)
    for name, child in module.named_children():
        setattr(module, name, convert_parallel_linear(child, dim))
    return module


def _as_parallel(linear: nn.Linear, dim: int | None) -> ParallelLinear:
    new = ParallelLinear(linear.in_features, linear.out_features, linear.bias is not None,
                         dim=dim, device=linear.weight.device, dtype=linear.weight.dtype)
    with torch.no_grad():
        new.weight.copy_(linear.weight)
        if linear.bias is not None:
            new.bias.copy_(linear.bias)
    return new
