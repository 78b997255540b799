"""A captured training step: one `torch.fx` graph plus what its inputs and outputs mean.

The graph is a pure function. State (parameters, buffers, optimizer moments)
enters as placeholders and its new value leaves as an output; the batch and the
optimizer's hyperparameters (learning rate, step count) are fed each step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol, runtime_checkable

import torch
from torch import fx

from .errors import PlanError
from .initial_state import InitialState
from .labels import LABEL_ANNOTATION, MODULE_ANNOTATION

__all__ = [
    "InputKind",
    "OutputKind",
    "BatchInput",
    "InputSpec",
    "OutputSpec",
    "ParamGroup",
    "Program",
    "node_annotation",
    "set_node_annotation",
]


class InputKind(Enum):
    PARAM = "param"          # state, updated by the optimizer
    BUFFER = "buffer"        # state, read only
    OPT_STATE = "opt_state"  # state, updated by the optimizer
    HPARAM = "hparam"        # fed each step by worker 0: learning rates, step count
    BATCH = "batch"          # fed each step to every worker that reads it

    @property
    def is_state(self) -> bool:
        return self in (InputKind.PARAM, InputKind.BUFFER, InputKind.OPT_STATE)


@runtime_checkable
class BatchInput(Protocol):
    """Turns a model's own batches into the tensors a captured step takes
    (`TorchRecInput`: TorchRec's `KeyedJaggedTensor`s and `Batch`es)."""

    def convert(self, batch) -> tuple[torch.Tensor, ...]:
        """One batch, this worker's, as the step's tensors."""

    def shard(self, batches: Iterable, rank: int, num_workers: int
              ) -> Iterator[tuple[torch.Tensor, ...]]:
        """Worker `rank`'s share of every global batch, converted."""


class OutputKind(Enum):
    LOSS = "loss"    # delivered to the mode's default process (worker 0)
    GRAD = "grad"    # left where it is computed
    STATE = "state"  # the new value of a state slot, kept by the slot's owner


@dataclass(frozen=True, slots=True)
class InputSpec:
    node: str        # placeholder name in the graph
    kind: InputKind
    key: str         # user-facing name: "l1.weight", "l1.weight.exp_avg", "lr", "batch.0"
    # Optimizer state: the key of the parameter it belongs to ("l1.weight");
    # None for every other input. Keys are never parsed to find it.
    param: str | None = None

    @property
    def state_name(self) -> str | None:
        """Optimizer state: its name in the parameter's state ("exp_avg")."""
        return None if self.param is None else self.key[len(self.param) + 1:]


@dataclass(frozen=True, slots=True)
class OutputSpec:
    node: str        # name of the graph node whose value is output
    kind: OutputKind
    key: str         # "loss", "grad.l1.weight", or the state key it updates


@dataclass(frozen=True)
class ParamGroup:
    """One optimizer param group as torch's optimizer `state_dict` describes it:
    checkpoints are written and read in that format."""

    optimizer: str                  # "SGD", "Adam", "AdamW" or "Adagrad"
    state_names: tuple[str, ...]    # per-parameter state: "exp_avg", "sum", ...
    params: tuple[str, ...]         # parameter names, in capture order
    settings: Mapping[str, object]  # lr, betas, weight_decay, ... (torch's group keys)

    @property
    def has_step_count(self) -> bool:
        """torch keeps a per-parameter "step" in these optimizers' state."""
        return self.optimizer in ("Adam", "AdamW", "Adagrad")


def node_annotation(node: fx.Node, key: str = LABEL_ANNOTATION) -> str | None:
    """An annotation `torch.fx.traceback.annotate` (or splitrun) left on `node`."""
    custom = node.meta.get("custom")
    return None if not custom else custom.get(key)


def set_node_annotation(node: fx.Node, value: str, key: str = LABEL_ANNOTATION) -> None:
    custom = dict(node.meta.get("custom") or {})
    custom[key] = value
    node.meta["custom"] = custom


@dataclass
class Program:
    """One training step as one graph, ready to split.

    `hparams_fn(step)` returns the hyperparameter feeds for a 0-based step
    (learning rates read live, so schedules work). The facts capture records
    for modes and checkpoints: each trainable parameter's gradient node
    (`grads`; `sparse_grads` for sparse embeddings), the optimizer's param
    groups, and the tables marked for embedding caching.
    """

    graph_module: fx.GraphModule
    inputs: tuple[InputSpec, ...]
    outputs: tuple[OutputSpec, ...]
    # Made where taken (`InitialState`): capture copies nothing.
    initial_state: InitialState = field(default_factory=InitialState)
    hparams_fn: Callable[[int], dict[str, torch.Tensor]] | None = None
    # parameter -> name of the node computing its (dense) gradient
    grads: dict[str, str] = field(default_factory=dict)
    # parameter -> names of the (indices, values) nodes of its sparse gradient
    sparse_grads: dict[str, tuple[str, str]] = field(default_factory=dict)
    param_groups: tuple[ParamGroup, ...] = ()
    # table parameter -> its cache settings (an `ops.cache.CacheSettings`, set by
    # `place_embedding_cache`). The program only carries them to embedding-cache
    # mode, so the IR names no cache type.
    cached_tables: dict[str, object] = field(default_factory=dict)
    # Buffers the model registered with persistent=False: state of the step,
    # but no part of `model.state_dict()`, so no checkpoint writes them (a
    # resume takes them from `initial_state`).
    non_persistent_buffers: frozenset[str] = frozenset()
    # What turns the model's own batches (TorchRec's) into the step's
    # tensors, where the loss was made by one (`TorchRecInput.loss`).
    batch_input: BatchInput | None = field(default=None, repr=False)
    # The same step captured again with each batch input cut to its first
    # `rows` rows (what micro-batching copies); None where the program was
    # not made by `capture`.
    recapture: Callable[[int], Program] | None = field(default=None, repr=False)

    def checkpoint_keys(self) -> list[str]:
        """The model's keys a checkpoint holds, as `model.state_dict()` has
        them: parameters and persistent buffers (and the cached tables, which
        an embedding-cache split's program takes from no input)."""
        keys = [spec.key for spec in self.inputs
                if spec.kind in (InputKind.PARAM, InputKind.BUFFER)
                and spec.key not in self.non_persistent_buffers]
        return keys + [key for key in self.cached_tables if key not in keys]

    def __post_init__(self) -> None:
        if not isinstance(self.initial_state, InitialState):
            self.initial_state = InitialState(self.initial_state)
        returned = [getattr(n, "name", None) for n in self.graph.output_node().args[0]]
        declared = [spec.node for spec in self.outputs]
        if returned != declared:
            raise PlanError(
                f"the graph returns {returned} but the program declares outputs "
                f"{declared}; they must match one to one, in order")
        self._by_node = {spec.node: spec for spec in self.inputs}
        self._by_key = {spec.key: spec for spec in self.inputs}
        self._state_output = {s.key: s for s in self.outputs if s.kind is OutputKind.STATE}

    @property
    def graph(self) -> fx.Graph:
        return self.graph_module.graph

    def input_spec(self, node_name: str) -> InputSpec | None:
        return self._by_node.get(node_name)

    def input_for_key(self, key: str) -> InputSpec:
        return self._by_key[key]

    def state_output(self, key: str) -> OutputSpec | None:
        return self._state_output.get(key)

    def hparams(self, step: int) -> dict[str, torch.Tensor]:
        return {} if self.hparams_fn is None else self.hparams_fn(step)

    def module_of(self, node: fx.Node) -> str | None:
        return node_annotation(node, MODULE_ANNOTATION)

    # -- running the unsplit step (the reference every split is compared to) --

    def flat_inputs(self, state: Mapping[str, torch.Tensor],
                    feeds: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        values = []
        for spec in self.inputs:
            source = state if spec.kind.is_state else feeds
            if spec.key not in source:
                where = "state" if spec.kind.is_state else "feeds"
                raise PlanError(
                    f"input {spec.key!r} ({spec.kind.value}) is missing from the "
                    f"{where}; the step needs {', '.join(s.key for s in self.inputs)}")
            values.append(source[spec.key])
        return values

    def run_unsplit(self, state: Mapping[str, torch.Tensor],
                    feeds: Mapping[str, torch.Tensor],
                    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Run the whole step in this process.

        Returns `(outputs, new_state)`: outputs by key (loss, grads) and the
        state after the step.
        """
        results = self.graph_module(*self.flat_inputs(state, feeds))
        new_state = dict(state)
        outputs: dict[str, torch.Tensor] = {}
        for spec, value in zip(self.outputs, results):
            if spec.kind is OutputKind.STATE:
                new_state[spec.key] = value
            else:
                outputs[spec.key] = value
        return outputs, new_state

    def train_unsplit(self, num_steps: int,
                      batches: Callable[[int], Mapping[str, torch.Tensor]],
                      state: Mapping[str, torch.Tensor] | None = None,
                      ) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
        """Run `num_steps` unsplit steps; `batches(step)` gives the batch feeds."""
        state = dict(self.initial_state if state is None else state)
        history = []
        for step in range(num_steps):
            feeds = {**batches(step), **self.hparams(step)}
            outputs, state = self.run_unsplit(state, feeds)
            history.append(outputs)
        return history, state

