"""A transport that runs a whole split program inside one process.

For testing the splitter without sockets: each process of the plan is a
thread, and a send drops the tensors straight into the receiver's mailbox.
Once a receiver has its contracts (`expect`), every message is checked
against them as the gRPC transport checks it, and a mismatch is raised in the
sender. Never a stand-in where real processes are asked for.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from splitrun.splitter.labels import Label

from ..errors import TransportError
from .contract import ChannelContract, ReceiveContracts, check_message, find_contract
from .dtypes import TensorSpec
from .filled import Fill, fill_then_send
from .keys import MessageKey
from .mailbox import Mailbox

__all__ = ["LoopbackHub", "LoopbackTransport"]


class LoopbackHub:
    """The shared mailboxes and receive contracts of all in-process peers."""

    def __init__(self, labels: Iterable[Label], incarnation: int = 0) -> None:
        labels = list(labels)
        self.mailboxes = {label: Mailbox(label, incarnation) for label in labels}
        self.contracts = {label: ReceiveContracts() for label in labels}

    def transport(self, label: Label) -> LoopbackTransport:
        return LoopbackTransport(self, label)

    def abort(self, error: BaseException) -> None:
        for mailbox in self.mailboxes.values():
            mailbox.abort(error)


class LoopbackTransport:
    """`label`'s side of the hub: the `Transport` protocol inside one process."""

    def __init__(self, hub: LoopbackHub, label: Label) -> None:
        self.hub = hub
        self.label = label

    # -- lifecycle: the hub knows every peer from the start --

    def start(self) -> str:
        return f"loopback:{self.label}"

    def set_identity(self, label: Label, incarnation: int) -> None:
        mailbox = self.hub.mailboxes[self.label]
        if label != self.label or incarnation != mailbox.incarnation:
            raise TransportError(
                f"[{self.label.describe()}] a loopback transport keeps its label and the hub's "
                f"incarnation {mailbox.incarnation}; got {label} and {incarnation}")

    def set_peers(self, peers: Mapping[Label, str]) -> None:
        unknown = sorted(str(peer) for peer in peers if peer not in self.hub.mailboxes)
        if unknown:
            raise TransportError(f"[{self.label.describe()}] {', '.join(unknown)} are not on "
                                 f"this loopback hub")

    def send(self, dst: Label, key: MessageKey, tensors: Sequence[torch.Tensor]) -> None:
        table = self.hub.contracts[dst].table
        if table is not None:
            contract = find_contract(table, key, str(self.label), receiver=dst)
            check_message(contract, key, self.label, tensors, receiver=dst)
        # The split program is functional (no op writes its inputs), so the
        # receiver may share the sender's tensors.
        self.hub.mailboxes[dst].put(key, self.label, tensors)

    def send_filled(self, dst: Label, key: MessageKey, specs: Sequence[TensorSpec],
                    fill: Fill) -> None:
        fill_then_send(self.send, dst, key, specs, fill)

    def recv(self, src: Label, key: MessageKey, timeout_s: float,
             control=None) -> list[torch.Tensor]:
        return self.hub.mailboxes[self.label].take(key, src, timeout_s, control)

    def is_lent(self, tensor: torch.Tensor) -> bool:
        return False  # messages are the sender's tensors, never transport memory

    def expect(self, contracts: Mapping[str, ChannelContract]) -> None:
        self.hub.contracts[self.label].expect(contracts)

    def register(self, contracts: Mapping[str, ChannelContract]) -> None:
        self.hub.contracts[self.label].register(contracts)

    def pending(self) -> list[MessageKey]:
        """The keys of messages delivered here and not received yet."""
        return self.hub.mailboxes[self.label].pending()

    def abort(self, error: BaseException) -> None:
        self.hub.mailboxes[self.label].abort(error)

    def finish_at(self, num_steps: int) -> None:
        self.hub.mailboxes[self.label].finish_at(num_steps)

    def route(self, prefix: str, handler) -> None:
        self.hub.mailboxes[self.label].route(prefix, handler)

    def flush(self, timeout_s: float) -> None:
        pass  # sends are delivered synchronously

    def close(self) -> None:
        pass
