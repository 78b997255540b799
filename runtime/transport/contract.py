"""Receive contracts: what a process accepts on each channel it receives, and
the one check every transport runs on every message.

A process's contracts are computed once: its plan channels' from the plan and
the program (`receive_contracts`), the channels outside the plan registered by
their owners (checkpoint state, control commands, embedding-cache requests).
A transport keeps them in a `ReceiveContracts` and checks each incoming
message against them exactly once, with `find_contract` and `check_message`,
before it reaches the mailbox:

    contracts = ReceiveContracts()
    contracts.register({"@ctl": ChannelContract(Label.worker(0), ((torch.int64, ()),))})
    contracts.expect(receive_contracts(plan, program, label))   # opens the process
    ...
    contract = find_contract(contracts.table, key, str(src), receiver=label)
    check_message(contract, key, src, tensors, receiver=label)
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import torch

from splitrun.splitter.labels import Label
from splitrun.splitter.plan import OpKind, SplitPlan
from splitrun.splitter.program import Program

from ..errors import ChannelMismatch, TransportError, UnknownChannel, WrongSender
from .dtypes import TensorSpec, describe_spec
from .keys import MessageKey

__all__ = [
    "ChannelContract",
    "ReceiveContracts",
    "receive_contracts",
    "find_contract",
    "check_message",
    "refusal_prefix",
]

# Bounds the text a refusal quotes from a message (names come from the network).
_MAX_QUOTED_CHANNEL = 200
_MAX_QUOTED_SRC = 40
# Channels named in an unknown-channel refusal.
_MAX_LISTED_CHANNELS = 8


@dataclass(frozen=True, slots=True)
class ChannelContract:
    """A channel this process receives: from whom, and its tensors' dtype and
    shape (None for a value the plan has no static dtype/shape for).

    `tensors` None: a dynamic channel (any number of tensors of any dtype and
    shape, e.g. embedding-cache requests); only the sender is checked. Entries
    may be given as `(dtype, shape)` pairs; they are kept as `TensorSpec`s.

    `later_bytes`: for a plan channel, the bytes its sender still sends this
    receiver later in the same step (None: not known, or not a plan channel).
    A transport may then hand the channel's tensors over as views of its own
    memory (a shared-memory ring) instead of copies, memory the sender cannot
    reuse until they are dropped: the executor drops its values within the
    step (it copies any that outlive it), and a transport that keeps room for
    `later_bytes` more never makes the sender wait in the step for room those
    views hold.
    """

    src: Label
    tensors: tuple[TensorSpec | None, ...] | None
    later_bytes: int | None = None

    @property
    def lendable(self) -> bool:
        return self.later_bytes is not None

    def __post_init__(self) -> None:
        if self.tensors is None:
            return
        normal = tuple(None if spec is None else _as_spec(spec) for spec in self.tensors)
        object.__setattr__(self, "tensors", normal)

    @property
    def is_static(self) -> bool:
        """True if every tensor's dtype and shape is fixed."""
        return self.tensors is not None and all(spec is not None for spec in self.tensors)

    @classmethod
    def of_values(cls, src: Label, program: Program, values: Sequence[str]) -> ChannelContract:
        """The contract of a channel carrying the graph values `values` (node
        names) of `program`: each value's dtype and shape as captured, None
        where the graph has no static shape for it."""
        nodes = {node.name: node for node in program.graph.nodes}
        return cls(src, tuple(_spec_of(nodes.get(value)) for value in values))


def _as_spec(spec: TensorSpec | tuple) -> TensorSpec:
    """Shapes compare as tuples of ints, whatever sequence the caller gave."""
    dtype, shape = (spec.dtype, spec.shape) if isinstance(spec, TensorSpec) else spec
    return TensorSpec(dtype, tuple(int(d) for d in shape))


def _spec_of(node) -> TensorSpec | None:
    meta = None if node is None else node.meta.get("val")
    if isinstance(meta, torch.Tensor) and all(isinstance(d, int) for d in meta.shape):
        return TensorSpec(meta.dtype, tuple(int(d) for d in meta.shape))
    return None


def receive_contracts(plan: SplitPlan, program: Program, label: Label
                      ) -> dict[str, ChannelContract]:
    """The contracts of `label`'s plan channels: `plan.recv_channels(label)`,
    and the dtype/shape each value has in `program`, the program the plan was
    split from; each one's `later_bytes`, what its sender sends `label`
    after it in the step."""
    nodes = {node.name: node for node in program.graph.nodes}
    specs = {channel.name: tuple(_spec_of(nodes.get(v)) for v in channel.values)
             for channel in plan.recv_channels(label)}
    # Bytes each sender still sends after each channel, walking the step backwards.
    later: dict[str, int | None] = {}
    after: dict[Label, int | None] = {}
    for instr in reversed(plan.process(label).schedule):
        if instr.kind is OpKind.RECV:
            src = plan.channel(instr.target).src
            known = after.get(src, 0)
            later[instr.target] = known
            sizes = [spec.nbytes if spec is not None else None for spec in specs[instr.target]]
            after[src] = (None if known is None or None in sizes else known + sum(sizes))
    if plan.staleness:
        # Under a staleness bound a data-sync message may wait in the mailbox
        # past its step (read a step later, or never): never lent, it holds no
        # room in the sender's ring, so the sender never waits on it.
        for sync in plan.data_syncs:
            if sync.reader == label:
                later[sync.channel] = None
    return {channel.name: ChannelContract(channel.src, specs[channel.name],
                                          later_bytes=later.get(channel.name))
            for channel in plan.recv_channels(label)}


class ReceiveContracts:
    """Every contract of one process: its plan's (`expect`, which also opens
    the process to messages) and the out-of-plan channels their owners
    `register` (before or after `expect`). Thread-safe: readers take `table`,
    an immutable snapshot that is replaced, never changed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._registered: dict[str, ChannelContract] = {}
        self._plan: dict[str, ChannelContract] | None = None
        self._table: Mapping[str, ChannelContract] | None = None
        self._opened = threading.Event()
        self._is_stopped = False

    @property
    def table(self) -> Mapping[str, ChannelContract] | None:
        """Channel name -> contract; None until `expect` (no message is taken yet)."""
        return self._table

    def wait(self, timeout_s: float) -> Mapping[str, ChannelContract] | None:
        """`table`, waiting up to `timeout_s` for `expect` (or `stop_waiting`)."""
        if not self._opened.is_set():  # an Event's wait takes its lock even when set
            self._opened.wait(timeout_s)
        return self._table

    def stop_waiting(self) -> None:
        """End every `wait` now, and later ones at once: the process closes or
        its job failed, so a message that came before `expect` is refused
        instead of holding a server thread (and the process's exit) for the
        rest of the wait."""
        self._is_stopped = True
        self._opened.set()

    def why_no_table(self, timeout_s: float) -> str:
        """Why `wait(timeout_s)` returned no table, for a refusal."""
        if self._is_stopped and self._table is None:
            return "this process closed (or its job failed) before it took its plan"
        return f"this process has no plan yet (expect() not called within {timeout_s:g} s)"

    def register(self, contracts: Mapping[str, ChannelContract]) -> None:
        """Add channels outside the plan; a channel registered again must keep
        its contract."""
        with self._lock:
            self._check_clashes(contracts, self._registered)
            self._check_clashes(contracts, self._plan or {})
            self._registered.update(contracts)
            self._publish()

    def expect(self, contracts: Mapping[str, ChannelContract]) -> None:
        """The plan's channels (replacing earlier ones); from now on messages are taken."""
        with self._lock:
            self._check_clashes(contracts, self._registered)
            self._plan = dict(contracts)
            self._publish()
        self._opened.set()

    @staticmethod
    def _check_clashes(new: Mapping[str, ChannelContract],
                       old: Mapping[str, ChannelContract]) -> None:
        for name, contract in new.items():
            known = old.get(name)
            if known is not None and known != contract:
                raise TransportError(
                    f"channel {name!r} is registered twice with different contracts: "
                    f"{known} and {contract}; each channel has one owner")

    def _publish(self) -> None:
        if self._plan is not None:
            self._table = MappingProxyType({**self._registered, **self._plan})


def refusal_prefix(receiver: Label, key: MessageKey, src: str, via: str = "") -> str:
    """`[worker 1] refused channel 'w0->w1#0' step 3 from 'w0' (via)`: how every
    refusal starts. `src` is the sender's name as the message gives it."""
    return (f"[{receiver.describe()}] refused channel "
            f"{key.channel[:_MAX_QUOTED_CHANNEL]!r} step {key.step} from "
            f"{src[:_MAX_QUOTED_SRC]!r}{f' ({via})' if via else ''}")


def find_contract(table: Mapping[str, ChannelContract], key: MessageKey, src: str, *,
                  receiver: Label, via: str = "") -> ChannelContract:
    """The contract of `key`'s channel; `UnknownChannel` if `receiver` has none."""
    contract = table.get(key.channel)
    if contract is None:
        names = sorted(table)
        known = ", ".join(names[:_MAX_LISTED_CHANNELS]) or "none"
        more = ", ..." if len(names) > _MAX_LISTED_CHANNELS else ""
        raise UnknownChannel(
            f"{refusal_prefix(receiver, key, src, via)}: no such channel into this process "
            f"(it receives {known}{more}); the sender's plan differs from this one: same "
            f"script and cluster on every process?")
    return contract


def check_message(contract: ChannelContract, key: MessageKey, src: Label,
                  tensors: Sequence[TensorSpec] | Sequence[torch.Tensor], *,
                  receiver: Label, via: str = "") -> None:
    """Check one message against its channel's contract: the sender, then the
    number of tensors and each one's dtype and shape (`tensors` are the
    message's tensors or their specs).

    Raises `WrongSender` or `ChannelMismatch`, naming `receiver`, the channel,
    step and sender (and `via`, e.g. the peer's address), expected vs got.
    """
    if src is not contract.src and src != contract.src:
        raise WrongSender(
            f"{refusal_prefix(receiver, key, str(src), via)}: this channel comes from "
            f"{contract.src.describe()}, the envelope says {src.describe()}")
    expected = contract.tensors
    if expected is None:
        return  # a dynamic channel: its messages change size every time
    if len(tensors) != len(expected):
        raise ChannelMismatch(
            f"{refusal_prefix(receiver, key, str(src), via)}: expected {len(expected)} "
            f"tensors, got {len(tensors)}; the sender's plan differs from this one")
    for index, (got, spec) in enumerate(zip(tensors, expected)):
        if spec is None:
            continue
        if isinstance(got, torch.Tensor):
            got = TensorSpec.of(got)
        if got.dtype != spec.dtype or got.shape != spec.shape:
            raise ChannelMismatch(
                f"{refusal_prefix(receiver, key, str(src), via)}: tensor {index} expected "
                f"{describe_spec(spec)}, got {got}; the sender's step differs from the plan "
                f"(same script and batch shapes on every process? autocast changing "
                f"dtypes?)")
