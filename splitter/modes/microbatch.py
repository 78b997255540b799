"""Micro-batching a captured step for a pipeline schedule.

The step is captured again at the micro-batch's size (`Program.recapture`), so
every shape in the copied graph is right for a micro-batch. Its forward and
backward are copied once per micro-batch, each reading its slice of every
batch input (rows `m*b` to `(m+1)*b`); what reads no batch (a weight's
transpose) runs once. The gradients are summed over the micro-batches and the
optimizer runs once on the sum, so the step equals the unsplit step on the
whole batch: exactly in real arithmetic, within float rounding here (a mean
loss is the mean of the micro-batch means, its gradients scaled by 1/M).

The copies are laid out in one global order that runs every stage's actions
in the order its schedule says (`stage_actions`), so the splitter turns the
order into per-process schedules that cannot deadlock, as it does for any
order. Copied nodes are named after their action: `addmm__F3` is micro-batch
3's forward, `mm_1__B0` micro-batch 0's backward; under interleaved 1F1B the
action names its virtual stage too (`addmm__2F3`, see `pipeline_order`).

A step can be cut this way only if its samples are independent: a value
reduced over the batch (batch-norm statistics) must not flow back into
per-sample values, and the loss must be a mean or a sum over the samples.
Both are checked, and the error names the op.
"""

from __future__ import annotations

import copy
import operator
from collections import defaultdict
from dataclasses import dataclass
from enum import Enum

import torch
from torch import fx

from ..errors import PlanError
from ..labels import Cluster, Label
from ..plan.pipeline_order import Action, PipelineSchedule, interleaved_rounds, stage_actions
from ..program import InputKind, OutputKind, OutputSpec, Program, set_node_annotation
from ..splitting.mode import Mode
from ..splitting.resolve import describe_node, resolve_labels

__all__ = ["MicrobatchedStep", "microbatch_step", "LossReduction"]

_aten = torch.ops.aten

# Ops whose value does not depend on their input's data, only its shape: the
# loss's gradient seed (`ones_like(loss)`) carries no sample's data.
_SHAPE_ONLY = frozenset({_aten.ones_like.default, _aten.zeros_like.default,
                         _aten.empty_like.default, _aten.full_like.default})
# Ops that only lay a value out anew (linear in it): a gradient made by a
# matrix product and such ops is accumulated in the product's layout, inside
# the product (`addmm(sum, a, b)`: no pass of its own over the sum), and laid
# out once at the end.
_LAYOUT_OPS = frozenset({_aten.t.default, _aten.transpose.int, _aten.permute.default,
                         _aten.view.default, _aten._unsafe_view.default,
                         _aten.reshape.default})
_MEAN_OPS = frozenset({_aten.mean.default, _aten.mean.dim})
_SUM_OPS = frozenset({_aten.sum.default, _aten.sum.dim_IntList})
# torch's `reduction` argument: 1 = "mean", 2 = "sum" (0, "none", is not scalar).
_REDUCTIONS = {1: "mean", 2: "sum"}



class LossReduction(Enum):
    """How the loss combines its samples, so how micro-batches combine."""

    MEAN = "mean"  # the loss is the mean of the micro-batch means; gradients / M
    SUM = "sum"


@dataclass(frozen=True)
class MicrobatchedStep:
    """The rewritten program, its pipeline stages (the processes, labels in
    forward order), each one's actions as laid out (`"F0"`, `"B0"`, ...;
    `"2F0"` under interleaved 1F1B) and the chunks each process holds."""

    program: Program
    stages: tuple[Label, ...]
    actions: tuple[tuple[str, ...], ...]
    loss_reduction: LossReduction
    num_chunks: int = 1


def microbatch_step(program: Program, cluster: Cluster, mode: Mode, num_microbatches: int,
                    schedule: PipelineSchedule) -> MicrobatchedStep:
    """`program` cut into `num_microbatches` micro-batches laid out for
    `schedule`; `mode` resolves the labels (the general mode asking)."""
    rows = _batch_rows(program, num_microbatches)
    if program.recapture is None:
        raise PlanError(
            "micro-batching captures the step again at the micro-batch size, but this "
            "program was not made by splitrun.splitter.capture; capture it with capture()")
    if program.sparse_grads or program.cached_tables:
        raise PlanError(
            "micro-batching does not support sparse gradients or cached embedding tables "
            "yet; use nn.Embedding(sparse=False) or microbatches=1")
    micro = program.recapture(rows // num_microbatches)
    _check_same_ops(program, micro, rows, rows // num_microbatches)
    facts = _Facts(program, micro)
    labels = resolve_labels(micro, cluster, mode)
    return _Layout(program, micro, facts, labels, num_microbatches, schedule).build()


# -- checks -------------------------------------------------------------------

def _batch_rows(program: Program, num_microbatches: int) -> int:
    batch = [s for s in program.inputs if s.kind is InputKind.BATCH]
    if not batch:
        raise PlanError("micro-batching cuts the batch inputs, but the step has none")
    by_node = {n.name: n for n in program.graph.find_nodes(op="placeholder")}
    rows = {}
    for spec in batch:
        value = by_node[spec.node].meta.get("val")
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            raise PlanError(f"batch input {spec.key!r} is a scalar; micro-batching cuts "
                            f"every batch input along its first dimension")
        rows[spec.key] = value.shape[0]
    if len(set(rows.values())) != 1:
        listed = ", ".join(f"{key} has {n}" for key, n in rows.items())
        raise PlanError(f"the batch inputs differ in their first dimension ({listed}); "
                        f"micro-batching cuts every batch input into equal row slices")
    total = next(iter(rows.values()))
    if total % num_microbatches:
        fits = [m for m in range(2, total + 1) if total % m == 0][:8]
        raise PlanError(
            f"a batch of {total} rows does not divide into {num_microbatches} "
            f"micro-batches; choose microbatches among {fits} or change the batch size")
    return total


def _check_same_ops(full: Program, micro: Program, rows: int, micro_rows: int) -> None:
    full_ops = [(n.op, n.name, n.target) for n in full.graph.nodes]
    micro_ops = [(n.op, n.name, n.target) for n in micro.graph.nodes]
    for index, (a, b) in enumerate(zip(full_ops, micro_ops)):
        if a != b:
            raise PlanError(
                f"the step traces differently with {micro_rows} rows than with {rows}: op "
                f"{index} is {a[1]} ({a[2]}) at full size but {b[1]} ({b[2]}) per "
                f"micro-batch; micro-batching needs a step whose ops do not depend on "
                f"the batch size")
    if len(full_ops) != len(micro_ops):
        raise PlanError(f"the step traces to {len(full_ops)} nodes with {rows} rows but "
                        f"{len(micro_ops)} with {micro_rows}; micro-batching needs a step "
                        f"whose ops do not depend on the batch size")


def _shapes(node: fx.Node):
    value = node.meta.get("val")
    if isinstance(value, (list, tuple)):
        return tuple(_shapes_of(v) for v in value)
    return _shapes_of(value)


def _shapes_of(value):
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _op_name(node: fx.Node) -> str:
    return getattr(node.target, "__name__", str(node.target))


class _Facts:
    """What each node of the micro-batch graph is: per-sample (its shape
    scales with the batch), derived from the samples' data, needed by the
    loss or a gradient, run per micro-batch (replicated), forward or backward."""

    def __init__(self, full: Program, micro: Program) -> None:
        self.micro = micro
        full_nodes = {n.name: n for n in full.graph.nodes}
        nodes = list(micro.graph.nodes)
        batch = {s.node for s in micro.inputs if s.kind is InputKind.BATCH}
        self.batch = {n for n in nodes if n.name in batch}
        self.per_sample = {n for n in nodes if n.op != "output"
                           and _shapes(n) != _shapes(full_nodes[n.name])}
        by_name = {n.name: n for n in nodes}
        loss_spec = next((s for s in micro.outputs if s.kind is OutputKind.LOSS), None)
        if loss_spec is None:
            raise PlanError("micro-batching needs the step's loss as an output")
        self.loss = by_name[loss_spec.node]
        self.grads = {param: by_name[name] for param, name in micro.grads.items()}
        reaches_batch: set[fx.Node] = set()   # any path from a batch input
        data: set[fx.Node] = set()            # a sample's data flows in
        for node in nodes:
            inputs = node.all_input_nodes
            if node in self.batch or any(i in reaches_batch for i in inputs):
                reaches_batch.add(node)
            if node in self.batch or (node.target not in _SHAPE_ONLY
                                      and any(i in data for i in inputs)):
                data.add(node)
        self.data = data
        self.forward = _ancestors([self.loss])
        self.needed = _ancestors([self.loss, *self.grads.values()])
        self.replicated = {n for n in nodes if n in reaches_batch and n in self.needed
                           and n.op == "call_function"}
        self.loss_reduction = self._loss_reduction()
        self._check_samples_independent(nodes)
        self._check_only_loss_and_grads_leave(nodes)

    def _loss_reduction(self) -> LossReduction:
        loss = self.loss
        op = loss.args[0] if loss.target is operator.getitem else loss
        where = describe_node(self.micro, op)
        if op.target in _MEAN_OPS or op.target in _SUM_OPS:
            reduction = LossReduction.MEAN if op.target in _MEAN_OPS else LossReduction.SUM
        else:
            schema = getattr(op.target, "_schema", None)
            names = [a.name for a in schema.arguments] if schema is not None else []
            if "reduction" not in names:
                raise PlanError(
                    f"the loss comes from {where}, op {_op_name(op)}; micro-batching needs "
                    f"a loss that is a mean or a sum over the samples (torch.mean, "
                    f"torch.sum, or a loss function with reduction='mean' or 'sum') as "
                    f"the step's last op, to combine the micro-batches' losses")
            index = names.index("reduction")
            value = op.args[index] if index < len(op.args) else op.kwargs.get(
                "reduction", schema.arguments[index].default_value)
            reduction = LossReduction(_REDUCTIONS[value])
        source = op.all_input_nodes[0] if op.all_input_nodes else None
        if source is None or source not in self.per_sample:
            raise PlanError(
                f"the loss's {reduction.value} ({where}) reduces a value that is not per sample "
                f"({source.name if source is not None else 'none'}); micro-batching needs "
                f"the loss's last op to be the one that reduces over the samples")
        self._loss_op = op
        return reduction

    def _check_samples_independent(self, nodes: list[fx.Node]) -> None:
        """No per-sample value is computed from a value reduced over the batch
        (except the loss function's own weight, such as nll_loss's count)."""
        for node in nodes:
            if node not in self.replicated or node not in self.per_sample:
                continue
            for value in node.all_input_nodes:
                if (value in self.data and value not in self.per_sample
                        and not self._is_loss_part(value)):
                    source = value.args[0] if value.target is operator.getitem else value
                    raise PlanError(
                        f"{describe_node(self.micro, source)}, op {_op_name(source)}, mixes "
                        f"samples: it computes {value.name} over the whole batch, which "
                        f"{describe_node(self.micro, node)}, op {_op_name(node)}, reads back "
                        f"per sample (batch-norm statistics do this); micro-batches would "
                        f"see other statistics than the whole batch. Use a per-sample "
                        f"normalisation (LayerNorm, GroupNorm) or microbatches=1")

    def _is_loss_part(self, value: fx.Node) -> bool:
        op = self._loss_op
        return value is op or (value.target is operator.getitem and value.args[0] is op)

    def _check_only_loss_and_grads_leave(self, nodes: list[fx.Node]) -> None:
        leaving = {self.loss, *self.grads.values()}
        output = self.micro.graph.output_node()
        for node in nodes:
            if node in self.replicated:
                continue
            for value in node.all_input_nodes:
                if value in self.replicated and value not in leaving:
                    what = ("an output of the step" if node is output
                            else describe_node(self.micro, node))
                    raise PlanError(
                        f"{what} reads {value.name}, a value of one micro-batch; only "
                        f"the loss and the gradients are combined over micro-batches "
                        f"(a buffer the forward updates, such as batch-norm running "
                        f"statistics, cannot be micro-batched)")


def _ancestors(roots: list[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return seen


# -- layout ---------------------------------------------------------------------

# Items of the global order: (kind, node, micro-batch, label).
_PRE, _SLICE, _REP, _ACC, _SCALE, _POST = "pre", "slice", "rep", "acc", "scale", "post"


class _Layout:
    def __init__(self, full: Program, micro: Program, facts: _Facts, labels,
                 num_microbatches: int, schedule: PipelineSchedule) -> None:
        self.full, self.micro, self.facts, self.labels = full, micro, facts, labels
        self.num_microbatches, self.schedule = num_microbatches, schedule
        # gradient -> (its matrix product, the layout ops from it to the gradient)
        self.fused = {g: found for g in facts.grads.values()
                      if (found := self._product_of(g)) is not None}
        self.skipped = {n for _, chain in self.fused.values() for n in chain}

    def _product_of(self, grad: fx.Node):
        """The `mm` a gradient is laid out from, when nothing else reads it
        or the layout ops between them, and no other micro-batch value reads
        the gradient."""
        facts, chain, node = self.facts, [], grad
        if any(user in facts.replicated for user in grad.users):
            return None
        while node.target in _LAYOUT_OPS and len(node.all_input_nodes) == 1:
            chain.insert(0, node)
            node = node.all_input_nodes[0]
        if node.target is not _aten.mm.default or node not in facts.replicated:
            return None
        if any(len(n.users) != 1 for n in [node, *chain[:-1]]):
            return None
        if len({self.labels[n] for n in [node, *chain]}) != 1:
            return None
        return node, chain

    def _is_skipped(self, node: fx.Node, m: int) -> bool:
        """Not copied per micro-batch: a fused gradient's layout ops (run once
        on the sum), and its product after the first micro-batch (the sum's
        `addmm` computes it)."""
        return node in self.skipped or (m > 0 and any(
            node is product for product, _ in self.fused.values()))

    def build(self) -> MicrobatchedStep:
        nodes = [n for n in self.micro.graph.nodes if n.op not in ("placeholder", "output")]
        replicated = [n for n in nodes if n in self.facts.replicated]
        if self.schedule is PipelineSchedule.INTERLEAVED:
            stages, self.stage_of, num_chunks = self._chunks(replicated)
        else:
            stages = list(dict.fromkeys(self.labels[n] for n in replicated))
            self.stage_of = {n: stages.index(self.labels[n]) for n in replicated}
            num_chunks = 1
        self.num_chunks = num_chunks
        order, actions = self._order(nodes, stages)
        program = self._emit(order)
        return MicrobatchedStep(program, tuple(stages), actions, self.facts.loss_reduction,
                                num_chunks)

    def _chunks(self, replicated: list[fx.Node]):
        """Interleaved 1F1B: the processes in pipeline order, each replicated
        node's virtual stage, and the chunks per process. A chunk is a maximal
        run of one process's nodes in the forward (as traced); with P
        processes and V chunks each, virtual stage v must run on process
        v mod P. The backward goes through the same chunks in reverse: a
        backward node's stage counts the process changes on its way from the
        loss (`_backward_depths`)."""
        facts, labels = self.facts, self.labels
        forward: list[Label] = []  # each run's label
        stage_of: dict[fx.Node, int] = {}
        for node in replicated:
            if node in facts.forward:
                if not forward or forward[-1] != labels[node]:
                    forward.append(labels[node])
                stage_of[node] = len(forward) - 1
        processes = list(dict.fromkeys(forward))
        num_procs = len(processes)
        names = " ".join(str(label) for label in forward)
        if len(forward) % num_procs or any(label != processes[v % num_procs]
                                           for v, label in enumerate(forward)):
            raise PlanError(
                f"schedule 'interleaved' needs each of the {num_procs} processes to hold "
                f"chunks of the forward in turn ({' '.join(map(str, processes))} "
                f"{' '.join(map(str, processes))} ...); this split's forward runs through "
                f"{names}. Place the model's pieces round-robin (rank = piece % processes), "
                f"the loss with the last piece, or use schedule='gpipe'")
        num_chunks = len(forward) // num_procs
        if num_chunks < 2:
            raise PlanError(
                f"schedule 'interleaved' runs several chunks per process, but this split "
                f"gives each of its {num_procs} processes one piece of the forward ({names}); "
                f"use schedule='1f1b', or place the model's pieces round-robin over the "
                f"processes (rank = piece % processes)")
        interleaved_rounds(num_procs, self.num_microbatches)  # refuses a count that cannot run
        last = len(forward) - 1
        for node, depth in self._backward_depths(replicated, dict(stage_of)).items():
            stage = last - depth
            if stage < 0 or labels[node] != forward[stage]:
                raise PlanError(
                    f"schedule 'interleaved': {describe_node(self.micro, node)} runs on "
                    f"{labels[node].describe()} {depth} process changes back from the loss, "
                    f"but the forward's chunks ({names}) put "
                    f"{'no chunk' if stage < 0 else forward[stage].describe()} there; the "
                    f"backward must pass through the forward's chunks in reverse. Use "
                    f"schedule='gpipe'")
            stage_of[node] = stage
        return processes, stage_of, num_chunks

    def _backward_depths(self, replicated: list[fx.Node],
                         forward_stage: dict[fx.Node, int]) -> dict[fx.Node, int]:
        """Per backward node, the process changes on the way from the loss:
        the most over its backward inputs (plus one where the input ran
        elsewhere). A node that reads no backward value (the loss's gradient
        seed, a forward value kept for the backward) starts at the chunk of
        the forward values it reads; one that reads neither takes the depth of
        its readers."""
        facts, labels = self.facts, self.labels
        last = max(forward_stage.values())
        backward = [n for n in replicated if n not in facts.forward]
        depth: dict[fx.Node, int] = {}
        for node in backward:
            found = [depth[i] + (labels[i] != labels[node])
                     for i in node.all_input_nodes if i in depth]
            chunks = [forward_stage[i] for i in node.all_input_nodes
                      if i in forward_stage and labels[i] == labels[node]]
            if found:
                depth[node] = max(found)
            elif chunks:
                depth[node] = last - max(chunks)
        for node in reversed(backward):
            if node not in depth:
                found = [depth[u] - (labels[u] != labels[node]) for u in node.users
                         if u in depth]
                depth[node] = max(0, min(found, default=0))
        return depth

    def _action(self, node: fx.Node, m: int) -> str:
        """The action a copy of `node` for micro-batch `m` belongs to."""
        phase = "F" if node in self.facts.forward else "B"
        stage = self.stage_of[node] if self.num_chunks > 1 else None
        return str(Action(stage, phase, m))

    # The combined values: each gradient, and the loss, summed over micro-batches.
    def _combined(self) -> list[tuple[str, fx.Node]]:
        return [("loss", self.facts.loss)] + [(p, g) for p, g in self.facts.grads.items()]

    def _order(self, nodes, stages):
        """The global order: shared pieces first, then every stage's actions in
        its schedule's order (one action per stage per round, so each
        action's sends leave as soon as it ends), then the optimizer."""
        facts, labels, count = self.facts, self.labels, self.num_microbatches
        pre = [(_PRE, n, None, labels.get(n)) for n in nodes
               if n in facts.needed and n not in facts.replicated]
        post = [(_POST, n, None, labels.get(n)) for n in nodes if n not in facts.needed]
        slices = []
        for placeholder in sorted(facts.batch, key=lambda n: n.name):
            readers = sorted({labels[u] for u in placeholder.users if u in facts.replicated},
                             key=Label.sort_key)
            slices += [(_SLICE, placeholder, m, label) for m in range(count) for label in readers]
        phase_nodes: dict[tuple[int, str], list[fx.Node]] = defaultdict(list)
        for node in nodes:
            if node in facts.replicated:
                phase = "F" if node in facts.forward else "B"
                phase_nodes[(self.stage_of[node], phase)].append(node)
        combined_at = {node: key for key, node in self._combined()}
        queues: dict[Label, list[list[tuple]]] = {}
        laid_out: list[tuple[str, ...]] = []
        for index, stage in enumerate(stages):
            queue, names = [], []
            for step in stage_actions(self.schedule, len(stages), index, count, self.num_chunks):
                m, pieces = step.micro, phase_nodes[(
                    index if step.stage is None else step.stage, step.phase)]
                action = [(_REP, n, m, stage) for n in pieces if not self._is_skipped(n, m)]
                for node in pieces:
                    if node in combined_at:
                        action.append((_ACC, node, m, stage))
                        if m == count - 1:
                            action.append((_SCALE, node, m, stage))
                if action:
                    queue.append(action)
                    names.append(str(step))
            queues[stage] = queue
            laid_out.append(tuple(names))
        return pre + slices + self._interleave(queues, stages) + post, tuple(laid_out)

    def _interleave(self, queues, stages) -> list[tuple]:
        done: set[tuple] = set()
        order: list[tuple] = []
        cursor = {stage: [0, 0] for stage in stages}  # (action, item within it)
        remaining = sum(len(a) for q in queues.values() for a in q)
        while remaining:
            moved = False
            for stage in stages:
                queue, (action, item) = queues[stage], cursor[stage]
                if action >= len(queue):
                    continue
                items = queue[action]
                while item < len(items) and self._ready(items[item], done):
                    done.add(self._key(items[item]))
                    order.append(items[item])
                    item, remaining, moved = item + 1, remaining - 1, True
                cursor[stage] = [action + 1, 0] if item == len(items) else [action, item]
            if not moved:
                raise PlanError(self._stuck(queues, cursor, done))
        return order

    @staticmethod
    def _key(item) -> tuple:
        kind, node, m, _ = item
        return (kind if kind in (_ACC, _SCALE) else _REP, node, m)

    def _deps(self, item) -> list[tuple]:
        kind, node, m, _ = item
        if kind == _ACC:
            product = self.fused.get(node, (node,))[0]
            if product is not node and m:
                return [(_ACC, node, m - 1)] + [(_REP, value, m) for value in
                                                 product.all_input_nodes
                                                 if value in self.facts.replicated]
            return [(_REP, product, m)] + ([(_ACC, node, m - 1)] if m else [])
        if kind == _SCALE:
            return [(_ACC, node, m)]
        return [(_REP, value, m) for value in node.all_input_nodes
                if value in self.facts.replicated]

    def _ready(self, item, done) -> bool:
        return all(dep in done for dep in self._deps(item))

    def _stuck(self, queues, cursor, done) -> str:
        waits = []
        for stage, (action, item) in cursor.items():
            if action < len(queues[stage]):
                kind, node, m, _ = queues[stage][action][item]
                missing = next(d for d in self._deps(queues[stage][action][item])
                               if d not in done)
                waits.append(f"{stage.describe()} waits at {node.name} (micro-batch {m}) "
                             f"for {missing[1].name} on {self.labels[missing[1]].describe()}")
        return (f"schedule {self.schedule.value!r} cannot run this split: "
                f"{'; '.join(waits)}. Each stage must be one contiguous piece of the "
                f"forward (put the loss on the last stage, e.g. with region()); for a "
                f"process that holds several pieces in turn use schedule='interleaved', "
                f"or use schedule='gpipe'")

    # -- the new graph --

    def _emit(self, order) -> Program:
        full, micro, facts = self.full, self.micro, self.facts
        self.graph = graph = fx.Graph()
        self.env: dict[tuple, fx.Node] = {}
        self.final: dict[fx.Node, fx.Node] = {}  # loss / grad node -> its combined value
        self.label: Label | None = None          # the process of the item being emitted
        self.combined_name = {node: key for key, node in self._combined()}
        full_placeholders = {n.name: n for n in full.graph.find_nodes(op="placeholder")}
        for node in micro.graph.find_nodes(op="placeholder"):
            new = graph.placeholder(node.name)
            assert new.name == node.name, (new.name, node.name)
            new.meta = copy.copy(full_placeholders[node.name].meta)
            self.env[(node, None)] = new
        for kind, node, m, label in order:
            self.label = label
            if kind == _SLICE:
                self._emit_slice(node, m, label)
            elif kind in (_ACC, _SCALE):
                self._emit_combined(kind, node, m, label)
            else:
                self._emit_copy(kind, node, m, label)

        outputs, specs = [], []
        returned = micro.graph.output_node().args[0]
        for spec, value in zip(micro.outputs, returned):
            new = self.final.get(value) if spec.kind is not OutputKind.STATE else None
            new = new if new is not None else self.env[(value, None)]
            outputs.append(new)
            specs.append(OutputSpec(new.name, spec.kind, spec.key))
        graph.output(tuple(outputs))
        module = fx.GraphModule(micro.graph_module, graph, class_name="MicrobatchedStep")
        return Program(module, full.inputs, tuple(specs), full.initial_state,
                       hparams_fn=full.hparams_fn,
                       grads={p: self.final[g].name for p, g in facts.grads.items()},
                       param_groups=full.param_groups,
                       non_persistent_buffers=full.non_persistent_buffers,
                       batch_input=full.batch_input)

    def _lookup(self, m):
        """Where a copy for micro-batch `m` (None: a node run once) reads `value`."""
        facts, env, final = self.facts, self.env, self.final

        def find(value: fx.Node) -> fx.Node:
            if value in final and m is None:
                return final[value]
            if value in facts.batch:
                return env[(_SLICE, value, m, self.label)]
            if value in facts.replicated:
                return env[(_REP, value, m)]
            return env[(value, None)]
        return find

    def _emit_slice(self, node: fx.Node, m: int, label: Label) -> None:
        """Micro-batch `m`'s rows of a batch input, on the process reading them."""
        value = node.meta["val"]
        rows = value.shape[0]
        new = self.graph.create_node(
            "call_function", _aten.slice.Tensor,
            (self.env[(node, None)], 0, m * rows, (m + 1) * rows), {},
            name=f"{node.name}_mb{m}_{label}")
        new.meta = {"val": value}
        set_node_annotation(new, str(label))
        self.env[(_SLICE, node, m, label)] = new

    def _emit_combined(self, kind: str, node: fx.Node, m: int, label: Label) -> None:
        """The loss or a gradient summed over the micro-batches up to `m`
        (`_ACC`; inside the matrix product for a fused gradient), or, after the
        last, laid out as the gradient is and scaled for a mean loss (`_SCALE`)."""
        graph, env = self.graph, self.env
        key = self.combined_name[node]
        base = "loss" if key == "loss" else "grad_" + key.replace(".", "_")
        tag = self._action(node, m)
        product, chain = self.fused.get(node, (None, ()))
        if kind == _ACC and product is not None:
            if m == 0:
                new = env[(_REP, product, 0)]
            else:
                factors = fx.node.map_arg(product.args, self._lookup(m))
                new = self._call(graph, _aten.addmm.default,
                                 (env[(_ACC, node, m - 1)], *factors),
                                 f"{base}_sum__{tag}", product, label)
            env[(_ACC, node, m)] = new
        elif kind == _ACC:
            value = env[(_REP, node, m)]
            new = value if m == 0 else self._call(
                graph, _aten.add.Tensor, (env[(_ACC, node, m - 1)], value),
                f"{base}_sum__{tag}", node, label)
            env[(_ACC, node, m)] = self.final[node] = new
        else:
            total = env[(_ACC, node, m)]
            for step in chain:  # lay the sum out as the gradient is
                total = self._call(graph, step.target,
                                   fx.node.map_arg(step.args, lambda _, t=total: t),
                                   f"{step.name}_sum", step, label)
            if self.facts.loss_reduction is LossReduction.MEAN:
                total = self._call(graph, _aten.mul.Tensor, (total, 1.0 / self.num_microbatches),
                                   f"{base}_mean", node, label)
            self.final[node] = total

    def _emit_copy(self, kind: str, node: fx.Node, m: int | None, label: Label | None) -> None:
        """A node copied for micro-batch `m` (`_REP`), or run once (`_PRE`, `_POST`)."""
        lookup = self._lookup(m if kind == _REP else None)
        args = fx.node.map_arg(node.args, lookup)
        kwargs = fx.node.map_arg(node.kwargs, lookup)
        if kind == _REP:
            new = self.graph.create_node(node.op, node.target, args, kwargs,
                                         name=f"{node.name}__{self._action(node, m)}")
            self.env[(_REP, node, m)] = new
        else:
            new = self.graph.create_node(node.op, node.target, args, kwargs, name=node.name)
            self.env[(node, None)] = new
        new.meta = copy.copy(node.meta)
        if label is not None:
            set_node_annotation(new, str(label))

    @staticmethod
    def _call(graph: fx.Graph, target, args, name: str, like: fx.Node, label: Label) -> fx.Node:
        new = graph.create_node("call_function", target, args, {}, name=name)
        new.meta = {"val": like.meta.get("val")}
        for key in ("custom",):
            if key in like.meta:
                new.meta[key] = copy.copy(like.meta[key])
        set_node_annotation(new, str(label))
        return new
