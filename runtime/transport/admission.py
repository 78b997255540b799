"""Admission: the one check every message coming into a process passes, over
gRPC or shared memory, before a byte of it is buffered.

A serialized envelope is checked against the process's `Endpoint`: its
incarnation (another run of the job is refused), the receive contracts (a
message that came before the plan's waits for `expect`, bounded), its
channel's contract (sender, count, dtype and shape of every tensor) and, for
a path that carries one peer's messages only (a ring), the sender. What
passes comes back as `Admitted`: the message key, its sender, its buffer
layout and its contract.

The fast path is the contract compiled (`_ChannelRule`): an envelope equal to
it meets the contract. An envelope that passed is remembered without its
step (see `EnvelopeWriter`): the next step's envelope of the same channel is
recognised by its bytes, without parsing or checking it again. Memos hold
for one identity and one contract table, and are forgotten when either is
replaced.

A refusal is a `MessageRejected` that says where, what was expected and what
came: `NotAdmitted` (another incarnation, or no plan yet), `UnknownChannel`,
`WrongSender`, `ChannelMismatch`, or the envelope's own faults. Each
transport tells the sender in its own way (a gRPC status, a message back).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

from splitrun.splitter.errors import LabelError
from splitrun.splitter.labels import Label

from ..errors import MessageRejected, WrongSender
from ..rpc.wire import splitrun_pb2
from .buffers import MessageLayout
from .contract import ChannelContract, check_message, find_contract, refusal_prefix
from .dtypes import IS_LITTLE_ENDIAN, dtype_name
from .endpoint import Endpoint, Identity
from .framing import is_step_free, parse_envelope, specs_from_envelope, split_step
from .keys import MessageKey

__all__ = ["Admission", "Admitted", "NotAdmitted"]

# Bounds the checked envelopes a receiver remembers (about one per channel).
_MAX_KNOWN_ENVELOPES = 4096


class NotAdmitted(MessageRejected):
    """A message refused before its channel's contract is looked at: it is
    from another run of the job, or it came before this process took its
    plan and none came in time."""


class Admitted(NamedTuple):
    """A message that passed: its key and sender, the layout of its buffer,
    its channel's contract, and the receiver as it was when it came (the
    mailbox it goes to). A tuple: made once per message, it costs a fifth of
    a frozen dataclass."""

    key: MessageKey
    src: Label
    layout: MessageLayout
    contract: ChannelContract
    receiver: Identity


@dataclass(frozen=True, slots=True)
class _ChannelRule:
    """A `ChannelContract` compiled for admission: a message whose envelope
    matches `wire_metas` (and comes from `src_text`) meets the contract, and
    its buffer layout is computed once."""

    contract: ChannelContract
    src_text: str
    wire_metas: list[tuple[str, tuple[int, ...]]] | None  # None: some shape is dynamic
    layout: MessageLayout | None


def _compile_rule(contract: ChannelContract) -> _ChannelRule:
    if not contract.is_static:
        return _ChannelRule(contract, str(contract.src), None, None)
    wire_metas = [(dtype_name(spec.dtype), spec.shape) for spec in contract.tensors]
    return _ChannelRule(contract, str(contract.src), wire_metas, MessageLayout(contract.tensors))


class Admission:
    """Admits messages into `endpoint`. `sender`: the one peer whose messages
    this path carries (a shared-memory ring), checked against every envelope;
    None for a path any peer sends on (a gRPC server). One per receiving
    path: its memos are not shared."""

    def __init__(self, endpoint: Endpoint, *, sender: Label | None = None) -> None:
        self._endpoint = endpoint
        self._sender = sender
        self._valid_for: tuple[Identity, Mapping[str, ChannelContract] | None] | None = None
        self._rules: dict[str, _ChannelRule] = {}
        self._known: dict[bytes, tuple[_ChannelRule, MessageLayout, int, str]] = {}

    def admit(self, raw: memoryview, via: str) -> Admitted:
        """Check the serialized envelope `raw` that came `via` (a gRPC peer's
        address, "worker 0 over shared memory"); the message, or the refusal."""
        endpoint = self._endpoint
        receiver = endpoint.identity
        # Returns at once once `expect` has run; a message that came first waits.
        table = endpoint.contracts.wait(endpoint.expect_timeout_s)
        if self._valid_for is None or self._valid_for[0] is not receiver \
                or self._valid_for[1] is not table:
            # Rules and envelopes checked against another table or identity prove nothing.
            self._valid_for = (receiver, table)
            self._rules = {}
            self._known = {}
        split = split_step(raw)
        if split is not None:
            # A bytes key: hashing a memoryview hashes the whole chunk under it.
            known = self._known.get(split[1].tobytes())
            if known is not None:
                rule, layout, incarnation, channel = known
                contract = rule.contract
                return Admitted(MessageKey(incarnation, split[0], channel), contract.src,
                                layout, contract, receiver)
        try:
            envelope = parse_envelope(raw)
        except MessageRejected as exc:
            raise MessageRejected(f"{receiver.tag} refused a message from {via}: {exc}") from None
        rule = self._rule(table, envelope.channel) if table is not None else None
        if (rule is not None and rule.wire_metas is not None
                and envelope.incarnation == receiver.incarnation
                and envelope.src == rule.src_text
                and (self._sender is None or rule.contract.src == self._sender)
                and envelope.total_bytes == rule.layout.total_bytes
                and envelope.little_endian == IS_LITTLE_ENDIAN
                and [(m.dtype, tuple(m.shape)) for m in envelope.tensors] == rule.wire_metas):
            layout = rule.layout  # exactly what the contract says
        else:
            layout = self._check(receiver, table, envelope, via)
            rule = self._rule(table, envelope.channel)
        if split is not None and split[0] == envelope.step and is_step_free(split[1]):
            if len(self._known) >= _MAX_KNOWN_ENVELOPES:
                self._known = {}
            self._known[split[1].tobytes()] = (rule, layout, envelope.incarnation,
                                               envelope.channel)
        return Admitted(MessageKey(envelope.incarnation, envelope.step, envelope.channel),
                        rule.contract.src, layout, rule.contract, receiver)

    def _rule(self, table: Mapping[str, ChannelContract], channel: str) -> _ChannelRule | None:
        rule = self._rules.get(channel)
        if rule is None:
            contract = table.get(channel)
            if contract is None:
                return None
            rule = self._rules[channel] = _compile_rule(contract)
        return rule

    def _check(self, receiver: Identity, table: Mapping[str, ChannelContract] | None,
               envelope: splitrun_pb2.Envelope, via: str) -> MessageLayout:
        """The full check of an envelope the fast path did not pass: refuse it
        with the precise reason, or return the layout of a channel whose
        shapes the contract leaves open."""
        key = MessageKey(envelope.incarnation, envelope.step, envelope.channel)
        where = refusal_prefix(receiver.label, key, envelope.src, via)
        if envelope.incarnation != receiver.incarnation:
            run = "a previous" if envelope.incarnation < receiver.incarnation else "a newer"
            raise NotAdmitted(
                f"{where}: incarnation {envelope.incarnation}, but the job's incarnation is "
                f"{receiver.incarnation}; the sender belongs to {run} run of the job")
        if table is None:
            why = self._endpoint.contracts.why_no_table(self._endpoint.expect_timeout_s)
            raise NotAdmitted(f"{where}: {why}")
        contract = find_contract(table, key, envelope.src, receiver=receiver.label, via=via)
        try:
            src = Label.parse(envelope.src)
        except LabelError as exc:
            raise MessageRejected(f"{where}: {exc}") from None
        if self._sender is not None and src != self._sender:
            raise WrongSender(f"{where}: this path carries {self._sender.describe()}'s "
                              f"messages only, the envelope says {src.describe()}")
        try:
            specs = specs_from_envelope(envelope, max_bytes=self._endpoint.max_message_bytes)
        except MessageRejected as exc:  # the envelope's own faults
            raise MessageRejected(f"{where}: {exc}") from None
        check_message(contract, key, src, specs, receiver=receiver.label, via=via)
        return MessageLayout(specs)
