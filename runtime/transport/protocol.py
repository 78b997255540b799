"""The `Transport` protocol: how a process hands tensors to its peers, and
its lifecycle, which every transport of a job goes through:

    address = transport.start()                  # receiving; tell the scheduler
    transport.set_identity(label, incarnation)   # what the scheduler assigned
    transport.set_peers({peer: address, ...})    # where the others are
    transport.register(...); transport.expect(...)   # contracts; messages let in
    ... send / recv / flush ...
    transport.close()

Sends never wait for the receiver to reach its receive (the receiver buffers),
and every receive has a deadline. That, with schedules in one global order, is
what makes a split program deadlock-free.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch

from splitrun.splitter.labels import Label

from .contract import ChannelContract
from .dtypes import TensorSpec
from .filled import Fill
from .keys import OUT_OF_PLAN, MessageKey

__all__ = ["MessageKey", "Transport", "OUT_OF_PLAN"]


class Transport(Protocol):
    label: Label

    # -- lifecycle --

    def start(self) -> str:
        """Start receiving; the address peers reach this process at."""

    def set_identity(self, label: Label, incarnation: int) -> None:
        """The label and incarnation the scheduler assigned; before `set_peers`."""

    def set_peers(self, peers: Mapping[Label, str]) -> None:
        """Where each peer listens (`start`'s address); merged with earlier calls."""

    # -- messages --

    def send(self, dst: Label, key: MessageKey, tensors: Sequence[torch.Tensor]) -> None:
        """Queue `tensors` for `dst`; returns without waiting for the receiver."""

    def send_filled(self, dst: Label, key: MessageKey, specs: Sequence[TensorSpec],
                    fill: Fill) -> None:
        """Send a message of tensors shaped as `specs` that `fill(tensors)`
        writes: into the transport's own memory where it can lend it (a
        shared-memory ring's slot: no copy), else into new tensors, then sent
        as `send` would (see `filled`). Nothing is sent if `fill` raises."""

    def recv(self, src: Label, key: MessageKey, timeout_s: float,
             control: tuple[MessageKey, Callable[[Label, list[torch.Tensor]], None]] | None = None,
             ) -> list[torch.Tensor]:
        """The tensors `src` sent under `key`; raises `RecvTimeout` past the deadline.
        While waiting, a message under `control`'s key goes to its handler."""

    def is_lent(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` views memory the transport lent for a receive (see
        `ChannelContract.lendable`): the executor copies such a tensor before
        it outlives the step."""

    def abort(self, error: BaseException) -> None:
        """Wake every pending receive of this process with `error`."""

    def finish_at(self, num_steps: int) -> None:
        """Receives for steps >= `num_steps` end with `JobFinished`."""

    def flush(self, timeout_s: float) -> None:
        """Wait until every queued send has been delivered."""

    def route(self, prefix: str,
              handler: Callable[[MessageKey, Label, list[torch.Tensor]], None]) -> None:
        """Hand incoming messages on channels starting with `prefix` to `handler`."""

    def expect(self, contracts: Mapping[str, ChannelContract]) -> None:
        """The contracts of this process's plan channels (see `receive_contracts`);
        from now on every message is checked against its channel's contract."""

    def register(self, contracts: Mapping[str, ChannelContract]) -> None:
        """Contracts of channels outside the plan, registered by their owners
        before their messages can arrive."""

    def close(self) -> None:
        """Release resources; pending sends are flushed or reported."""
