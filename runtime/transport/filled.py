"""Messages filled in place: `Transport.send_filled(dst, key, specs, fill)`
sends a message of tensors shaped as `specs` whose contents `fill(tensors)`
writes. A transport that can lend its own memory for an outgoing message
(a shared-memory ring: the message's slot in the ring) hands `fill` tensors
viewing that memory, so a reply gathered from a table lands in the ring with
no copy of its own; the others (gRPC, the tcp data plane, loopback) hand it
new tensors and send those (`fill_then_send`): the same bytes arrive, as if
the tensors had been built first and sent.

The contract `fill` keeps: write every byte of every tensor (they are not
zeroed: a lent slot holds an earlier message's bytes), and keep no view of
them after it returns (lent memory is the transport's again). If `fill`
raises, nothing is sent and the error propagates; the transport stays usable.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from splitrun.splitter.labels import Label

from .dtypes import TensorSpec
from .keys import MessageKey

__all__ = ["Fill", "Send", "fill_then_send", "specs_of"]

# Writes a message's tensors, given in the order of its specs.
Fill = Callable[[list[torch.Tensor]], None]
# A transport's `send`.
Send = Callable[[Label, MessageKey, Sequence[torch.Tensor]], None]


def fill_then_send(send: Send, dst: Label, key: MessageKey, specs: Sequence[TensorSpec],
                   fill: Fill) -> None:
    """`send_filled` where the transport lends no memory: new tensors,
    filled, then sent (nothing is sent if `fill` raises)."""
    tensors = [torch.empty(spec.shape, dtype=spec.dtype) for spec in specs]
    fill(tensors)
    send(dst, key, tensors)


def specs_of(tensors: Sequence[torch.Tensor]) -> tuple[TensorSpec, ...]:
    """The specs of a message of `tensors` (to send tensors alike filled in place)."""
    return tuple(TensorSpec(t.dtype, tuple(t.shape)) for t in tensors)
