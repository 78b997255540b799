"""Parameter-server mode: W workers run one worker subgraph on their own data
shards; parameters and their optimizer live on S servers.

prebuild (graph): every trainable parameter goes to a server (the one it was
placed on with `place(..., role="server", rank=K)`, else spread across servers
by bytes, deterministically); its optimizer update runs there; all other ops run
on the worker template, worker 0. For W >= 2 each server-side gradient gets one
slot per worker feeding a gradient-accumulation node: a sum in worker order,
then the mean.

fuse: one message per (worker, server) per direction per step: parameters go
out at step start (data-sync), gradients (and, from worker 0, the learning rate
and step count) come back after the backward. With `gradient_bucket_bytes`,
gradients instead leave in buckets as the backward produces them (once a
bucket holds that many bytes), and each server update runs as soon as its
bucket is in: servers update while workers are still in their backward, as
DDP overlaps its all-reduce with it. Same ops, same results; more messages.

postbuild (plan): the template's schedule is given to every worker with its own
channels; each server receives one copy of every gradient message per worker,
binding worker r's gradient to slot r.

Staleness (`staleness=s`, stale-synchronous parallel, Ho et al. 2013), the
exact rule. Version v of a server's parameters is its state after the updates
of clocks (steps) 0 .. v-1; the update of clock c is the synchronous one: the
mean over all W workers of their clock-c gradients, applied by the optimizer
once all W have arrived (per clock, not per worker: so s=0 is the synchronous
mode itself, and the optimizer sees one averaged gradient per step). Worker w
computes its clock-c gradient on version v(w, c), where

    c - s <= v(w, c) <= c

and v(w, c) is the newest version that has reached the worker when its step
c starts (each server sends version c at the start of its step c). A worker
blocks only when the newest version it holds is older than c - s; the bound
holds per server (a worker may read different versions from two servers).
With s=0 the plan is the synchronous plan, bit for bit. Update applied at
clock c: x_{c+1} = opt(x_c, mean_w g_w(x_{v(w,c)})). With dense parameters
on the workers (dense="worker"), those are all-reduced every step as before
(exact), and the bound applies to the servers' embedding rows alone. The
embedding cache's `max_staleness` is the same rule for cached rows.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import fx

from ..errors import PlanError
from ..fx_facts import value_nbytes
from ..labels import ANY_SERVER, MODULE_ANNOTATION, Cluster, Label, Role
from ..ops.bags import is_bag_gradient
from ..ops.sparse_updates import coalesce
from ..plan.model import Channel, ChannelKind, DataSync, Instruction, ModeKind, OpKind, SplitPlan
from ..program import (
    InputKind,
    OutputSpec,
    Program,
    node_annotation,
    set_node_annotation,
)
from ..splitting.mode import ChannelDraft, Edge, Mode, ModeArtifacts, fuse_by_source_segment
from .dense_placement import DensePlacement, average_dense_gradients

__all__ = ["ParameterServerMode", "ServerAssignment", "gradient_slot", "assign_servers"]

logger = logging.getLogger(__name__)

_aten = torch.ops.aten
_OPTIMIZER_PREFIX = "optimizer."


def gradient_slot(grad: torch.Tensor, worker: int) -> torch.Tensor:
    """Stands for worker `worker`'s copy of `grad` on the gradient's server.

    Never runs: the plan binds the tensor received from that worker to this
    node's name.
    """
    raise PlanError(f"gradient slot of worker {worker} was executed instead of received")


def assign_servers(sizes: dict[str, int], pinned: dict[str, int], num_servers: int
                   ) -> dict[str, int]:
    """Server of every parameter: pinned ones where pinned, the others largest
    first onto the server holding the fewest bytes (ties: lowest rank)."""
    load = [0] * num_servers
    owner = dict(pinned)
    for name, server in pinned.items():
        load[server] += sizes[name]
    for name in sorted((n for n in sizes if n not in pinned), key=lambda n: (-sizes[n], n)):
        server = min(range(num_servers), key=lambda s: (load[s], s))
        owner[name] = server
        load[server] += sizes[name]
    return owner


@dataclass(frozen=True)
class ServerAssignment(ModeArtifacts):
    """Which server owns each trainable parameter, and, per server-side
    gradient node, the names of its per-worker receive slots (in worker order;
    empty with one worker)."""

    owner: Mapping[str, int]
    slots: Mapping[str, tuple[str, ...]]


class ParameterServerMode(Mode):
    """`gradient_bucket_bytes`: None (the default) sends each worker's gradients
    to a server in one message after the backward; N sends them in buckets of
    at least N bytes as the backward produces them, each server updating as
    its buckets come in (see the module's docstring).

    `dense`: "server" (the default) keeps every parameter on the servers;
    "worker" keeps parameters with dense gradients on every worker, averaged
    between the workers by an all-reduce each step, and only embedding rows
    (sparse gradients) on the servers (`dense_placement`).

    `staleness`: 0 (the default) is synchronous: every worker's step c reads
    the parameters updated with the gradients of steps 0 .. c-1 of all
    workers. s >= 1 lets a worker's step c read parameters as old as version
    c - s (updated through step c-s-1), so it need not wait for the update of
    the step before; the runtime blocks it only past that bound (the module's
    docstring has the exact rule)."""

    kind = ModeKind.PARAMETER_SERVER

    def __init__(self, *, gradient_bucket_bytes: int | None = None,
                 dense: DensePlacement | str = DensePlacement.SERVER,
                 staleness: int = 0) -> None:
        if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
            raise PlanError(f"staleness={staleness!r}: give a whole number of steps >= 0 (0, "
                            f"the default, is synchronous; s lets a worker read parameters "
                            f"up to s steps old)")
        self.staleness = staleness
        if gradient_bucket_bytes is not None and gradient_bucket_bytes < 1:
            raise PlanError(f"gradient_bucket_bytes={gradient_bucket_bytes}: give a positive "
                            f"number of bytes, or None for one message per step")
        try:
            self.dense = DensePlacement(dense)
        except ValueError:
            raise PlanError(f"dense={dense!r}: dense parameters live on the 'server' (the "
                            f"default) or on every 'worker'") from None
        if self.dense is DensePlacement.WORKER and gradient_bucket_bytes is not None:
            raise PlanError("gradient_bucket_bytes buckets dense gradients on their way to the "
                            "servers; with dense='worker' they stay on the workers: drop one")
        self.gradient_bucket_bytes = gradient_bucket_bytes

    def reject_label(self, label: Label, cluster: Cluster) -> str | None:
        if label.role is Role.WORKER and label.rank != 0:
            return ("in parameter-server mode every worker runs the same worker subgraph; "
                    "label worker ops with rank 0 or leave them unlabelled")
        return None

    def output_home(self, spec: OutputSpec, producer: Label, cluster: Cluster) -> Label:
        return producer  # every worker keeps its own loss

    # -- prebuild --

    def prebuild(self, program: Program, cluster: Cluster
                 ) -> tuple[Program, ServerAssignment]:
        if cluster.num_servers < 1:
            raise PlanError("parameter-server mode needs at least one server; launch with "
                            "--servers 1 or more")
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        returned = graph.graph_copy(program.graph, env)
        nodes = {n.name: n for n in graph.nodes}
        owner = self._owners(program, nodes, cluster)
        self._relabel(program, graph, owner)
        sparse = self._coalesce_on_workers(program, graph, nodes, owner)
        slots = {}
        if cluster.num_workers >= 2:
            slots = self._accumulate(program, graph, nodes, owner, cluster.num_workers, sparse)
            on_workers = sorted(p for p in program.grads if p not in owner)
            if on_workers:
                average_dense_gradients(graph, program.grads, on_workers, cluster.num_workers)
        graph.output(returned)
        if self.gradient_bucket_bytes is not None:
            _update_as_buckets_fill(graph, self.gradient_bucket_bytes)
        gm = fx.GraphModule(program.graph_module, graph, class_name="ParameterServerStep")
        return dataclasses.replace(program, graph_module=gm), ServerAssignment(owner, slots)

    def _owners(self, program: Program, nodes, cluster: Cluster) -> dict[str, int]:
        sizes, pinned = {}, {}
        for spec in program.inputs:
            if spec.kind is not InputKind.PARAM or program.state_output(spec.key) is None:
                continue
            if self.dense is DensePlacement.WORKER and spec.key not in program.sparse_grads:
                continue  # replicated on the workers
            node = nodes[spec.node]
            sizes[spec.key] = value_nbytes(node)
            text = node_annotation(node)
            if text and text.startswith("s") and text != ANY_SERVER:
                rank = Label.parse(text).rank
                if rank >= cluster.num_servers:
                    raise PlanError(
                        f"parameter {spec.key!r} is placed on server {rank}, but the cluster "
                        f"has {cluster.num_servers} servers; lower the rank or launch with "
                        f"--servers {rank + 1}")
                pinned[spec.key] = rank
        if not sizes and self.dense is DensePlacement.SERVER:
            raise PlanError("parameter-server mode found no trainable parameter to serve; "
                            "capture the step with an optimizer")
        owner = assign_servers(sizes, pinned, cluster.num_servers)
        logger.debug("parameter servers: %s", owner)
        return owner

    def _relabel(self, program: Program, graph: fx.Graph, owner: dict[str, int]) -> None:
        worker = str(Label.worker(0))
        for node in graph.nodes:
            if node.op == "placeholder":
                spec = program.input_spec(node.name)
                param = _param_of_input(spec)
                if param in owner:
                    set_node_annotation(node, str(Label.server(owner[param])))
                elif spec.kind is not InputKind.BATCH:
                    set_node_annotation(node, worker)
            elif node.op == "call_function":
                module = node_annotation(node, MODULE_ANNOTATION) or ""
                param = (module[len(_OPTIMIZER_PREFIX):]
                         if module.startswith(_OPTIMIZER_PREFIX) else None)
                if param in owner:
                    set_node_annotation(node, str(Label.server(owner[param])))
                elif (node_annotation(node) or "").startswith("s"):
                    # A module placed on a server keeps its parameters there; its
                    # ops run on the workers.
                    set_node_annotation(node, worker)

    def _coalesce_on_workers(self, program, graph, nodes, owner
                             ) -> dict[str, tuple[str, str]]:
        """Every server-side sparse gradient, one row per lookup, is summed per
        unique id on the worker (`coalesce`, the padding row left out) before
        it is sent: the server gets each id once per worker. Returns the
        parameter -> (indices, values) node names the servers now read; their
        shapes depend on the data (no static `val`: their channels are
        checked for the sender only)."""
        coalesced = {}
        for param, (indices_name, values_name) in sorted(program.sparse_grads.items()):
            if param not in owner:
                continue
            indices, values = nodes[indices_name], nodes[values_name]
            updates = [user for user in values.users
                       if node_annotation(user, MODULE_ANNOTATION) == _OPTIMIZER_PREFIX + param]
            if not updates:
                continue
            padding_idx = updates[0].kwargs.get("padding_idx")
            label = node_annotation(values)
            # A bag's gradient is summed per unique id already: only the padding
            # row is left out.
            settings = {"padding_idx": padding_idx, "is_coalesced": is_bag_gradient(values)}
            with graph.inserting_after(max(indices, values, key=_position(graph))):
                summed = graph.call_function(coalesce, (indices, values), settings)
            with graph.inserting_after(summed):
                rows = graph.call_function(operator.getitem, (summed, 0))
            with graph.inserting_after(rows):
                sums = graph.call_function(operator.getitem, (summed, 1))
            for node in (summed, rows, sums):
                node.meta["val"] = None
                if label is not None:
                    set_node_annotation(node, label)
            for update in updates:
                update.replace_input_with(indices, rows)
                update.replace_input_with(values, sums)
            nodes.update({rows.name: rows, sums.name: sums})
            coalesced[param] = (rows.name, sums.name)
        return coalesced

    def _accumulate(self, program, graph, nodes, owner, num_workers,
                    coalesced: Mapping[str, tuple[str, str]]) -> dict[str, tuple[str, ...]]:
        """Per server-side gradient, W slots (one per worker) and their mean:
        dense gradients are summed in worker order, then divided by W; sparse
        ones (coalesced per worker) have their indices and values concatenated,
        the values divided by W."""
        grad_of, sparse_of = program.grads, {**program.sparse_grads, **coalesced}
        if not grad_of and not sparse_of:
            raise PlanError("parameter-server mode needs a program from splitrun's capture "
                            "(it records each parameter's gradient)")
        slots: dict[str, tuple[str, ...]] = {}
        for param, server in owner.items():
            where = (str(Label.server(server)), f"accumulate.{param}")
            grads = ([nodes[name] for name in sparse_of[param]] if param in sparse_of
                     else [nodes[grad_of[param]]])
            updates = [user for grad in grads for user in grad.users
                       if node_annotation(user, MODULE_ANNOTATION) == _OPTIMIZER_PREFIX + param]
            if not updates:
                raise PlanError(f"no optimizer update reads the gradient of {param!r}")
            with graph.inserting_before(min(updates, key=_position(graph))):
                for grad in grads:
                    worker_slots = [_new_node(graph, gradient_slot, (grad, rank),
                                              grad.meta.get("val"), where)
                                    for rank in range(num_workers)]
                    slots[grad.name] = tuple(slot.name for slot in worker_slots)
                    if param in sparse_of:
                        mean = _concat(graph, worker_slots, where)
                        if grad is grads[1]:  # values, not indices
                            mean = _new_node(graph, _aten.div.Tensor, (mean, num_workers),
                                             mean.meta.get("val"), where)
                    else:
                        total = worker_slots[0]
                        for slot in worker_slots[1:]:
                            total = _new_node(graph, _aten.add.Tensor, (total, slot),
                                              grad.meta.get("val"), where)
                        mean = _new_node(graph, _aten.div.Tensor, (total, num_workers),
                                         grad.meta.get("val"), where)
                    for update in updates:
                        update.replace_input_with(grad, mean)
        return slots

    # -- fuse --

    def fuse(self, edges: list[Edge], cluster: Cluster) -> list[ChannelDraft]:
        """One channel per direction between the worker template and each
        server; with buckets, one worker -> server channel per bucket (per
        segment of the worker's backward, which the servers' updates cut)."""
        drafts: dict[tuple[Label, Label], ChannelDraft] = {}
        bucketed = []
        for edge in edges:
            if Role.WORKER not in (edge.src.role, edge.dst.role):
                raise PlanError(
                    f"value {edge.value} goes from {edge.src.describe()} to "
                    f"{edge.dst.describe()}; in parameter-server mode servers only exchange "
                    f"parameters and gradients with workers")
            if self.gradient_bucket_bytes is not None and edge.src.role is Role.WORKER:
                bucketed.append(edge)
                continue
            draft = drafts.get((edge.src, edge.dst))
            if draft is None:
                draft = drafts[(edge.src, edge.dst)] = ChannelDraft(
                    edge.src, edge.dst, ChannelKind.DATA, send_pos=edge.src_pos,
                    recv_pos=edge.dst_pos)
            draft.edges.append(edge)
            draft.send_pos = max(draft.send_pos, edge.src_pos)
            draft.recv_pos = min(draft.recv_pos, edge.dst_pos)
        fused = [*drafts.values(), *fuse_by_source_segment(bucketed)]
        for draft in fused:
            if draft.send_pos >= draft.recv_pos:
                raise PlanError(
                    f"the message {draft.src} -> {draft.dst} would be needed at position "
                    f"{draft.recv_pos} before its last value is produced at {draft.send_pos}; "
                    f"an op on the server reads a worker value in the middle of the step")
        return fused

    # -- postbuild --

    def postbuild(self, plan: SplitPlan, program: Program,
                  artifacts: ServerAssignment) -> SplitPlan:
        if self.staleness:
            plan = dataclasses.replace(plan, staleness=self.staleness, _index={})
        num_workers = plan.cluster.num_workers
        if num_workers == 1:
            return plan  # the template is the only worker: nothing to replicate
        template = Label.worker(0)
        sizes = {n.name: value_nbytes(n) for n in program.graph.nodes}
        slot_of = artifacts.slots
        slot_names = {name for names in slot_of.values() for name in names}
        hparams = {s.node for s in program.inputs if s.kind is InputKind.HPARAM}

        nodes = {n.name: n for n in program.graph.nodes}
        read_by_workers = {arg.name for i in plan.process(template).schedule
                           if i.kind is OpKind.RUN for arg in nodes[i.target].all_input_nodes}
        copies: dict[str, list[Channel]] = {}
        channels: list[Channel] = []
        for channel in plan.channels:
            if template not in (channel.src, channel.dst) or channel.kind is ChannelKind.CONTROL:
                channels.append(channel)
                continue
            copies[channel.name] = [
                _worker_copy(channel, template, Label.worker(rank), slot_of, hparams, sizes)
                for rank in range(num_workers)]
            channels.extend(copies[channel.name])

        processes = []
        for proc in plan.processes:
            if proc.label.role is Role.WORKER:
                base = plan.process(template)
                rank = proc.label.rank
                schedule = tuple(
                    Instruction(i.kind, copies[i.target][rank].name)
                    if i.kind is not OpKind.RUN and i.target in copies else i
                    for i in base.schedule)
                # Workers besides 0 need a hyperparameter only if they read it
                # themselves (worker 0 sends it to the servers).
                feeds = base.feeds if rank == 0 else tuple(
                    k for k in base.feeds if program.input_for_key(k).node not in hparams
                    or program.input_for_key(k).node in read_by_workers)
                processes.append(dataclasses.replace(base, label=proc.label, schedule=schedule,
                                                     feeds=feeds))
                continue
            schedule = []
            for instr in proc.schedule:
                if instr.kind is OpKind.RUN:
                    if instr.target not in slot_names:
                        schedule.append(instr)
                elif instr.target in copies:
                    schedule.extend(Instruction(instr.kind, c.name) for c in copies[instr.target])
                else:
                    schedule.append(instr)
            processes.append(dataclasses.replace(proc, schedule=tuple(schedule)))

        syncs = tuple(DataSync(s.key, s.owner, Label.worker(rank), copies[s.channel][rank].name)
                      for s in plan.data_syncs for rank in range(num_workers))
        return SplitPlan(plan.mode, plan.cluster, tuple(processes), tuple(channels), syncs,
                         staleness=plan.staleness)


def _update_as_buckets_fill(graph: fx.Graph, bucket_bytes: int) -> None:
    """Reorder `graph` so each server op that depends on the step's worker ops
    comes right after the worker op that fills the gradient bucket it waits
    for. The worker ops keep their order; a server op that depends only on
    state and hyperparameters (momentum decay, -lr) moves to where the first
    op needing it is placed, so the learning rate still rides a gradient
    message. Still a topological order: every process schedules from it."""
    def on_server(node: fx.Node) -> bool:
        return (node_annotation(node) or "").startswith("s")

    stepwise: set[fx.Node] = set()  # produced by the step's ops, not state or feeds
    for node in graph.nodes:
        if node.op == "call_function" and (
                not on_server(node) or any(i in stepwise for i in node.all_input_nodes)):
            stepwise.add(node)
    deferred = [n for n in graph.nodes if n.op == "call_function" and on_server(n)]
    placed: list[fx.Node] = []
    done: set[fx.Node] = set()

    def place(node: fx.Node) -> None:
        if node in done:
            return
        for arg in node.all_input_nodes:
            place(arg)
        placed.append(node)
        done.add(node)

    def place_ready_updates() -> None:
        for node in deferred:
            if node not in done and node in stepwise and all(
                    arg in done for arg in node.all_input_nodes if arg in stepwise):
                place(node)

    pending = 0
    for node in list(graph.nodes):
        if node.op == "output" or (node.op == "call_function" and on_server(node)):
            continue
        place(node)
        if node.op == "call_function" and any(on_server(u) for u in node.users):
            pending += value_nbytes(node)  # a gradient (or a value derived on the worker)
            if pending >= bucket_bytes:
                place_ready_updates()
                pending = 0
    for node in graph.nodes:
        place(node)
    previous = None
    for node in placed:
        if previous is not None and previous.next is not node:
            previous.append(node)
        previous = node
    graph.lint()


def _new_node(graph: fx.Graph, target, args, value, where: tuple[str, str]) -> fx.Node:
    node = graph.call_function(target, args)
    node.meta["val"] = value
    set_node_annotation(node, where[0])
    set_node_annotation(node, where[1], MODULE_ANNOTATION)
    return node


def _concat(graph: fx.Graph, parts: list[fx.Node], where: tuple[str, str]) -> fx.Node:
    first = parts[0].meta.get("val")
    value = None
    if isinstance(first, torch.Tensor):
        shape = (first.shape[0] * len(parts), *first.shape[1:])
        value = torch.empty(shape, dtype=first.dtype, device="meta")
    return _new_node(graph, _aten.cat.default, (parts,), value, where)


def _param_of_input(spec) -> str | None:
    if spec.kind is InputKind.PARAM:
        return spec.key
    return spec.param  # an optimizer state's parameter; None for the rest


def _position(graph: fx.Graph):
    order = {node: index for index, node in enumerate(graph.nodes)}
    return order.__getitem__


def _worker_copy(channel: Channel, template: Label, worker: Label, slot_of, hparams,
                 sizes) -> Channel:
    """Worker `worker`'s copy of a channel between the template and a server."""
    rank = worker.rank
    src = worker if channel.src == template else channel.src
    dst = worker if channel.dst == template else channel.dst
    name = channel.name.replace(f"{template}->", f"{src}->", 1) if src == worker else \
        channel.name.replace(f"->{template}#", f"->{dst}#", 1)
    if src != worker:  # server -> worker: the same values to every worker
        return channel._replace(name=name, dst=dst)
    values, recv_names = [], []
    for value, recv_name in zip(channel.values, channel.recv_names):
        if value in slot_of:
            values.append(value)
            recv_names.append(slot_of[value][rank])
        elif value in hparams:
            if rank == 0:  # the learning rate and step count come from worker 0
                values.append(value)
                recv_names.append(recv_name)
        else:
            raise PlanError(
                f"channel {channel.name} carries {value}, which is neither a gradient nor "
                f"a hyperparameter; in parameter-server mode workers send servers only those")
    return channel._replace(name=name, src=src, values=tuple(values),
                            recv_names=tuple(recv_names), nbytes=sum(sizes[v] for v in values))
