"""The rewrite: one rank-local copy of the step per group member, collectives
as ordinary nodes.

Every template node becomes one node per member, labelled with the member
and computing that member's local piece (local shapes: size arguments equal
to a full output shape become the local shape). Where a consumer needs a
value in another placement, the change is spelled out as nodes on each
member that read the other members' pieces:

- all-gather: member j concatenates every member's shard in rank order;
- reduce-scatter: member i slices its partial sum for every j; member j adds
  the slices it gets, in rank order;
- all-reduce: reduce-scatter, then all-gather (2(N-1)/N·|v| per rank); a value
  with no dimension divisible by N is summed whole, in rank order, and so is
  every value of a group of 2 (each member sends its whole partial sum once:
  the same |v| per rank as both halves, in one message instead of two);
- all-to-all: member i slices its shard for every j; j concatenates.

Under the `torch.distributed` backend each of these is instead one node per
member that reads only the member's own piece (`collective_ops.py`); the
runtime binds it to the group's process group. A collective's nodes for all
members sit next to each other in the graph's order, so the global order
stays a valid schedule with each collective as one step.

The GraphSplitter turns every read of another member's node into an
ordinary channel, so lint, byte counters, the text and DOT forms, loopback
and gRPC all keep working. Every sum is folded in rank order and every
member concatenates the same pieces, so replicated values stay bit-identical.

State and hyperparameters become one input per member (`l1.weight@w1`,
`lr@w1`), so each member holds its own pieces and reads its own feeds.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from ...fx_facts import value_itemsize
from ...labels import LABEL_ANNOTATION, MODULE_ANNOTATION, Label
from ...ops import collectives as collective_ops
from ...ops.collectives import CollectiveBackend, FinishGathered
from ...program import (
    InputKind,
    InputSpec,
    OutputKind,
    OutputSpec,
    Program,
    set_node_annotation,
)
from .cost import CollectiveKind, chunk_dim, redistribute_bytes, redistribute_kind
from .layout import Collective, ParallelLayout, member_key, relocate_state_dict, shard_of
from .local_ops import AfterNllLoss
from .loss_exchange import (
    VOCAB_LOG_SOFTMAX_WITH_LOSS,
    LossFromExchange,
    log_softmax_of,
    nll_of,
)
from .placement import Placement, R
from .propagate import ShardingLayout, exchange_bytes
from .registry import Exchange, tensor_args, value_shapes

__all__ = ["expand_program", "gather_shards", "fold_sum", "local_shape"]

_aten = torch.ops.aten


def gather_shards(dim: int, *pieces: torch.Tensor) -> torch.Tensor:
    """All-gather's last step: the members' shards, in rank order."""
    return torch.cat(pieces, dim)


def fold_sum(*pieces: torch.Tensor) -> torch.Tensor:
    """A reduction's last step: the members' pieces added in rank order."""
    total = pieces[0]
    for piece in pieces[1:]:
        total = total + piece
    return total


def local_shape(shape: tuple[int, ...], placement: Placement, n: int) -> tuple[int, ...]:
    if not placement.is_shard:
        return tuple(shape)
    local = list(shape)
    local[placement.dim] //= n
    return tuple(local)


class _Expander:
    def __init__(self, program: Program, layout: ShardingLayout,
                 groups: tuple[tuple[Label, ...], ...], group_of: dict[str, int],
                 backend: CollectiveBackend = CollectiveBackend.CHANNELS):
        self.program = program
        self.uses_process_groups = backend is CollectiveBackend.TORCH_DISTRIBUTED
        self.layout = layout
        self.groups = groups
        self.group_of = group_of
        self.n = len(groups[0])
        self.graph = fx.Graph()
        # (template node, position in its group) -> the member's node
        self.env: dict[tuple[fx.Node, int], fx.Node] = {}
        # values every process has (batch, hyperparameters): per reader label
        self.everywhere: dict[tuple[fx.Node, Label], fx.Node] = {}
        self.moved: dict[tuple[fx.Node, Placement], list[fx.Node]] = {}
        # An exchange's summaries, per member (one stacked node each under
        # process groups), for a loss that reads them (loss_exchange.py).
        self.exchanged: dict[fx.Node, list[tuple[fx.Node, ...]]] = {}
        self.transfers: set[tuple] = set()
        self.collectives: list[Collective] = []
        self.inputs: list[InputSpec] = []
        self.origin: dict[str, fx.Node] = {}  # new placeholder name -> template node
        self.naming = ""  # the template node whose pieces are being made
        loss = next((s.node for s in program.outputs if s.kind is OutputKind.LOSS), None)
        self.forward = self._ancestors(loss)

    def _ancestors(self, name: str | None) -> set[str]:
        if name is None:
            return set()
        nodes = {n.name: n for n in self.program.graph.nodes}
        found, stack = set(), [nodes[name]]
        while stack:
            node = stack.pop()
            if node.name in found:
                continue
            found.add(node.name)
            stack.extend(node.all_input_nodes)
        return found

    # -- new nodes --

    def _call(self, label: Label, target: Callable, args: tuple, module: str | None) -> fx.Node:
        """A helper node for the value being rewritten (`self.naming`), named
        `VALUE__HELPER__MEMBER` so plans and pictures say what it serves."""
        helper = getattr(target, "__name__", "op")
        node = self.graph.create_node("call_function", target, args, {},
                                      name=f"{self.naming}__{helper}__{label}")
        set_node_annotation(node, str(label))
        if module:
            set_node_annotation(node, module, MODULE_ANNOTATION)
        return node

    def placement(self, node: fx.Node) -> Placement:
        return self.layout.placement(node.name)

    # -- the pass --

    def run(self) -> tuple[fx.Graph, list[InputSpec], list[OutputSpec]]:
        program = self.program
        for node in program.graph.nodes:
            if node.op == "placeholder":
                self._placeholder(node)
            elif node.op == "get_attr":
                attr = self.graph.get_attr(node.target)
                for group in self.groups:
                    for label in group:
                        self.everywhere[(node, label)] = attr
            elif node.op == "call_function":
                self._copy(node)
        outputs = self._outputs()
        return self.graph, self.inputs, outputs

    def _placeholder(self, node: fx.Node) -> None:
        spec = self.program.input_spec(node.name)
        placement = self.placement(node)
        if spec.kind is InputKind.BATCH:
            shared = self.graph.placeholder(node.name)
            self.origin[shared.name] = node
            self.inputs.append(InputSpec(shared.name, spec.kind, spec.key))
            self.naming = node.name
            for group in self.groups:
                for j, label in enumerate(group):
                    self.everywhere[(node, label)] = shared if not placement.is_shard else \
                        self._call(label, shard_of, (shared, placement.dim, j, self.n), None)
            return
        if spec.kind is InputKind.HPARAM:  # every member reads its own feed
            for group in self.groups:
                for label in group:
                    new = self.graph.placeholder(f"{node.name}_{label}")
                    set_node_annotation(new, str(label))
                    self.origin[new.name] = node
                    self.inputs.append(InputSpec(new.name, spec.kind, member_key(spec.key, label)))
                    self.everywhere[(node, label)] = new
            return
        for j, member in enumerate(self.groups[self.group_of[node.name]]):
            new = self.graph.placeholder(f"{node.name}_{member}")
            set_node_annotation(new, str(member))
            self.origin[new.name] = node
            param = None if spec.param is None else member_key(spec.param, member)
            self.inputs.append(InputSpec(new.name, spec.kind, member_key(spec.key, member),
                                         param))
            self.env[(node, j)] = new

    def _copy(self, node: fx.Node) -> None:
        module = self.program.module_of(node)
        group = self.groups[self.group_of[node.name]]
        self.naming = node.name
        if node.target is operator.getitem:
            for j, label in enumerate(group):
                self.env[(node, j)] = self._call(
                    label, operator.getitem, (self.env[(node.args[0], j)], node.args[1]), module)
            return
        strategy = self.layout.strategies[node.name]
        args = tensor_args(node)
        full_out = value_shapes(node)[0]
        local_out = local_shape(full_out, strategy.outputs[0], self.n)
        summaries: list[fx.Node] = []
        finishing: list[tuple] = []
        for j in range(self.n):
            mapped = {}
            for position, arg in enumerate(args):
                if arg not in mapped:
                    mapped[arg] = self._local(arg, strategy.inputs[position], group[j], node)
            new_args = fx.node.map_arg(node.args, mapped.__getitem__)
            new_kwargs = fx.node.map_arg(node.kwargs, mapped.__getitem__)
            if local_out != full_out:
                new_args = _localise_sizes(new_args, full_out, local_out)
            self.naming = node.name
            if isinstance(strategy.local, Exchange):
                extra = ()
                if strategy.local is VOCAB_LOG_SOFTMAX_WITH_LOSS:  # the loss's target rides along
                    nll = nll_of(node)
                    extra = (self._local(nll.args[1], R, group[j], node), nll.args[4])
                summaries.append(self._call(group[j], strategy.local.summarise,
                                            (j, self.n, *new_args, *extra), module))
                finishing.append(new_args)
                continue
            name = f"{node.name}__{group[j]}"
            if isinstance(strategy.local, LossFromExchange):
                new_args = (*new_args, *self.exchanged[log_softmax_of(node)][j])
            if isinstance(strategy.local, AfterNllLoss):
                extra = tuple(self._local(a, R, group[j], node) if isinstance(a, fx.Node) else a
                              for a in strategy.local.extra_args(node))
                new_args = (*new_args, *extra)
            if strategy.local is not None:
                new = self.graph.create_node("call_function", strategy.local,
                                             (j, self.n, *new_args), new_kwargs, name=name)
            else:
                new = self.graph.create_node("call_function", node.target, new_args,
                                             new_kwargs, name=name)
            self.naming = node.name
            custom = {k: v for k, v in (node.meta.get("custom") or {}).items()
                      if k != LABEL_ANNOTATION}
            new.meta["custom"] = custom
            set_node_annotation(new, str(group[j]))
            self.env[(node, j)] = new
        if summaries:
            self._finish_exchange(node, group, strategy, summaries, finishing, module)

    def _finish_exchange(self, node, group, strategy, summaries, finishing, module) -> None:
        """Every member reads every member's summary (in rank order) and finishes."""
        exchange = strategy.local
        self.naming = node.name
        if self.uses_process_groups:  # one all-gather of the summaries, then finish
            index = self.group_of[node.name]
            gathered = [self._call(group[j], collective_ops.all_gather_stacked,
                                   (summaries[j], index, self.n), module)
                        for j in range(self.n)]
            finish = FinishGathered(exchange.finish)
            for j in range(self.n):
                self.env[(node, j)] = self._call(
                    group[j], finish, (j, self.n, tuple(finishing[j]), gathered[j]), module)
            self.exchanged[node] = [(gathered[j],) for j in range(self.n)]
        else:
            self.exchanged[node] = [tuple(summaries)] * self.n
            for j in range(self.n):
                self.env[(node, j)] = self._call(
                    group[j], exchange.finish, (j, self.n, tuple(finishing[j]), *summaries),
                    module)
        nbytes = int(exchange_bytes(node, strategy, self.n))
        self.collectives.append(Collective(
            CollectiveKind.EXCHANGE, node.name, strategy.inputs[0], strategy.outputs[0],
            nbytes, node.name in self.forward))

    def _local(self, value: fx.Node, need: Placement, reader_label: Label,
               reader: fx.Node | None) -> fx.Node:
        """`value` as `reader_label` (a member of some group) needs it. Between
        two groups, member j reads member j's piece of the same placement."""
        have = self.placement(value)
        if value.name not in self.group_of:  # batch, hyperparameters, constants
            self.naming = value.name
            local = self.everywhere[(value, reader_label)]
            if have == need:
                return local
            assert have.is_replicate, (value.name, have, need)
            position = self._position(reader_label)
            if need.is_partial:  # member 0 keeps the value, the others add zeros
                return local if position == 0 else self._call(
                    reader_label, _aten.zeros_like.default, (local,), None)
            return self._call(reader_label, shard_of, (local, need.dim, position, self.n), None)
        position = self._position(reader_label)
        source = self.group_of[value.name]
        if source != self.group_of.get(reader.name if reader is not None else "", source) \
                or reader is None and reader_label not in self.groups[source]:
            self._note_transfer(value, need, reader_label, reader)
        if have == need:
            return self.env[(value, position)]
        key = (value, need)
        if key not in self.moved:
            self.moved[key] = self._redistribute(value, have, need, reader)
        return self.moved[key][position]

    def _note_transfer(self, value: fx.Node, need: Placement, reader_label: Label,
                       reader: fx.Node | None) -> None:
        """Record a move to another group once: member j sends member j its piece."""
        target = next(i for i, g in enumerate(self.groups) if reader_label in g)
        key = (value, need, target)
        if key in self.transfers:
            return
        self.transfers.add(key)
        shape, itemsize = value_shapes(value)[0], value_itemsize(value)
        size = itemsize * math.prod(shape)
        nbytes = size if need.is_shard else self.n * size
        is_forward = reader is not None and reader.name in self.forward
        self.collectives.append(Collective(CollectiveKind.GROUP_TO_GROUP, value.name, need,
                                           need, nbytes, is_forward))

    def _position(self, label: Label) -> int:
        for group in self.groups:
            if label in group:
                return group.index(label)
        raise AssertionError(label)

    def _redistribute(self, value: fx.Node, have: Placement, need: Placement,
                      reader: fx.Node | None) -> list[fx.Node]:
        kind = redistribute_kind(have, need)
        n = self.n
        group = self.groups[self.group_of[value.name]]
        self.naming = value.name
        pieces = [self.env[(value, j)] for j in range(n)]
        module = self.program.module_of(value)
        shape = value_shapes(value)[0]
        itemsize = value_itemsize(value)
        if kind not in (CollectiveKind.SLICE, CollectiveKind.ZERO_OTHERS):
            nbytes = int(redistribute_bytes(have, need, shape, itemsize, n))
            is_forward = reader is not None and reader.name in self.forward
            self.collectives.append(Collective(kind, value.name, have, need, nbytes, is_forward))
        if kind is CollectiveKind.SLICE:
            return [self._call(group[j], shard_of, (pieces[j], need.dim, j, n), module)
                    for j in range(n)]
        if kind is CollectiveKind.ZERO_OTHERS:
            zeros = _aten.zeros_like.default
            return [pieces[0]] + [self._call(group[j], zeros, (pieces[j],), module)
                                  for j in range(1, n)]
        if self.uses_process_groups:
            return self._on_process_group(kind, have, need, group, pieces, module)
        if kind is CollectiveKind.ALL_GATHER:
            return [self._call(group[j], gather_shards, (have.dim, *pieces), module)
                    for j in range(n)]
        if kind is CollectiveKind.REDUCE_SCATTER:
            return self._reduce_scatter(group, pieces, need.dim, module)
        if kind is CollectiveKind.ALL_TO_ALL:
            sliced = [[self._call(group[i], shard_of, (pieces[i], need.dim, j, n), module)
                       for j in range(n)] for i in range(n)]
            return [self._call(group[j], gather_shards,
                               (have.dim, *[sliced[i][j] for i in range(n)]), module)
                    for j in range(n)]
        assert kind is CollectiveKind.ALL_REDUCE, kind
        dim = chunk_dim(shape, n)
        if dim is None or n == 2:  # 2 members: the same bytes in one message each
            return [self._call(group[j], fold_sum, tuple(pieces), module) for j in range(n)]
        reduced = self._reduce_scatter(group, pieces, dim, module)
        return [self._call(group[j], gather_shards, (dim, *reduced), module) for j in range(n)]

    def _on_process_group(self, kind: CollectiveKind, have: Placement, need: Placement,
                          group, pieces, module) -> list[fx.Node]:
        """One collective node per member, each reading only its own piece."""
        n, index = self.n, self.groups.index(group)
        if kind is CollectiveKind.ALL_GATHER:
            target, extra = collective_ops.all_gather, (have.dim,)
        elif kind is CollectiveKind.REDUCE_SCATTER:
            target, extra = collective_ops.reduce_scatter, (need.dim,)
        elif kind is CollectiveKind.ALL_TO_ALL:
            target, extra = collective_ops.all_to_all, (have.dim, need.dim)
        else:
            assert kind is CollectiveKind.ALL_REDUCE, kind
            target, extra = collective_ops.all_reduce, ()
        return [self._call(group[j], target, (pieces[j], *extra, index, n), module)
                for j in range(n)]

    def _reduce_scatter(self, group, pieces, dim: int, module) -> list[fx.Node]:
        n = self.n
        sliced = [[self._call(group[i], shard_of, (pieces[i], dim, j, n), module) for j in range(n)]
                  for i in range(n)]
        return [self._call(group[j], fold_sum, tuple(sliced[i][j] for i in range(n)), module)
                for j in range(n)]

    def _outputs(self) -> list[OutputSpec]:
        program = self.program
        returned = program.graph.output_node().args[0]
        outputs: list[OutputSpec] = []
        values: list[fx.Node] = []
        nodes = {n.name: n for n in program.graph.nodes}
        for spec, value in zip(program.outputs, returned):
            if spec.kind is not OutputKind.STATE:
                first = self.groups[self.group_of.get(value.name, 0)][0]
                node = self._local(value, R, first, None)
                outputs.append(OutputSpec(node.name, spec.kind, spec.key))
                values.append(node)
                continue
            slot = nodes[program.input_for_key(spec.key).node]
            need = self.placement(slot)
            for member in self.groups[self.group_of[slot.name]]:
                node = self._local(value, need, member, None)
                outputs.append(OutputSpec(node.name, spec.kind, member_key(spec.key, member)))
                values.append(node)
        self.graph.output(tuple(values))
        return outputs


def _localise_sizes(args, full: tuple[int, ...], local: tuple[int, ...]):
    """Size arguments equal to the full output shape become the local shape."""
    def swap(arg):
        if isinstance(arg, (list, tuple)) and len(arg) == len(full) and \
                all(isinstance(a, int) for a in arg) and tuple(arg) == full:
            return type(arg)(local)
        return arg
    return tuple(swap(a) for a in args)


def _propagate_values(gm: fx.GraphModule, program: Program, inputs: list[InputSpec],
                      expanded_shapes: dict[str, tuple]) -> None:
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = []
    for spec in inputs:
        shape, dtype = expanded_shapes[spec.node]
        fakes.append(mode.from_tensor(torch.empty(shape, dtype=dtype)))
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fakes)


def expand_program(program: Program, layout: ShardingLayout,
                   groups: tuple[tuple[Label, ...], ...], group_of: dict[str, int],
                   backend: CollectiveBackend = CollectiveBackend.CHANNELS
                   ) -> tuple[Program, ParallelLayout]:
    """The program every member runs its piece of, and what was decided.

    `group_of` maps every template node but the batch and hyperparameter
    inputs to the index of the group that runs it; groups have equal sizes.
    `backend` says how collectives travel (module docstring).
    """
    expander = _Expander(program, layout, groups, group_of, backend)
    graph, inputs, outputs = expander.run()
    gm = fx.GraphModule(program.graph_module, graph, class_name="ParallelStep")

    n = len(groups[0])
    shapes: dict[str, tuple] = {}
    for spec in inputs:
        original = expander.origin[spec.node]
        value = original.meta["val"]
        placement = layout.placement(original.name)
        shape = tuple(value.shape) if spec.kind is InputKind.BATCH else \
            local_shape(tuple(value.shape), placement, n)
        shapes[spec.node] = (shape, value.dtype)
    _propagate_values(gm, program, inputs, shapes)

    nodes = {node.name: node for node in program.graph.nodes}
    state_placement: dict[str, Placement] = {}
    state_shapes: dict[str, tuple] = {}
    for spec in program.inputs:
        if spec.kind.is_state:
            state_placement[spec.key] = layout.placement(spec.node)
            state_shapes[spec.key] = tuple(nodes[spec.node].meta["val"].shape)
    state_group = {spec.key: group_of[spec.node] for spec in program.inputs
                   if spec.kind.is_state}
    parallel = ParallelLayout(groups, layout, state_placement, state_shapes, state_group,
                              tuple(expander.collectives), backend)
    original_hparams = program.hparams_fn

    def hparams(step: int) -> dict[str, torch.Tensor]:
        feeds = {} if original_hparams is None else original_hparams(step)
        return {member_key(k, m): v for k, v in feeds.items()
                for group in groups for m in group}

    initial = relocate_state_dict(parallel, program.initial_state) if program.initial_state \
        else {}
    # The captured program's facts (gradient nodes, param groups) name its own
    # nodes and keys; the members' program has other names, so it keeps none.
    expanded = dataclasses.replace(
        program, graph_module=gm, inputs=tuple(inputs), outputs=tuple(outputs),
        initial_state=initial, hparams_fn=hparams if original_hparams is not None else None,
        grads={}, sparse_grads={}, param_groups=(), cached_tables={})
    return expanded, parallel
