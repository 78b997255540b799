"""The executor: runs one process's share of a split plan, step after step.

Local ops run on the process's device; a SEND hands tensors to the transport
(never blocking on the receiver); a RECV waits on the mailbox with a deadline
(the transport checked the message against its channel's receive contract
when it arrived). Values are freed
after their last use, as `torch.fx.Interpreter` does.

With a staleness bound s (`SplitPlan.staleness`, parameter-server mode), the
receive of a data-sync channel at step c takes the newest version that has
arrived (the message of the highest step <= c; older ones are taken and
dropped) and waits only if even that is older than c - s: then for version
c - s, the oldest the bound allows. The version kept is reused by later steps
until a newer one arrives. Versions read are recorded per step
(`ExecutorStats.versions_read`, and per channel, i.e. per server,
`ExecutorStats.channel_versions_read`).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from types import FunctionType

import torch
from torch import fx

from splitrun.splitter.labels import Label
from splitrun.splitter.ops.markers import MARKERS
from splitrun.splitter.plan import OpKind, SplitPlan
from splitrun.splitter.program import OutputKind, Program

from ..errors import MessageRejected, RecvTimeout, SplitrunError, StepFailed
from ..transport.dtypes import nbytes_of
from ..transport.protocol import MessageKey, Transport
from ..transport.receiving import Receive, receiving
from .tiles import find_tiled_runs

__all__ = ["Executor", "ExecutorStats", "ChannelStats"]

logger = logging.getLogger(__name__)


@dataclass
class ChannelStats:
    messages: int = 0
    bytes: int = 0
    wait_s: float = 0.0  # receives only: time blocked waiting for this channel


@dataclass
class ExecutorStats:
    """Counters since the executor started; `recv_wait_s` is time spent blocked
    in receives, `busy_s` the rest of the step time."""

    steps: int = 0
    sent: dict[str, ChannelStats] = field(default_factory=lambda: defaultdict(ChannelStats))
    received: dict[str, ChannelStats] = field(default_factory=lambda: defaultdict(ChannelStats))
    recv_wait_s: float = 0.0
    step_s: float = 0.0
    # The most bytes the forward's values (computed here or received) held
    # at once in a step: the activations kept for the backward. Each storage
    # counts once; the state and the feeds do not count.
    peak_activation_bytes: int = 0
    # Staleness-bounded plans: step -> the oldest state version this step read
    # over its data-sync channels (equal to the step when nothing was stale).
    versions_read: dict[int, int] = field(default_factory=dict)
    # The same per data-sync channel (one per server, which may be at
    # different versions): step -> {channel: version read}.
    channel_versions_read: dict[int, dict[str, int]] = field(default_factory=dict)

    @property
    def messages_sent(self) -> int:
        return sum(c.messages for c in self.sent.values())

    @property
    def bytes_sent(self) -> int:
        return sum(c.bytes for c in self.sent.values())

    @property
    def bytes_received(self) -> int:
        return sum(c.bytes for c in self.received.values())

    def as_dict(self) -> dict:
        return {
            "steps": self.steps,
            "step_s": round(self.step_s, 6),
            "recv_wait_s": round(self.recv_wait_s, 6),
            "peak_activation_bytes": self.peak_activation_bytes,
            **({"versions_read": dict(self.versions_read)} if self.versions_read else {}),
            "sent": {k: vars(v) for k, v in sorted(self.sent.items())},
            "received": {k: vars(v) for k, v in sorted(self.received.items())},
        }


class _Ref:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


def _binder(args, kwargs):
    """A function env -> (args, kwargs) with node references filled in."""
    flat = all(not isinstance(a, (list, tuple, dict)) for a in args)
    if flat and not any(isinstance(v, (_Ref, list, tuple, dict)) for v in kwargs.values()):
        refs = [(i, a.name) for i, a in enumerate(args) if isinstance(a, _Ref)]
        template = list(args)

        def bind_flat(env):
            values = template.copy()
            for i, name in refs:
                values[i] = env[name]
            return values, kwargs
        return bind_flat

    def resolve(obj, env):
        if isinstance(obj, _Ref):
            return env[obj.name]
        if isinstance(obj, (list, tuple)):
            return type(obj)(resolve(o, env) for o in obj)
        if isinstance(obj, dict):
            return {k: resolve(v, env) for k, v in obj.items()}
        return obj

    return lambda env: (resolve(args, env), resolve(kwargs, env))


def _forward_values(program: Program) -> frozenset[str]:
    """The names of the nodes the loss depends on: the forward's values."""
    loss = [o.node for o in program.outputs if o.kind is OutputKind.LOSS]
    stack = [node for node in program.graph.nodes if node.name in loss]
    seen: set[str] = set()
    while stack:
        node = stack.pop()
        if node.name not in seen and node.op != "placeholder":
            seen.add(node.name)
            stack.extend(node.all_input_nodes)
    return frozenset(seen)


class _LiveBytes:
    """The bytes of memory the forward's values a step computed or received
    hold, and their peak: each storage counted once however many views share
    it, never the storage of the state or the feeds the step started with."""

    __slots__ = ("_counted", "_given", "_held", "_storages", "live", "peak")

    def __init__(self, given, counted: frozenset[str]) -> None:
        self._counted = counted
        self._given = {v.untyped_storage().data_ptr() for v in given
                       if isinstance(v, torch.Tensor)}
        self._held: dict[str, int] = {}               # value name -> storage
        self._storages: dict[int, list[int]] = {}    # storage -> [references, bytes]
        self.live = self.peak = 0

    def hold(self, name: str, value) -> None:
        if name not in self._counted or not isinstance(value, torch.Tensor):
            return
        storage = value.untyped_storage()
        pointer = storage.data_ptr()
        if pointer in self._given:
            return
        self._held[name] = pointer
        entry = self._storages.get(pointer)
        if entry is None:
            self._storages[pointer] = [1, storage.nbytes()]
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        else:
            entry[0] += 1

    def drop(self, name: str) -> None:
        pointer = self._held.pop(name, None)
        if pointer is None:
            return
        entry = self._storages[pointer]
        entry[0] -= 1
        if not entry[0]:
            self.live -= entry[1]
            del self._storages[pointer]


class Executor:
    """Runs `label`'s subgraph of `plan`. Call `load_state`, then `run_step`."""

    def __init__(self, plan: SplitPlan, program: Program, label: Label, transport: Transport, *,
                 device: str | torch.device = "cpu", incarnation: int = 0,
                 recv_timeout_s: float = 60.0,
                 bindings: Mapping[Callable, Callable] | None = None,
                 tile_pointwise: bool = True) -> None:
        """`program`: the one the plan's node names refer to (`SplitProgram.program`).
        `bindings` implement marker ops of the graph with runtime objects
        (the embedding cache binds `cached_lookup` and `cached_update`); a
        marker this process runs without a binding is refused here, before
        any step (`splitter.ops.markers`).
        `tile_pointwise`: run chains of elementwise ops over large CPU tensors
        tile by tile (`tiles`; same results, less memory traffic);
        it may be changed between steps."""
        self.program = program
        self.plan = plan
        self.label = label
        self.proc = plan.process(label)
        self.transport = transport
        self.device = torch.device(device)
        self.incarnation = incarnation
        self.recv_timeout_s = recv_timeout_s
        self.tile_pointwise = tile_pointwise
        self.state: dict[str, torch.Tensor] = {}
        self.stats = ExecutorStats()
        self._bindings = dict(bindings or {})
        self._waiting: Receive | None = None
        self.staleness = plan.staleness
        # Staleness-bounded data-sync channels into this process: channel ->
        # (version, tensors) last taken; the first step this executor ran.
        self._bounded = ({s.channel for s in plan.data_syncs if s.reader == label}
                         if plan.staleness else set())
        self._held: dict[str, tuple[int, list[torch.Tensor]]] = {}
        self._first_step: int | None = None
        # Where each data-synced state key arrives: channel -> [(index, key)].
        self._synced: dict[str, list[tuple[int, str]]] = {}
        for sync in plan.data_syncs:
            if sync.reader == label:
                names = plan.channel(sync.channel).recv_names
                node = program.input_for_key(sync.key).node
                self._synced.setdefault(sync.channel, []).append((names.index(node), sync.key))
        # `keep_synced`: also keep what synchronous receives bring (`synced_state`).
        self.keep_synced = False
        self._tag = f"[{label.describe()}]"
        self._nodes: dict[str, fx.Node] = {n.name: n for n in self.program.graph.nodes}
        self._compile()

    # -- setup --

    def _compile(self) -> None:
        program, proc = self.program, self.proc
        self._state_nodes = {key: program.input_for_key(key).node for key in proc.state}
        self._feed_nodes = {key: program.input_for_key(key).node for key in proc.feeds}
        self._output_nodes = {o.key: o.node for o in program.outputs if o.key in set(proc.outputs)}
        self._state_updates = {}
        for key in proc.state:
            spec = program.state_output(key)
            if spec is not None:
                self._state_updates[key] = spec.node
        self._constants = {n.name: getattr(program.graph_module, n.target)
                           for n in self._nodes.values() if n.op == "get_attr"}
        self._forward = _forward_values(program)

        ops = []
        for instr in proc.schedule:
            if instr.kind is OpKind.RUN:
                node = self._nodes[instr.target]
                args = fx.node.map_arg(node.args, lambda n: _Ref(n.name))
                kwargs = dict(fx.node.map_arg(node.kwargs, lambda n: _Ref(n.name)))
                if isinstance(kwargs.get("device"), torch.device):
                    kwargs["device"] = self.device  # graphs are captured on CPU
                target = self._bindings.get(node.target, node.target)
                ops.append((OpKind.RUN, node.name, target, _binder(args, kwargs)))
            else:
                channel = self.plan.channel(instr.target)
                if instr.kind is OpKind.SEND:
                    ops.append((OpKind.SEND, channel.name, channel.dst, channel.values))
                else:
                    ops.append((OpKind.RECV, channel.name, channel.src, channel.recv_names))
        self._ops = ops
        self._check_markers_bound()
        self._free_after, last_use = self._last_uses(ops)
        kept = set(self._output_nodes.values()) | set(self._state_updates.values())
        scheduled = [self._nodes[name] if kind is OpKind.RUN and target is self._nodes[name].target
                     else None for kind, name, target, _ in ops]
        self._tiled = {}  # first index -> (last index, run)
        if self.device.type == "cpu":
            self._tiled = {first: (last, run) for first, last, run in find_tiled_runs(
                scheduled, lambda name, i: name in kept or last_use.get(name, -1) > i)}

    def _check_markers_bound(self) -> None:
        """Every marker op this process runs has a binding (a marker only
        stands for what the runtime binds it to; unbound, it would raise at
        its first run, in the middle of a step)."""
        unbound = [(name, target) for kind, name, target, _ in self._ops
                   if kind is OpKind.RUN and isinstance(target, FunctionType)
                   and target in MARKERS]
        if unbound:
            nodes = ", ".join(f"{name} ({target.__name__}, bound to {MARKERS[target]})"
                              for name, target in unbound)
            raise SplitrunError(
                f"{self._tag} {len(unbound)} node(s) of this process's graph call marker "
                f"ops it has no binding for: {nodes}; run the split through "
                f"ProcessRuntime (Job.start or run_threaded binds every marker a process "
                f"runs), or pass Executor(bindings=...) for each")

    def _last_uses(self, ops) -> tuple[list[list[str]], dict[str, int]]:
        keep = set(self._output_nodes.values()) | set(self._state_updates.values())
        last: dict[str, int] = {}
        for index, (kind, name, _, payload) in enumerate(ops):
            if kind is OpKind.RUN:
                for arg in self._nodes[name].all_input_nodes:
                    last[arg.name] = index
            elif kind is OpKind.SEND:
                for value in payload:
                    last[value] = index
        free_after: list[list[str]] = [[] for _ in ops]
        for name, index in last.items():
            if name not in keep and name not in self._constants:
                free_after[index].append(name)
        return free_after, last

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Take the state this process owns from `state` (a full or partial dict)."""
        missing = [key for key in self.proc.state if key not in state]
        if missing:
            raise SplitrunError(
                f"{self._tag} state {', '.join(map(repr, missing))} is missing; this "
                f"process owns {', '.join(self.proc.state)}")
        self.state = {key: state[key].detach().to(self.device) for key in self.proc.state}

    # -- one step --

    def run_step(self, step: int, feeds: Mapping[str, torch.Tensor], *,
                 first_recv_timeout_s: float | None = None,
                 control: tuple[str, Callable] | None = None) -> dict[str, torch.Tensor]:
        """Run this process's subgraph once; return the outputs delivered here.

        For a process that serves steps: `first_recv_timeout_s` bounds the
        step's first receive instead of `recv_timeout_s` (the next step may be
        long in coming), and `control = (channel, handler)` hands messages on
        that channel to the handler while the first receive waits, i.e. between
        steps.
        """
        started = time.perf_counter()
        if self._first_step is None:
            self._first_step = step
        env: dict[str, object] = dict(self._constants)
        for key, node in self._state_nodes.items():
            env[node] = self.state[key]
        for key, node in self._feed_nodes.items():
            if key not in feeds:
                raise SplitrunError(
                    f"{self._tag} step {step}: feed {key!r} is missing; this process "
                    f"reads {', '.join(self.proc.feeds)}")
            env[node] = feeds[key].to(self.device, non_blocking=True)

        index = 0
        live = _LiveBytes(env.values(), self._forward)
        while index < len(self._ops):
            kind, name, target, payload = self._ops[index]
            tiled = self._tiled.get(index) if self.tile_pointwise else None
            if tiled is not None and tiled[1].can_tile(env):
                last, run = tiled
                self._run_tiled(step, run, env)
                for done in range(index, last + 1):
                    for dead in self._free_after[done]:
                        env.pop(dead, None)
                        live.drop(dead)
                index = last + 1
                continue
            if kind is OpKind.RUN:
                args, kwargs = payload(env)
                try:
                    value = env[name] = target(*args, **kwargs)
                except Exception as exc:
                    module = self.program.module_of(self._nodes[name])
                    where = f" (module {module!r})" if module else ""
                    raise StepFailed(
                        f"{self._tag} step {step}: node {name}{where} "
                        f"({getattr(target, '__name__', target)}) raised "
                        f"{type(exc).__name__}: {exc}") from exc
                live.hold(name, value)
            elif kind is OpKind.SEND:
                tensors = [env[v] for v in payload]
                self.transport.send(target, MessageKey(self.incarnation, step, name), tensors)
                counter = self.stats.sent[name]
                counter.messages += 1
                counter.bytes += nbytes_of(tensors)
            else:
                timeout, between_steps = self.recv_timeout_s, None
                # A serving process's first receive waits for the next step: idle.
                idle = first_recv_timeout_s is not None
                if first_recv_timeout_s is not None:
                    timeout, first_recv_timeout_s = first_recv_timeout_s, None
                if control is not None:
                    between_steps = (MessageKey(self.incarnation, step, control[0]), control[1])
                    control = None
                if name in self._bounded:
                    self._receive_bounded(step, name, target, payload, env, timeout)
                else:
                    self._receive(step, name, target, payload, env, timeout, between_steps,
                                  idle=idle)
                    if self.keep_synced and name in self._synced:
                        self._held[name] = (step, [env[n] for n in payload])
                for received in payload:
                    live.hold(received, env[received])
            for dead in self._free_after[index]:
                env.pop(dead, None)
                live.drop(dead)
            index += 1
        self.stats.peak_activation_bytes = max(self.stats.peak_activation_bytes, live.peak)

        outputs = {key: self._owned(env[node]) for key, node in self._output_nodes.items()}
        for key, node in self._state_updates.items():
            self.state[key] = self._owned(env[node])
        for channel, (version, tensors) in self._held.items():
            # Kept for later steps: must not hold the sender's ring room.
            self._held[channel] = (version, [self._owned(t) for t in tensors])
        self.stats.steps += 1
        self.stats.step_s += time.perf_counter() - started
        return outputs

    def _run_tiled(self, step: int, run, env) -> None:
        try:
            run.run(env)
        except Exception as exc:
            raise StepFailed(
                f"{self._tag} step {step}: the elementwise ops {', '.join(run.names)}, run "
                f"tile by tile, raised {type(exc).__name__}: {exc} (Executor("
                f"tile_pointwise=False) runs them op by op)") from exc

    def _owned(self, value):
        """`value`, copied if it views memory the transport lent for a receive:
        what outlives the step must not hold the sender's ring room."""
        if isinstance(value, torch.Tensor) and self.transport.is_lent(value):
            return value.clone()
        return value

    @property
    def waiting_on(self) -> Receive | None:
        """The receive of a step this process is inside (not between steps):
        from whom, since when, and whether it still waits (`Receive.is_stuck`)."""
        return self._waiting

    def _receive(self, step, channel, src, recv_names, env, timeout_s, control, *,
                 idle: bool = False) -> None:
        key = MessageKey(self.incarnation, step, channel)
        waited = time.perf_counter()
        since = time.monotonic()
        # A server's wait for its next step's first message is between steps.
        with nullcontext() if idle else receiving(src) as receive:
            self._waiting = receive
            try:
                if control is None:
                    tensors = self.transport.recv(src, key, timeout_s)
                else:
                    tensors = self.transport.recv(src, key, timeout_s, control=control)
            except RecvTimeout as exc:  # say whom this step waited on, and how long
                raise RecvTimeout(str(exc), peer=src,
                                  waited_s=time.monotonic() - since) from None
            finally:
                self._waiting = None
        waited = time.perf_counter() - waited
        self.stats.recv_wait_s += waited
        if len(tensors) != len(recv_names):
            raise MessageRejected(
                f"{self._tag} step {step}: channel {channel!r} from {src.describe()} "
                f"carried {len(tensors)} tensors, the plan expects {len(recv_names)}")
        for name, tensor in zip(recv_names, tensors):
            env[name] = tensor if tensor.device == self.device else tensor.to(self.device)
        counter = self.stats.received[channel]
        counter.messages += 1
        counter.bytes += nbytes_of(tensors)
        counter.wait_s += waited

    def synced_state(self) -> dict[str, torch.Tensor]:
        """The state the last step read through data-syncs (in parameter-server
        mode a worker's view of the servers' parameters), by state key; under
        a staleness bound, of the version that step read. A synchronous plan
        keeps it only with `keep_synced` set (an evaluation's hook)."""
        state = {}
        for channel, keys in self._synced.items():
            if channel in self._held:
                tensors = self._held[channel][1]
                state.update((key, tensors[index]) for index, key in keys)
        return state

    def _receive_bounded(self, step, channel, src, recv_names, env, timeout_s) -> None:
        """A staleness-bounded data-sync receive (see the module's docstring):
        the newest version arrived, or a wait for version step - s if even
        that is older than the bound allows."""
        held_version = self._held.get(channel, (-1, None))[0]
        # Versions from before this executor's first step are never sent.
        oldest_allowed = max(step - self.staleness, self._first_step)
        newest = self._take_newest(step, channel, src, max(held_version, self._first_step - 1))
        if newest is None and held_version < oldest_allowed:
            # Past the bound: wait for the oldest version it allows.
            self._receive(oldest_allowed, channel, src, recv_names, env, timeout_s, None)
            newest = (self._take_newest(step, channel, src, oldest_allowed)
                      or (oldest_allowed, [env[name] for name in recv_names]))
        if newest is not None:
            self._held[channel] = newest
        version, tensors = self._held[channel]
        self._note_version(step, channel, version)
        for name, tensor in zip(recv_names, tensors):
            env[name] = tensor if tensor.device == self.device else tensor.to(self.device)

    def _take_newest(self, step, channel, src, after: int
                     ) -> tuple[int, list[torch.Tensor]] | None:
        """Take every version of `channel` in (after, step] that is here and
        return the newest (None if none is). A sender delivers a channel's
        versions in order (one queue or ring per peer): below the newest
        present, every version not taken yet is present too."""
        newest = None
        for version in range(step, after, -1):
            key = MessageKey(self.incarnation, version, channel)
            try:
                tensors = self.transport.recv(src, key, 0.0)
            except RecvTimeout:
                if newest is None:
                    continue
                break
            counter = self.stats.received[channel]
            counter.messages += 1
            counter.bytes += nbytes_of(tensors)
            if newest is None:
                newest = (version, tensors)
        return newest

    def _note_version(self, step: int, channel: str, version: int) -> None:
        versions = self.stats.versions_read
        versions[step] = min(versions.get(step, version), version)
        self.stats.channel_versions_read.setdefault(step, {})[channel] = version

    def abort(self, error: BaseException) -> None:
        self.transport.abort(error)

