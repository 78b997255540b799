"""Random labelled programs: for property tests and the splitter benchmark.

A synthetic program is a random DAG of cheap elementwise ops over small
tensors, with batch inputs, state slots that some node updates (so data-sync
crosses steps), a loss, and random labels in runs of a chosen mean length.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch
from torch import fx

from ..labels import Label
from ..program import InputKind, InputSpec, OutputKind, OutputSpec, Program, set_node_annotation

__all__ = ["random_program", "random_batches"]

_aten = torch.ops.aten
# Bounded ops, so long chains neither overflow nor vanish.
_UNARY = [_aten.sin.default, _aten.cos.default, _aten.tanh.default, _aten.neg.default]
_BINARY = [_aten.add.Tensor, _aten.mul.Tensor, _aten.sub.Tensor]


def random_program(num_nodes: int, labels: Sequence[Label], *, seed: int = 0,
                   num_batch: int = 2, num_state: int = 3, run_length: float = 4.0,
                   shape: tuple[int, ...] = (4,), with_views: bool = True) -> Program:
    """A program of `num_nodes` ops, each labelled with one of `labels`.

    Consecutive ops share a label for runs of mean `run_length` (1.0 labels
    every op independently). Each state slot is read by the graph and updated
    by one node; the loss is the sum of a few nodes.
    """
    rng = random.Random(seed)
    graph = fx.Graph()
    meta = torch.empty(shape, device="meta")
    inputs: list[InputSpec] = []
    values: list[fx.Node] = []

    def with_val(node: fx.Node, value=meta) -> fx.Node:
        node.meta["val"] = value
        return node

    for index in range(num_batch):
        node = with_val(graph.placeholder(f"in_{index}"))
        inputs.append(InputSpec(node.name, InputKind.BATCH, f"batch.{index}"))
        values.append(node)
    state_nodes = []
    for index in range(num_state):
        node = with_val(graph.placeholder(f"state_{index}"))
        inputs.append(InputSpec(node.name, InputKind.PARAM, f"state.{index}"))
        values.append(node)
        state_nodes.append(node)

    label = rng.choice(labels)
    for _ in range(num_nodes):
        if rng.random() > 1.0 - 1.0 / max(run_length, 1.0):
            label = rng.choice(labels)
        # Prefer recent values so the graph is deep, not a flat fan.
        def pick() -> fx.Node:
            window = values[-16:] if rng.random() < 0.8 else values
            return rng.choice(window)
        roll = rng.random()
        if with_views and roll < 0.1:
            node = graph.call_function(_aten.view.default, (pick(), list(shape)))
            # Views follow their producer unless labelled: leave most unlabelled.
            if rng.random() < 0.5:
                set_node_annotation(node, str(label))
        elif roll < 0.45:
            node = graph.call_function(rng.choice(_UNARY), (pick(),))
            set_node_annotation(node, str(label))
        else:
            node = graph.call_function(rng.choice(_BINARY), (pick(), pick()))
            set_node_annotation(node, str(label))
        values.append(with_val(node))

    computed = values[num_batch + num_state:] or values
    loss_terms = rng.sample(computed, k=min(3, len(computed)))
    total = loss_terms[0]
    for term in loss_terms[1:]:
        total = with_val(graph.call_function(_aten.add.Tensor, (total, term)))
    loss = with_val(graph.call_function(_aten.sum.default, (total,)),
                    torch.empty((), device="meta"))
    outputs = [(loss, OutputSpec(loss.name, OutputKind.LOSS, "loss"))]
    # Each state slot's new value mixes it with a computed value, on one owner.
    for index, node in enumerate(state_nodes):
        owner = str(rng.choice(labels))
        scaled = with_val(graph.call_function(_aten.mul.Tensor, (rng.choice(computed), 0.01)))
        update = with_val(graph.call_function(_aten.add.Tensor, (node, scaled)))
        set_node_annotation(scaled, owner)
        set_node_annotation(update, owner)
        outputs.append((update, OutputSpec(update.name, OutputKind.STATE, f"state.{index}")))
    for node in rng.sample(computed, k=min(2, len(computed))):
        outputs.append((node, OutputSpec(node.name, OutputKind.GRAD, f"out.{node.name}")))
    graph.output(tuple(node for node, _ in outputs))
    gm = fx.GraphModule(torch.nn.Module(), graph, class_name="SyntheticStep")
    generator = torch.Generator().manual_seed(seed)
    initial_state = {f"state.{i}": torch.rand(shape, generator=generator)
                     for i in range(num_state)}
    return Program(gm, tuple(inputs), tuple(spec for _, spec in outputs), initial_state)


def random_batches(program: Program, num_steps: int,
                   seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Batch feeds for `num_steps` steps of a synthetic program."""
    generator = torch.Generator().manual_seed(seed)
    shapes = {n.name: tuple(n.meta["val"].shape) for n in program.graph.nodes
              if n.op == "placeholder"}
    batch_specs = [s for s in program.inputs if s.kind is InputKind.BATCH]
    return [{s.key: torch.rand(shapes[s.node], generator=generator) for s in batch_specs}
            for _ in range(num_steps)]
