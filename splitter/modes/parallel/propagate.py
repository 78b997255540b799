"""Sharding propagation: a placement for every value of a captured step.

`propagate(program, group_size, pins, policy)` turns the step's graph into a
`solver.Problem` (one variable per op or state input, the candidates from the
registry, edge costs from `cost.py`), solves it under the policy and returns a
`ShardingLayout`: the strategy of every node, what it costs, and why.

Pinned values (from `constrain`, `shard`, the parallel layers and the mode's
`parameter_plan`) keep their placement. A parameter's optimizer state is the
same variable as the parameter, so it always takes its placement; the new
value of a state slot must come out with the slot's placement (else the
difference is paid for), and the loss must come out whole.

The objective is bytes per step plus, when asked, a fixed cost per
collective (`collective_cost`: the α of the α-β model, in bytes, all members
together): every collective is a round of messages whose latency does not
shrink with its size, so a layout that sends a little less in more
collectives is not better. The layout reports the bytes alone.
"""

from __future__ import annotations

import functools
import logging
import operator
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import fx

from ...fx_facts import op_packet, value_itemsize
from ...program import InputKind, InputSpec, OutputKind, Program, node_annotation
from .cost import INFEASIBLE, CollectiveKind, bytes_of, redistribute_bytes, redistribute_kind
from .loss_exchange import fuse_loss_exchange, log_softmax_of
from .placement import Placement, R, S, ShardingError, to_placement
from .registry import Exchange, OpStrategy, has_strategy, strategies_for, tensor_args, value_shapes
from .solver import Policy, Problem, Use, Value, local_costs, solve, total_cost

__all__ = ["PLACEMENT_ANNOTATION", "exchange_bytes", "ShardingLayout", "propagate", "build_problem"]

logger = logging.getLogger(__name__)

# The node annotation `constrain()` leaves: a placement's text form.
PLACEMENT_ANNOTATION = "splitrun.placement"

_aten = torch.ops.aten
_FOLLOWER_OPS = frozenset({
    _aten.t, _aten.view, _aten._unsafe_view, _aten.reshape, _aten.transpose, _aten.permute,
    _aten.detach, _aten.alias, _aten.clone, _aten.unsqueeze, _aten.squeeze, _aten.expand,
})


@dataclass(frozen=True)
class ShardingLayout:
    """The chosen strategy of every node of the template (placeholders and
    getitems included, as strategies with no inputs)."""

    group_size: int
    policy: Policy
    strategies: dict[str, OpStrategy]
    cost_bytes: float
    # Per node: (candidate, bytes with the others fixed), for `explain()`.
    alternatives: dict[str, tuple[tuple[OpStrategy, float], ...]] = field(
        default_factory=dict, compare=False, repr=False)

    def placement(self, node: str, index: int = 0) -> Placement:
        return self.strategies[node].outputs[index]

    def explain(self) -> str:
        lines = [f"{self.policy.value} layout over {self.group_size} workers: "
                 f"{self.cost_bytes:.0f} bytes per step"]
        for name, strategy in self.strategies.items():
            options = self.alternatives.get(name, ())
            chosen = next((b for s, b in options if s == strategy), 0)
            others = ", ".join(f"{s} {b:.0f} B" for s, b in options if s != strategy)
            line = f"  {name}: {strategy} ({chosen:.0f} B)"
            lines.append(line + (f"; alternatives: {others}" if others else ""))
        return "\n".join(lines)


@dataclass
class _Vars:
    nodes: list[fx.Node] = field(default_factory=list)      # the variable's node
    candidates: list[list[OpStrategy]] = field(default_factory=list)
    var_of: dict[fx.Node, tuple[int, int]] = field(default_factory=dict)  # node -> (var, output)

    def add(self, node: fx.Node, candidates: list[OpStrategy]) -> int:
        self.nodes.append(node)
        self.candidates.append(candidates)
        self.var_of[node] = (len(self.nodes) - 1, 0)
        return len(self.nodes) - 1


def _pin_of(node: fx.Node, pins: dict[str, Placement], ndim: int, n: int) -> Placement | None:
    if node.name in pins:
        return pins[node.name]
    text = node_annotation(node, PLACEMENT_ANNOTATION)
    if text is None:
        return None
    return to_placement(text, group_size=n, ndim=ndim, what=f"node {node.name}")


def _check_even(node: fx.Node, placement: Placement, n: int, what: str) -> None:
    shape = value_shapes(node)[0]
    if placement.is_shard:
        if placement.dim >= len(shape):
            raise ShardingError(
                f"{what} has shape {list(shape)}, it has no dimension {placement.dim} to "
                f"shard on")
        size = shape[placement.dim]
        if size % n:
            raise ShardingError(
                f"{what} of shape {list(shape)} cannot be split evenly: dimension "
                f"{placement.dim} has size {size}, not a multiple of the group size {n}; "
                f"choose a size divisible by {n}, another dimension, or a group of a "
                f"size that divides {size}")


def _state_candidates(node: fx.Node, n: int) -> list[OpStrategy]:
    shape = value_shapes(node)[0]
    found = [OpStrategy((R,), ())]
    found += [OpStrategy((S(d),), ()) for d, size in enumerate(shape)
              if size % n == 0 and size >= n]
    return found


def _param_of(spec: InputSpec, program: Program) -> str | None:
    """The node of the parameter an optimizer state belongs to."""
    return None if spec.param is None else program.input_for_key(spec.param).node


def build_problem(program: Program, group_size: int, pins: dict[str, Placement] | None = None,
                  group_of: dict[str, int] | None = None, collective_cost: float = 0.0
                  ) -> tuple[Problem, _Vars]:
    """The step as a `Problem`; `pins` maps node names to fixed placements;
    `group_of` (pipeline + tensor parallel) the group that runs each node: a
    value read by another group also pays for the move, member j to member j.
    `collective_cost`: added for every collective (module docstring).

    Raises `ShardingError` for a pin that cannot be honoured (uneven, or an
    op that cannot produce it).
    """
    n = group_size
    pins = dict(pins or {})
    _pin_parameters_through_constraints(program, pins, n)
    vars_ = _variables(program, pins, n)
    unary = [[_with_latency(float(exchange_bytes(node, c, n)), collective_cost) for c in cands]
             for node, cands in zip(vars_.nodes, vars_.candidates)]
    values, followers = _values(program, vars_, n, group_of, collective_cost)
    problem = Problem([len(c) for c in vars_.candidates], list(values.values()), unary,
                      dict(followers))
    return problem, vars_


def _variables(program: Program, pins: dict[str, Placement], n: int) -> _Vars:
    """One variable per state input, constant and call, with the placements it
    may take (its pin's alone where pinned); a getitem shares its tuple's
    variable, optimizer state its parameter's."""
    graph = program.graph
    nodes = {node.name: node for node in graph.nodes}
    vars_ = _Vars()
    # State inputs first pass: optimizer state joins its parameter's variable.
    tied: dict[fx.Node, fx.Node] = {}
    for spec in program.inputs:
        if spec.kind is InputKind.OPT_STATE:
            param = _param_of(spec, program)
            if param is not None:
                tied[nodes[spec.node]] = nodes[param]
    for node in graph.nodes:
        if node.op == "placeholder":
            if node not in tied:
                vars_.add(node, _input_candidates(program, node, pins, n))
        elif node.op == "get_attr":
            vars_.add(node, [OpStrategy((R,), ())])
        elif node.op == "call_function":
            if node.target is operator.getitem:
                var, _ = vars_.var_of[node.args[0]]
                vars_.var_of[node] = (var, node.args[1])
                continue
            vars_.add(node, _call_candidates(program, node, pins, n))
    for node, param in tied.items():
        vars_.var_of[node] = vars_.var_of[param]
    return vars_


def _input_candidates(program: Program, node: fx.Node, pins: dict[str, Placement],
                      n: int) -> list[OpStrategy]:
    spec = program.input_spec(node.name)
    shape = value_shapes(node)[0]
    pin = _pin_of(node, pins, len(shape), n)
    what = f"{spec.kind.value} {spec.key!r}"
    if pin is not None:
        if pin.is_partial:
            raise ShardingError(f"{what} is pinned to P; an input can be R or S(d)")
        _check_even(node, pin, n, what)
        return [OpStrategy((pin,), ())]
    if spec.kind is InputKind.HPARAM:
        return [OpStrategy((R,), ())]
    return _state_candidates(node, n)


def _call_candidates(program: Program, node: fx.Node, pins: dict[str, Placement],
                     n: int) -> list[OpStrategy]:
    if not has_strategy(node):
        logger.warning(
            "parallel mode: no sharding strategy for %s (module %r); it runs "
            "replicated", node.target, program.module_of(node) or "?")
    candidates = strategies_for(node, n)
    shape = value_shapes(node)
    pin = _pin_of(node, pins, len(shape[0]), n)
    if pin is not None:
        _check_even(node, pin, n, f"node {node.name} (module "
                                  f"{program.module_of(node) or '?'!r})")
        candidates = [c for c in candidates if c.outputs[0] == pin]
        if not candidates:
            raise ShardingError(
                f"node {node.name} ({node.target}, module "
                f"{program.module_of(node) or '?'!r}) is pinned to {pin}, but the op "
                f"cannot produce that placement; pin its input instead")
    return candidates


def _values(program: Program, vars_: _Vars, n: int, group_of: dict[str, int] | None,
            collective_cost: float) -> tuple[dict[fx.Node, Value], dict[int, list[int]]]:
    """Every value read, with each use's needed placements (an op's inputs, a
    state slot's new value, the loss and gradients coming out whole), and the
    variables that follow their one producer's placement."""
    graph = program.graph
    nodes = {node.name: node for node in graph.nodes}
    values: dict[fx.Node, Value] = {}
    followers: dict[int, list[int]] = defaultdict(list)

    def value_of(node: fx.Node) -> Value:
        found = values.get(node)
        if found is None:
            src, index = vars_.var_of[node]
            shape, size = value_shapes(node)[0], value_itemsize(node)
            # A class-sharded loss rides on its log-softmax's exchange
            # (loss_exchange.py): its P -> R sends bytes but is no collective.
            own_round = 0.0 if _is_exchanged_loss(node) else collective_cost
            found = values[node] = Value(
                src, tuple(c.outputs[index] for c in vars_.candidates[src]), [],
                functools.partial(_redistribute_cost, shape=shape, itemsize=size, n=n,
                                  collective_cost=own_round))
        return found

    for var, node in enumerate(vars_.nodes):
        if node.op != "call_function":
            continue
        seen: dict[fx.Node, int] = {}
        for position, arg in enumerate(tensor_args(node)):
            seen.setdefault(arg, position)
        for arg, position in seen.items():
            needs = tuple(c.inputs[position] for c in vars_.candidates[var])
            if group_of is not None and _crosses(group_of, arg, node):
                needs = tuple((_CROSS, p) for p in needs)
            value_of(arg).uses.append(Use(var, needs))
        producers = {vars_.var_of[a][0] for a in seen}
        if len(producers) == 1 and op_packet(node) in _FOLLOWER_OPS:
            followers[next(iter(producers))].append(var)

    returned = graph.output_node().args[0]
    for spec, node in zip(program.outputs, returned):
        value = value_of(node)
        if spec.kind is OutputKind.STATE:
            dst, _ = vars_.var_of[nodes[program.input_for_key(spec.key).node]]
            if dst != value.src:
                value.uses.append(Use(dst, tuple(c.outputs[0] for c in vars_.candidates[dst])))
        else:  # the loss (and gradients asked for) come out whole
            value.uses.append(Use(-1, (R,)))
    return values, followers


def _is_exchanged_loss(node: fx.Node) -> bool:
    """`node` is the loss of an nll_loss that `fuse_loss_exchange` can fuse."""
    return (node.target is operator.getitem and node.args[1] == 0
            and log_softmax_of(node.args[0]) is not None)


def exchange_bytes(node: fx.Node, strategy: OpStrategy, n: int) -> int:
    """Bytes a strategy's own exchange sends per step (0 for most)."""
    if not isinstance(strategy.local, Exchange):
        return 0
    shapes = [value_shapes(a)[0] for a in tensor_args(node)]
    return strategy.local.bytes(node, shapes, value_itemsize(node), n)


_CROSS = "to another group"


def _crosses(group_of: dict[str, int], value: fx.Node, reader: fx.Node) -> bool:
    source = group_of.get(_producer(value).name)
    return source is not None and source != group_of.get(reader.name, source)


def _producer(node: fx.Node) -> fx.Node:
    return node.args[0] if node.target is operator.getitem else node


_COLLECTIVES = frozenset({CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER,
                          CollectiveKind.ALL_REDUCE, CollectiveKind.ALL_TO_ALL})


def _with_latency(nbytes: float, collective_cost: float) -> float:
    """An exchange's cost: its bytes, and one collective's fixed cost if it sends."""
    return nbytes + collective_cost if nbytes > 0 else nbytes


def _redistribute_cost(made: Placement, needed, *, shape, itemsize: int, n: int,
                       collective_cost: float = 0.0) -> float:
    cross = isinstance(needed, tuple)  # to another group: member j sends j its piece
    placement = needed[1] if cross else needed
    cost = redistribute_bytes(made, placement, shape, itemsize, n)
    if collective_cost and n > 1 and redistribute_kind(made, placement) in _COLLECTIVES:
        cost += collective_cost
    if cross:
        size = itemsize
        for extent in shape:
            size *= extent
        cost += (size if placement.is_shard else n * size) + collective_cost
    return cost




def _pin_parameters_through_constraints(program: Program, pins: dict[str, Placement],
                                        n: int) -> None:
    """`constrain(param, ...)` (what `shard(parameter_plan=...)` and the parallel
    layers do) pins the parameter itself, not only its view."""
    for spec in program.inputs:
        if spec.kind is not InputKind.PARAM or spec.node in pins:
            continue
        node = next(iter(program.graph.find_nodes(op="placeholder", target=spec.node)), None)
        if node is None:
            continue
        for user in node.users:
            text = node_annotation(user, PLACEMENT_ANNOTATION)
            if text is not None and op_packet(user) in (_aten.view, _aten.alias):
                shape = value_shapes(node)[0]
                pins[spec.node] = to_placement(text, group_size=n, ndim=len(shape),
                                               what=f"parameter {spec.key!r}")
                break


def propagate(program: Program, group_size: int, pins: dict[str, Placement] | None = None,
              policy: Policy | str = Policy.GLOBAL, group_of: dict[str, int] | None = None,
              collective_cost: float = 0.0) -> ShardingLayout:
    """Choose every value's placement under `policy`; see the module docstring.
    `collective_cost`: bytes (all members together) each collective costs on
    top of what it sends, when choosing; the layout's costs are bytes alone."""
    policy = Policy.parse(policy)
    problem, vars_ = build_problem(program, group_size, pins, group_of, collective_cost)
    choice = solve(problem, policy)
    if collective_cost:  # report bytes: the same choice, costed without the latency
        problem, _ = build_problem(program, group_size, pins, group_of)
    cost = total_cost(problem, choice)
    if cost == INFEASIBLE:
        raise ShardingError("no feasible placement: a pinned value needs a partial sum "
                            "turned back into a shard of another value")
    strategies: dict[str, OpStrategy] = {}
    alternatives: dict[str, tuple] = {}
    for var, node in enumerate(vars_.nodes):
        strategies[node.name] = vars_.candidates[var][choice[var]]
        costs = local_costs(problem, choice, var)
        alternatives[node.name] = tuple(zip(vars_.candidates[var], costs))
    for node, (var, index) in vars_.var_of.items():
        if node.name not in strategies:
            out = vars_.candidates[var][choice[var]].outputs[index]
            strategies[node.name] = OpStrategy((out,), ())
    ordered = {node.name: strategies[node.name] for node in program.graph.nodes
               if node.name in strategies}
    ordered = fuse_loss_exchange(program.graph, ordered)
    return ShardingLayout(group_size, policy, ordered, bytes_of(cost), alternatives)
