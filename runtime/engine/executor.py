"""The executor: runs one process's share of a split plan, step after step.

Local ops run on the process's device; a SEND hands tensors to the transport
(never blocking on the receiver); a RECV waits on the mailbox with a deadline
(the transport checked the message against its channel's receive contract
when it arrived). The schedule runs as straight-line code generated once,
at construction (`step_code`): locals, arguments written into each call,
values freed by `del` after their last use, as `torch.fx`'s code generation
does for a `GraphModule`. A failing op's error names its node and module.

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
from . import step_code
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
        """Generate this process's step (`step_code`): everything the plan
        decides, decided here once."""
        program, proc = self.program, self.proc
        state_nodes = {key: program.input_for_key(key).node for key in proc.state}
        feed_nodes = {key: program.input_for_key(key).node for key in proc.feeds}
        outputs = {o.key: o.node for o in program.outputs if o.key in set(proc.outputs)}
        updates = {}
        for key in proc.state:
            spec = program.state_output(key)
            if spec is not None:
                updates[key] = spec.node
        constants = {n.name: getattr(program.graph_module, n.target)
                     for n in self._nodes.values() if n.op == "get_attr"}

        ops = []
        for instr in proc.schedule:
            if instr.kind is OpKind.RUN:
                node = self._nodes[instr.target]
                target = self._bindings.get(node.target, node.target)
                ops.append(step_code.Op("run", node.name, target=target))
            else:
                channel = self.plan.channel(instr.target)
                if instr.kind is OpKind.SEND:
                    ops.append(step_code.Op("send", channel.name, peer=channel.dst,
                                            values=tuple(channel.values)))
                else:
                    ops.append(step_code.Op(
                        "recv", channel.name, peer=channel.src,
                        values=tuple(channel.recv_names),
                        bounded=channel.name in self._bounded,
                        synced=channel.name in self._synced))
        self._check_markers_bound(ops)
        last_use = step_code.last_uses(ops, self._nodes)
        kept = set(outputs.values()) | set(updates.values())
        scheduled = [self._nodes[op.name] if op.kind == "run"
                     and op.target is self._nodes[op.name].target else None for op in ops]
        tiled = {}  # first index -> (last index, run)
        if self.device.type == "cpu":
            tiled = {first: (last, run) for first, last, run in find_tiled_runs(
                scheduled, lambda name, i: name in kept or last_use.get(name, -1) > i)}
        self._feed_keys = tuple(feed_nodes)
        self._peaks: dict[tuple, int] = {}  # step shape -> peak activation bytes
        self.code = step_code.generate(
            title=self.label.describe(), ops=ops, nodes=self._nodes, state=state_nodes,
            feeds=feed_nodes, constants=constants, outputs=outputs, updates=updates,
            forward=_forward_values(program), tiled=tiled, device=self.device,
            helpers={"send": self._send, "recv": self._receive,
                     "recv_bounded": self._receive_bounded, "synced": self._keep_synced,
                     "put_state": self._put_state})

    def _check_markers_bound(self, ops) -> None:
        """Every marker op this process runs has a binding (a marker only
        stands for what the runtime binds it to; unbound, it would raise at
        its first run, in the middle of a step)."""
        unbound = [(op.name, op.target) for op in ops
                   if op.kind == "run" and isinstance(op.target, FunctionType)
                   and op.target in MARKERS]
        if unbound:
            nodes = ", ".join(f"{name} ({target.__name__}, bound to {MARKERS[target]})"
                              for name, target in unbound)
            raise SplitrunError(
                f"{self._tag} {len(unbound)} node(s) of this process's graph call marker "
                f"ops it has no binding for: {nodes}; run the split through "
                f"ProcessRuntime (Job.start or run_threaded binds every marker a process "
                f"runs), or pass Executor(bindings=...) for each")

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
        missing = [key for key in self._feed_keys if key not in feeds]
        if missing:
            raise SplitrunError(
                f"{self._tag} step {step}: feed {missing[0]!r} is missing; this process "
                f"reads {', '.join(self.proc.feeds)}")
        # A serving process's first receive waits for the next step: idle.
        idle = first_recv_timeout_s is not None
        first_timeout = first_recv_timeout_s if idle else self.recv_timeout_s
        between = None if control is None else (
            MessageKey(self.incarnation, step, control[0]), control[1])
        shape = tuple((getattr(feeds[key], "shape", None), getattr(feeds[key], "dtype", None))
                      for key in self._feed_keys)
        peak = self._peaks.get(shape)
        code = self.code
        try:
            if peak is not None:
                outputs, updates = code.step(step, self.state, feeds, self.tile_pointwise,
                                             self.recv_timeout_s, first_timeout, between, idle)
            else:  # the first step of this shape also counts its activations' bytes
                outputs, updates, peak = code.measured(
                    step, self.state, feeds, self.tile_pointwise, self.recv_timeout_s,
                    first_timeout, between, idle)
                self._peaks[shape] = peak
        except Exception as exc:
            where = code.failed_at(exc)
            if where is None:
                raise
            raise self._failure(step, where, exc) from exc
        self.stats.peak_activation_bytes = max(self.stats.peak_activation_bytes, peak)

        outputs = {key: self._owned(value) for key, value in outputs.items()}
        for key, value in updates.items():
            self.state[key] = self._owned(value)
        for channel, (version, tensors) in self._held.items():
            # Kept for later steps: must not hold the sender's ring room.
            self._held[channel] = (version, [self._owned(t) for t in tensors])
        self.stats.steps += 1
        self.stats.step_s += time.perf_counter() - started
        return outputs

    def _failure(self, step: int, where: step_code.Where, exc: Exception) -> StepFailed:
        """The error of a step whose node (or tiled run) `where` raised `exc`."""
        if where.tiled is not None:
            return StepFailed(
                f"{self._tag} step {step}: the elementwise ops {', '.join(where.tiled.names)}, "
                f"run tile by tile, raised {type(exc).__name__}: {exc} (Executor("
                f"tile_pointwise=False) runs them op by op)")
        module = self.program.module_of(self._nodes[where.node])
        place = f" (module {module!r})" if module else ""
        return StepFailed(
            f"{self._tag} step {step}: node {where.node}{place} "
            f"({getattr(where.target, '__name__', where.target)}) raised "
            f"{type(exc).__name__}: {exc}")

    def _send(self, step: int, channel: str, dst: Label, tensors: list[torch.Tensor]) -> None:
        self.transport.send(dst, MessageKey(self.incarnation, step, channel), tensors)
        counter = self.stats.sent[channel]
        counter.messages += 1
        counter.bytes += nbytes_of(tensors)

    def _keep_synced(self, channel: str, step: int, tensors: list[torch.Tensor]) -> None:
        if self.keep_synced:
            self._held[channel] = (step, tensors)

    def _put_state(self, key: str, value: torch.Tensor) -> None:
        """A new state value, in place as soon as the step makes it: the old
        one is freed at its last use. A step that fails after this keeps the
        values it had made (as torch's optimizers, updating in place, do)."""
        self.state[key] = self._owned(value)

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

    def _receive(self, step, channel, src, count, timeout_s, control,
                 idle: bool = False) -> list[torch.Tensor]:
        """Channel `channel`'s `count` tensors of step `step`, on this device."""
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
        if len(tensors) != count:
            raise MessageRejected(
                f"{self._tag} step {step}: channel {channel!r} from {src.describe()} "
                f"carried {len(tensors)} tensors, the plan expects {count}")
        counter = self.stats.received[channel]
        counter.messages += 1
        counter.bytes += nbytes_of(tensors)
        counter.wait_s += waited
        return self._here(tensors)

    def _here(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        device = self.device
        return [t if t.device == device else t.to(device) for t in tensors]

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

    def _receive_bounded(self, step, channel, src, count, timeout_s) -> list[torch.Tensor]:
        """A staleness-bounded data-sync receive (see the module's docstring):
        the newest version arrived, or a wait for version step - s if even
        that is older than the bound allows."""
        held_version = self._held.get(channel, (-1, None))[0]
        # Versions from before this executor's first step are never sent.
        oldest_allowed = max(step - self.staleness, self._first_step)
        newest = self._take_newest(step, channel, src, max(held_version, self._first_step - 1))
        if newest is None and held_version < oldest_allowed:
            # Past the bound: wait for the oldest version it allows.
            waited = self._receive(oldest_allowed, channel, src, count, timeout_s, None)
            newest = (self._take_newest(step, channel, src, oldest_allowed)
                      or (oldest_allowed, waited))
        if newest is not None:
            self._held[channel] = newest
        version, tensors = self._held[channel]
        self._note_version(step, channel, version)
        return self._here(tensors)

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

