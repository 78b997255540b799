"""A transport that runs a whole split program inside one process.

For testing the splitter without sockets: each process of the plan is a
thread, and a send drops the tensors straight into the receiver's mailbox.
Never a stand-in where real processes are asked for.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from splitrun.splitter.labels import Label

from .mailbox import Mailbox
from .protocol import MessageKey

__all__ = ["LoopbackHub", "LoopbackTransport"]


class LoopbackHub:
    """The shared mailboxes of all in-process peers."""

    def __init__(self, labels: Iterable[Label], incarnation: int = 0) -> None:
        self.mailboxes = {label: Mailbox(label, incarnation) for label in labels}

    def transport(self, label: Label) -> LoopbackTransport:
        return LoopbackTransport(self, label)

    def abort(self, error: BaseException) -> None:
        for mailbox in self.mailboxes.values():
            mailbox.abort(error)


class LoopbackTransport:
    def __init__(self, hub: LoopbackHub, label: Label) -> None:
        self.hub = hub
        self.label = label

    def send(self, dst: Label, key: MessageKey, tensors: Sequence[torch.Tensor]) -> None:
        # The split program is functional (no op writes its inputs), so the
        # receiver may share the sender's tensors.
        self.hub.mailboxes[dst].put(key, self.label, tensors)

    def recv(self, src: Label, key: MessageKey, timeout_s: float,
             control=None) -> list[torch.Tensor]:
        return self.hub.mailboxes[self.label].take(key, src, timeout_s, control)

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
