"""Capture a training step (forward, backward, optimizer update) as one fx graph.

Seen working on torch 2.13: `aot_export_joint_simple(fn, args, trace_joint=True)`
inside `torch.fx.traceback.preserve_node_meta()` returns one joint graph, and the
annotations of a `torch.fx.traceback.annotate` region reach the backward ops
too. So each module's forward runs inside such a region naming its module path
and, when placed, its label. The optimizer update of every parameter is then
traced from `splitter.optim` and appended as ordinary nodes labelled with the
parameter's owner.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import re
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from functools import partial

import torch
import torch.fx.traceback as fx_traceback
from torch import fx, nn
from torch._functorch.aot_autograd import aot_export_joint_simple
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.nn.utils.stateless import _reparametrize_module

from ..errors import CaptureError
from ..initial_state import Deferred, InitialState
from ..labels import LABEL_ANNOTATION, MODULE_ANNOTATION, placement_of
from ..ops.bags import bag_gradient
from ..ops.multi_tensor import MULTI_TENSOR_UPDATES, foreach_update
from ..ops.sparse_updates import ROW_WISE_UPDATES
from ..program import (
    InputKind,
    InputSpec,
    OutputKind,
    OutputSpec,
    Program,
    node_annotation,
    set_node_annotation,
)
from . import optim
from .bags import bags_as_lookups, coalesce_bag_gradients, drop_unused_bag_backwards
from .cache_marks import cache_settings_of
from .optimizer_groups import OptimizerGroups, optimizer_groups
from .row_wise import sparse_update_for

__all__ = ["capture", "LossFn"]

logger = logging.getLogger(__name__)

# loss_fn(model, *batch) -> scalar loss tensor
LossFn = Callable[..., torch.Tensor]

_aten = torch.ops.aten


def capture(model: nn.Module, loss_fn: LossFn,
            optimizer: optim.Optimizer | torch.optim.Optimizer | optim.PerParameter | None,
            example_batch: torch.Tensor | Sequence[torch.Tensor], *,
            return_grads: bool = False) -> Program:
    """Capture `loss_fn(model, *batch)`, its backward and the optimizer update.

    `optimizer` is a functional optimizer from `splitrun.splitter.optim` (used
    for every trainable parameter) or a `torch.optim` optimizer (translated per
    param group; its learning rates are read every step, so torch LR schedulers
    keep working), or `optim.PerParameter(...)`, several of those over their
    own parameters; an optimizer `apply_optimizer_in_backward` attached to a
    parameter trains that parameter (`optimizer_groups`). With `return_grads`,
    gradients are outputs too (for tests and debugging; they then stay alive
    to the end of the step).
    """
    batch = _flatten_batch(example_batch)
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    _reject_uncapturable_modules(model)
    groups = optimizer_groups(optimizer, params)
    trainable = [name for name, p in params.items()
                 if p.requires_grad and (optimizer is None or name in groups.param_group)]
    frozen = {name: p for name, p in params.items() if name not in set(trainable)}
    frozen.update(buffers)
    owners = _state_owners(model)

    cached = _cached_tables(model)
    # Cached tables are captured as sparse embeddings: lookup forward,
    # (indices, values) gradients, a row-wise update.
    with _attribute_set(cached.values(), "sparse", True):
        padding = _sparse_padding(model)
        with _attribute_set(_padded_sparse_embeddings(model), "padding_idx", None), \
                bags_as_lookups(model):
            joint = _trace_joint(model, loss_fn, trainable, params, frozen, batch)
    builder = _StepBuilder(joint, trainable, list(frozen), len(batch), owners, padding)
    builder.add_inputs(groups if optimizer is not None else None)
    builder.copy_joint()
    if optimizer is not None:
        builder.append_updates(groups, params)
    program_inputs, program_outputs = builder.finish(return_grads)

    gm = fx.GraphModule(torch.nn.Module(), builder.graph, class_name="CapturedStep")
    _propagate_fake_values(gm, builder.example_inputs(params, frozen, batch, groups, cached))

    # Nothing is copied here: each process makes the state it owns when it
    # takes it (`InitialState`). A cached table is never copied: it may be
    # larger than a worker's memory, and only the servers keep (copies of)
    # its rows. The model must not change after capture.
    initial_state = InitialState()
    for name in trainable:
        value = params[name].detach()
        initial_state[name] = value if name in cached else Deferred(value, torch.clone)
        functional = groups.for_param(name)
        if functional is None:
            continue
        if name in cached:
            for state_name, state in row_state_of(functional, value).items():
                initial_state[f"{name}.{state_name}"] = state
            continue
        for state_name in functional.state_names:
            initial_state[f"{name}.{state_name}"] = Deferred(
                value, partial(functional.init_state_entry, name=state_name),
                reads_values=False)
    for name, tensor in frozen.items():
        initial_state[name] = Deferred(tensor.detach(), torch.clone)
    # The gradient of every trainable parameter: modes that move the update
    # elsewhere (parameter server) find it through these.
    return Program(gm, program_inputs, program_outputs, initial_state,
                   hparams_fn=groups.hparams if optimizer is not None else None,
                   grads={name: node.name for name, node in builder.grads.items()
                          if name not in builder.sparse_grads},
                   sparse_grads={name: (i.name, v.name)
                                 for name, (i, v) in builder.sparse_grads.items()},
                   param_groups=groups.describe(trainable),
                   cached_tables={key: cache_settings_of(module)
                                  for key, module in cached.items()},
                   non_persistent_buffers=_non_persistent_buffers(model, buffers),
                   batch_input=getattr(loss_fn, "batch_input", None),
                   recapture=lambda rows: capture(model, loss_fn, optimizer,
                                                  [b[:rows] for b in batch],
                                                  return_grads=return_grads))


# -- inputs -----------------------------------------------------------------

def _flatten_batch(example_batch) -> list[torch.Tensor]:
    batch = [example_batch] if isinstance(example_batch, torch.Tensor) else list(example_batch)
    for index, item in enumerate(batch):
        if not isinstance(item, torch.Tensor):
            raise CaptureError(
                f"example_batch item {index} is a {type(item).__name__}; the batch must "
                f"be a tensor or a sequence of tensors (flatten dicts and nested "
                f"structures before capture)")
    return batch


def _non_persistent_buffers(model: nn.Module, buffers: dict[str, torch.Tensor]
                            ) -> frozenset[str]:
    """The buffers `model.state_dict()` leaves out (`persistent=False`, as
    TorchRec DLRM's `triu_indices`): checkpoints leave them out too."""
    persistent = model.state_dict(keep_vars=True)
    return frozenset(name for name in buffers if name not in persistent)


def _reject_uncapturable_modules(model: nn.Module) -> None:
    for path, module in model.named_modules():
        where = f"{path or type(model).__name__!r} ({type(module).__name__})"
        if (isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training
                and module.track_running_stats):
            raise CaptureError(
                f"module {where} updates its running statistics in place during "
                f"training; splitrun captures pure steps: use LayerNorm or GroupNorm, "
                f"BatchNorm with track_running_stats=False, or put the module in eval mode")
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
            _reject_uncapturable_embedding(module, where)


def _reject_uncapturable_embedding(module: nn.Embedding | nn.EmbeddingBag, where: str) -> None:
    if module.max_norm is not None:
        raise CaptureError(
            f"module {where} has max_norm={module.max_norm}: it renormalizes the rows it "
            f"looks up in place during the forward, which a pure captured step cannot do; "
            f"drop max_norm (clip the rows' norms in the loss, or after training)")
    sparse = module.sparse or cache_settings_of(module) is not None
    if isinstance(module, nn.EmbeddingBag) and sparse:
        if module.mode == "max":
            raise CaptureError(
                f"module {where} has mode='max' and a sparse gradient; sparse (and cached) "
                f"EmbeddingBags support modes 'sum' and 'mean': use one of them or sparse=False")
        if module.scale_grad_by_freq:
            raise CaptureError(
                f"module {where} has scale_grad_by_freq=True and a sparse gradient, which "
                f"splitrun does not support; set scale_grad_by_freq=False or sparse=False")


def _state_owners(model: nn.Module) -> dict[str, str]:
    """Placement of each placed parameter or buffer: its own, else that of the
    innermost placed module that registers it."""
    owners: dict[str, str] = {}
    seen: set[int] = set()

    def visit(module: nn.Module, prefix: str, inherited: str | None) -> None:
        label = placement_of(module) or inherited
        for name, tensor in [*module.named_parameters(recurse=False),
                             *module.named_buffers(recurse=False)]:
            if tensor is None or id(tensor) in seen:
                continue  # a tied tensor keeps the owner of its first registration
            seen.add(id(tensor))
            owner = placement_of(tensor) or label
            if owner is not None:
                owners[prefix + name] = owner
        for child_name, child in module.named_children():
            visit(child, f"{prefix}{child_name}.", label)

    visit(model, "", None)
    return owners


def row_state_of(functional, table: torch.Tensor) -> dict[str, torch.Tensor]:
    """A cached table's starting optimizer state without its memory: the
    state of its first row broadcast over every row (an expanded view of one
    row: a table of any size costs one row here; the servers copy or make
    their own rows of it). Whole where the optimizer's state differs between
    rows."""
    if table.dim() == 0:
        return functional.init_state(table)
    # A table on `meta` (its rows made by the servers) holds no values: rows
    # of zeros stand for them (the optimizers start a row's state alike).
    first = functional.init_state(table[:2] if table.device.type != "meta" else torch.zeros(
        (min(table.shape[0], 2), *table.shape[1:]), dtype=table.dtype))
    if table.shape[0] < 2:
        return first
    if not all(torch.equal(value[0], value[1]) for value in first.values()):
        return functional.init_state(table)
    return {name: value[:1].expand(table.shape) for name, value in first.items()}


def _cached_tables(model: nn.Module) -> dict[str, nn.Embedding | nn.EmbeddingBag]:
    """The tables `place_embedding_cache` marked, by parameter name."""
    return {f"{path}.weight" if path else "weight": module
            for path, module in model.named_modules()
            if isinstance(module, (nn.Embedding, nn.EmbeddingBag))
            and cache_settings_of(module) is not None}


def _sparse_padding(model: nn.Module) -> dict[str, int]:
    """The `padding_idx` of every sparse (or cached) embedding and embedding
    bag, by parameter name: their row-wise updates leave that row alone."""
    return {f"{path}.weight" if path else "weight": module.padding_idx
            for path, module in model.named_modules()
            if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse
            and module.padding_idx is not None}


def _padded_sparse_embeddings(model: nn.Module) -> list[nn.Embedding]:
    """The sparse `nn.Embedding`s with a `padding_idx`, traced without it: it
    changes only the backward (the padding row gets no gradient), and torch's
    sparse backward drops those rows with a data-dependent shape that one
    static graph cannot hold. The row-wise update skips the row instead (see
    `_sparse_padding`), so only a returned gradient (`return_grads`) still
    holds values for it. (Sparse bags mask their padding ids themselves:
    `ops/bags.py`.)"""
    return [module for module in model.modules()
            if isinstance(module, nn.Embedding) and module.sparse
            and module.padding_idx is not None]


@contextlib.contextmanager
def _attribute_set(modules, name: str, value):
    """`name` set to `value` on each of `modules` while tracing; each one's own
    value is put back after, whatever happens."""
    saved = [(module, getattr(module, name)) for module in modules]
    try:
        for module, _ in saved:
            setattr(module, name, value)
        yield
    finally:
        for module, own in saved:
            setattr(module, name, own)


# -- tracing ------------------------------------------------------------------

class _ModuleRegions:
    """Forward hooks that run each module inside an annotate region naming its
    path and, when placed, its label. Regions left open by an exception are
    closed by `close()`."""

    def __init__(self, model: nn.Module) -> None:
        self._open: list[AbstractContextManager] = []
        self._handles = []
        self.kind_of: dict[str, str] = {}  # module path -> class name, for errors
        for path, module in model.named_modules():
            annotation = {MODULE_ANNOTATION: path or type(model).__name__}
            self.kind_of[annotation[MODULE_ANNOTATION]] = type(module).__name__
            label = placement_of(module)
            if label is not None:
                annotation[LABEL_ANNOTATION] = label
            self._handles.append(module.register_forward_pre_hook(self._enter(annotation)))
            self._handles.append(module.register_forward_hook(self._exit))

    def _enter(self, annotation):
        def hook(module, args):
            region = fx_traceback.annotate(annotation)
            region.__enter__()
            self._open.append(region)
        return hook

    def _exit(self, module, args, output):
        self._open.pop().__exit__(None, None, None)

    def close(self) -> None:
        while self._open:
            self._open.pop().__exit__(None, None, None)
        for handle in self._handles:
            handle.remove()


def _trace_joint(model, loss_fn, trainable, params, frozen, batch) -> fx.GraphModule:
    num_trainable, num_frozen = len(trainable), len(frozen)
    frozen_names = list(frozen)
    failure_site: dict[str, str] = {}

    def step_fn(*flat):
        state = dict(zip(trainable, flat[:num_trainable]))
        state.update(zip(frozen_names, flat[num_trainable:num_trainable + num_frozen]))
        regions = _ModuleRegions(model)
        try:
            with _reparametrize_module(model, state):
                loss = loss_fn(model, *flat[num_trainable + num_frozen:])
        except BaseException:
            path = (fx_traceback.current_meta.get("custom") or {}).get(
                MODULE_ANNOTATION, type(model).__name__)
            kind = regions.kind_of.get(path, type(model).__name__)
            failure_site["where"] = f"module {path!r}" + ("" if path == kind else f" ({kind})")
            raise
        finally:
            regions.close()
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise CaptureError(
                f"loss_fn must return a scalar tensor, got {type(loss).__name__}"
                f"{list(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
        return (loss,)

    # Tracing reads no value. The parameters' stand-ins are left unwritten
    # (their pages never touched): a model larger than memory costs none. A
    # table on `meta` (its rows made by the servers) is traced on the CPU.
    args = [_stand_in(params[n]).requires_grad_(True) for n in trainable]
    args += [t.detach() for t in frozen.values()]
    args += [b.detach() for b in batch]
    try:
        with fx_traceback.preserve_node_meta():
            return aot_export_joint_simple(step_fn, args, trace_joint=True)
    except CaptureError:
        raise
    except Exception as exc:
        where = failure_site.get("where", f"module {type(model).__name__!r}")
        raise _capture_error(exc, where) from exc


def _stand_in(param: torch.Tensor) -> torch.Tensor:
    """An unwritten tensor like `param`, on the CPU where `param` is on `meta`."""
    device = torch.device("cpu") if param.device.type == "meta" else param.device
    return torch.empty(tuple(param.shape), dtype=param.dtype, device=device)


def _capture_error(exc: Exception, where: str) -> CaptureError:
    """A torch tracing failure as a message naming the module and the op."""
    if isinstance(exc, DataDependentOutputException):
        return CaptureError(
            f"{where} calls {exc.func}, which needs a tensor's value while tracing "
            f"(.item(), bool(), or a Python `if` on a tensor): data-dependent control "
            f"flow cannot be captured into one graph; compute both branches and pick "
            f"with torch.where, or decide outside the step")
    if isinstance(exc, DynamicOutputShapeException):
        return CaptureError(
            f"{where} calls {exc.func}, whose output shape depends on tensor values "
            f"(nonzero, unique, masked_select...); such ops cannot be captured into one "
            f"static graph; use a fixed-size alternative (torch.where, a mask multiply)")
    text = str(exc).strip()
    if "input mutations" in text:
        return CaptureError(
            "the step mutates one of its inputs in place (an in-place update of a "
            "parameter or buffer inside the forward); splitrun captures pure steps: "
            "return new values instead of writing into module state")
    first_line = text.splitlines()[0] if text else type(exc).__name__
    return CaptureError(f"capture failed in {where}: {type(exc).__name__}: {first_line}")


# -- building the step graph --------------------------------------------------

def _safe(name: str) -> str:
    return re.sub(r"\W", "_", name)


class _StepBuilder:
    """Copies the joint graph into a graph with named state inputs, a ones-like
    tangent for the loss, and the optimizer updates appended."""

    def __init__(self, joint: fx.GraphModule, trainable: list[str], frozen: list[str],
                 num_batch: int, owners: dict[str, str], padding: dict[str, int]) -> None:
        self.joint = joint
        self.padding = padding
        self.trainable = trainable
        self.frozen = frozen
        self.num_batch = num_batch
        self.owners = owners
        self.graph = fx.Graph()
        self.inputs: list[InputSpec] = []
        self.input_nodes: dict[str, fx.Node] = {}
        self.outputs: list[OutputSpec] = []
        self.env: dict[fx.Node, fx.Node] = {}
        self.loss: fx.Node | None = None
        self.grads: dict[str, fx.Node] = {}
        self.sparse_grads: dict[str, tuple[fx.Node, fx.Node]] = {}
        self._update_cache: dict[tuple, fx.GraphModule] = {}

    def _placeholder(self, name: str, kind: InputKind, key: str,
                     owner: str | None = None, param: str | None = None) -> fx.Node:
        node = self.graph.placeholder(name)
        if owner is not None:
            set_node_annotation(node, owner)
        self.inputs.append(InputSpec(node.name, kind, key, param))
        self.input_nodes[key] = node
        return node

    def add_inputs(self, groups: OptimizerGroups | None) -> None:
        """All placeholders first: state, then hyperparameters, then the batch."""
        joint_inputs = [n for n in self.joint.graph.nodes if n.op == "placeholder"]
        self._primals = [n for n in joint_inputs if not n.name.startswith("tangents")]
        self._tangents = [n for n in joint_inputs if n.name.startswith("tangents")]
        names = self.trainable + self.frozen
        for index, node in enumerate(self._primals[:len(names)]):
            name = names[index]
            kind = InputKind.PARAM if index < len(self.trainable) else InputKind.BUFFER
            prefix = "p_" if kind is InputKind.PARAM else "b_"
            self.env[node] = self._placeholder(prefix + _safe(name), kind, name,
                                               self.owners.get(name))
        if groups is not None:
            for name in self.trainable:
                for state_name in groups.for_param(name).state_names:
                    self._placeholder(f"o_{_safe(name)}_{state_name}", InputKind.OPT_STATE,
                                      f"{name}.{state_name}", self.owners.get(name), name)
            for index in range(len(groups.functional)):
                key = groups.lr_key(index)
                self._placeholder(_safe(key), InputKind.HPARAM, key)
            self._placeholder("step", InputKind.HPARAM, "step")
        for index, node in enumerate(self._primals[len(names):]):
            self.env[node] = self._placeholder(f"in_{index}", InputKind.BATCH, f"batch.{index}")

    def copy_joint(self) -> None:
        tangents = self._tangents
        if len(tangents) != 1:
            raise CaptureError(
                f"expected one differentiable output (the loss), the joint graph has "
                f"{len(tangents)}; does the loss depend on any trainable parameter?")
        output_node = next(n for n in self.joint.graph.nodes if n.op == "output")
        joint_outputs = output_node.args[0]
        loss_node = joint_outputs[0]
        for node in self.joint.graph.nodes:
            if node.op in ("placeholder", "output"):
                continue
            self.env[node] = self.graph.node_copy(node, self._lookup)
            if node is loss_node:
                self.loss = self.env[node]
                # The loss's gradient seed; follows the loss to its process.
                self.env[tangents[0]] = self.graph.call_function(
                    _aten.ones_like.default, (self.loss,))
        grads = joint_outputs[1:1 + len(self.trainable)]
        for name, grad in zip(self.trainable, grads):
            if grad is None:
                raise CaptureError(
                    f"parameter {name!r} requires grad but the loss does not depend on "
                    f"it; freeze it (requires_grad=False) or leave it out of the optimizer")
            node = self.grads[name] = self.env[grad]
            if node.target is _aten._sparse_coo_tensor_with_dims_and_tensors.default:
                # nn.Embedding(sparse=True): keep the gradient as (indices, values).
                self.sparse_grads[name] = (node.args[3], node.args[4])
        # Sparse bags: their gradients summed per unique id (capturing/bags.py).
        coalesce_bag_gradients(self.graph, self.sparse_grads)

    def _lookup(self, node: fx.Node) -> fx.Node:
        return self.env[node]

    def append_updates(self, groups: OptimizerGroups, params: dict[str, nn.Parameter]) -> None:
        for name in self.trainable:
            functional = groups.for_param(name)
            state_nodes = {s: self.input_nodes[f"{name}.{s}"] for s in functional.state_names}
            lr = self.input_nodes[groups.lr_key(groups.param_group[name])]
            owner = self.owners.get(name) or self._forward_label(name)
            if owner is not None:
                # The state lives where it is updated.
                for node in (self.input_nodes[name], *state_nodes.values()):
                    set_node_annotation(node, owner)
            if name in self.sparse_grads:
                new_param, new_state = self._sparse_update(
                    functional, params[name], state_nodes, lr, owner, name)
            elif getattr(functional, "foreach", False):
                new_param, new_state = self._foreach_update(
                    functional, params[name], self.input_nodes[name], self.grads[name],
                    state_nodes, lr, self.input_nodes["step"], owner, name)
            else:
                new_param, new_state = self._inline_update(
                    functional, params[name], self.input_nodes[name], self.grads[name],
                    state_nodes, lr, self.input_nodes["step"], owner, name)
            self.outputs.append(OutputSpec(new_param.name, OutputKind.STATE, name))
            for state_name, node in new_state.items():
                self.outputs.append(OutputSpec(node.name, OutputKind.STATE,
                                               f"{name}.{state_name}"))

    def _forward_label(self, name: str) -> str | None:
        """An unplaced parameter is owned by the label of its first labelled
        reader, so a parameter used inside a `region` lives there."""
        for user in self.input_nodes[name].users:
            text = node_annotation(user)
            if text is not None:
                return text
        return None

    def _inline_update(self, functional, param, param_node, grad_node, state_nodes,
                       lr_node, step_node, owner, name):
        state_names = tuple(state_nodes)
        cache_key = (id(functional), tuple(param.shape), param.dtype, state_names)
        traced = self._update_cache.get(cache_key)
        if traced is None:
            def update(p, g, lr, step, *state):
                new_p, new_state = functional.update(p, g, dict(zip(state_names, state)), lr, step)
                return (new_p, *[new_state[s] for s in state_names])
            example = [torch.empty_like(param.detach()), torch.empty_like(param.detach()),
                       torch.tensor(0.1, dtype=optim.HPARAM_DTYPE),
                       torch.tensor(1.0, dtype=optim.HPARAM_DTYPE)]
            example += [torch.empty_like(param.detach()) for _ in state_names]
            traced = make_fx(update, tracing_mode="fake")(*example)
            self._update_cache[cache_key] = traced
        inputs = [param_node, grad_node, lr_node, step_node, *state_nodes.values()]
        env: dict[fx.Node, fx.Node] = {}
        placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
        env.update(zip(placeholders, inputs))
        results = None
        for node in traced.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                results = [env[r] for r in node.args[0]]
                break
            if node.op == "get_attr":
                raise CaptureError(
                    f"optimizer update of {name!r} captured a tensor constant; write "
                    f"the update with Python scalars or graph inputs only")
            new = self.graph.node_copy(node, lambda n: env[n])
            new.meta.pop("custom", None)
            if owner is not None:
                set_node_annotation(new, owner)
            set_node_annotation(new, f"optimizer.{name}", MODULE_ANNOTATION)
            env[node] = new
        new_param, *new_states = results
        return new_param, dict(zip(state_names, new_states))

    def _foreach_update(self, functional, param, param_node, grad_node, state_nodes,
                        lr_node, step_node, owner, name):
        """One `foreach_update` node of one parameter (the splitter groups them
        per process) and a getitem per result."""
        settings = {k: v for k, v in vars(functional).items()
                    if not k.startswith("_") and k not in ("lr", "foreach", "state_names")}
        state_names = tuple(state_nodes)
        args = (param_node, grad_node, *state_nodes.values(), lr_node, step_node)
        update = self.graph.call_function(
            foreach_update, args,
            {"optimizer": type(functional).__name__, "num_params": 1, **settings})
        results = [self.graph.call_function(operator.getitem, (update, i))
                   for i in range(1 + len(state_names))]
        meta = torch.empty(tuple(param.shape), dtype=param.dtype, device="meta")
        update.meta["val"] = tuple(meta for _ in results)
        for node in (update, *results):
            if owner is not None:
                set_node_annotation(node, owner)
            set_node_annotation(node, f"optimizer.{name}", MODULE_ANNOTATION)
        for node in results:
            node.meta["val"] = meta
        return results[0], dict(zip(state_names, results[1:]))

    def _sparse_update(self, functional, param, state_nodes, lr_node, owner, name):
        """One row-wise update node (its output shapes depend on the data, so it
        is called, not traced) and a getitem per result."""
        update_fn, settings = sparse_update_for(functional)
        if name in self.padding:
            settings = {**settings, "padding_idx": self.padding[name]}
        indices, values = self.sparse_grads[name]
        state_names = tuple(state_nodes)
        args = (self.input_nodes[name], indices, values, lr_node, self.input_nodes["step"],
                *state_nodes.values())
        update = self.graph.call_function(update_fn, args, settings)
        results = [self.graph.call_function(operator.getitem, (update, i))
                   for i in range(1 + len(state_names))]
        meta = torch.empty(tuple(param.shape), dtype=param.dtype, device="meta")
        update.meta["val"] = tuple(meta for _ in results)
        for node in (update, *results):
            if owner is not None:
                set_node_annotation(node, owner)
            set_node_annotation(node, f"optimizer.{name}", MODULE_ANNOTATION)
        for node in results:
            node.meta["val"] = meta
        return results[0], dict(zip(state_names, results[1:]))

    def finish(self, return_grads: bool) -> tuple[tuple[InputSpec, ...], tuple[OutputSpec, ...]]:
        outputs = [OutputSpec(self.loss.name, OutputKind.LOSS, "loss")]
        if not return_grads:
            # A sparse gradient as a COO tensor is only an output; the update
            # reads its indices and values.
            for name in self.sparse_grads:
                if not self.grads[name].users:
                    self.graph.erase_node(self.grads[name])
            drop_unused_bag_backwards(self.graph)
        if return_grads:
            outputs += [OutputSpec(g.name, OutputKind.GRAD, f"grad.{name}")
                        for name, g in self.grads.items()]
        outputs += self.outputs
        by_name = {node.name: node for node in self.graph.nodes}
        self.graph.output(tuple(by_name[spec.node] for spec in outputs))
        return tuple(self.inputs), tuple(outputs)

    def example_inputs(self, params, frozen, batch, groups: OptimizerGroups, cached
                       ) -> list[torch.Tensor]:
        hparams = groups.hparams(0) if groups.functional else {}
        values = []
        for spec in self.inputs:
            if spec.kind is InputKind.PARAM:
                values.append(params[spec.key].detach())
            elif spec.kind is InputKind.BUFFER:
                values.append(frozen[spec.key].detach())
            elif spec.kind is InputKind.OPT_STATE:
                functional, param = groups.for_param(spec.param), params[spec.param].detach()
                if spec.param in cached:
                    values.append(row_state_of(functional, param)[spec.state_name])
                else:  # only its shape is read: left unwritten
                    like = functional.init_state_entry(param.to("meta"), spec.state_name)
                    values.append(torch.empty_like(like, device=param.device))
            elif spec.kind is InputKind.HPARAM:
                values.append(hparams[spec.key])
            else:
                values.append(batch[int(spec.key.split(".")[1])])
        return values


class _StepValues(FakeTensorProp):
    """FakeTensorProp that does not run row-wise sparse updates (their shapes
    depend on data): their results have the shapes of the table and its state."""

    def run_node(self, n: fx.Node):
        if n.op == "call_function" and n.target is bag_gradient:
            # Summed per unique id: at most one row per lookup; no static shape.
            grad, ids = (self.env[a] for a in n.args[:2])
            with self._mode:
                result = (torch.empty(ids.shape, dtype=torch.int64),
                          torch.empty((ids.shape[0], grad.shape[1]), dtype=grad.dtype))
            n.meta["val"] = None
            return result
        if (n.op == "call_function" and n.target is operator.getitem
                and getattr(n.args[0], "target", None) is bag_gradient):
            result = super().run_node(n)
            n.meta["val"] = None
            return result
        if n.op == "call_function" and (n.target in ROW_WISE_UPDATES
                                        or n.target in MULTI_TENSOR_UPDATES):
            with self._mode:
                result = tuple(torch.empty(t.shape, dtype=t.dtype) for t in n.meta["val"])
            n.meta["val"] = result
            return result
        return super().run_node(n)


def _propagate_fake_values(gm: fx.GraphModule, example_inputs: list[torch.Tensor]) -> None:
    """Give every node a `meta["val"]` (shape and dtype), which the splitter
    uses for byte counts and the runtime for envelopes."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_inputs = [mode.from_tensor(_stand_in(t) if t.device.type == "meta" else t)
                   for t in example_inputs]
    _StepValues(gm, mode).propagate_dont_convert_inputs(*fake_inputs)
