"""Messages between workers' row caches and the servers' table shards.

Out of the step's plan, on the ordinary tensor transport: worker r sends
requests on `@emb:w<r>`, server k answers on `@emb:s<k>`. A message key's step
field carries the request's sequence number (so every message has its own
key); the training step is in the header. A request names the tables it is
about, so one message per server carries every table's part of a step:

    [header int64[3] = (op, step, number of tables), table indices int64[n],
     then each table's tensors, in the order of the indices]

    PULL   per table: ids                       -> per table: rows, *state
                                                   (state: write-back tables)
    PUSH   per table: ids, rows, *state         (write-back: evicted or flushed dirty rows)
    PUSH_PULL per table: ids, rows, *state, ids -> per table: rows, *state
                                                (write-back tables: one plan's evicted rows
                                                and misses, one message; the reply first)
    GRADS  per table: ids, grads, lr, step      (several workers: this worker's gradients)
    DUMP   one table, nothing else              -> rows, *state of the whole shard
    SAVE   no table; the directory (uint8, utf-8) -> [report (uint8)]: the server
                                                   writes its rows of every table there

`step` in a PULL's header is the step the rows must be fresh for: with several
workers the server answers once the updates of every earlier step are applied.

A dynamic table one worker caches (write-back) names the step's distinct ids
seen before the ids wanted, in a PULL (seen, ids) and a PUSH_PULL (ids, rows,
*state, seen, ids); its reply part is rows, *state, has_rows (bool, over seen),
the ids the step expired, and each row state's starting value (float64[n]).

Rows gathered from a table or cache for a message (a reply's, a write-back's,
gradients by server) are `Gather`s in the message: `send_message` gathers them
straight into the message's memory where the transport lends it (a shared-
memory ring's slot, `Transport.send_filled`), one copy instead of two.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import torch

from splitrun.splitter.labels import Label

from ...errors import MessageRejected
from ...transport.dtypes import TensorSpec
from ...transport.protocol import OUT_OF_PLAN, MessageKey, Transport
from .row_copy import RowArray, gather_rows_into

__all__ = ["Op", "Gather", "Item", "request_channel", "reply_channel", "request", "read_request",
           "send_message", "nbytes_of_items"]


class Op(IntEnum):
    PULL = 1
    PUSH = 2
    GRADS = 3
    DUMP = 4
    SAVE = 5
    PUSH_PULL = 6


PREFIX = f"{OUT_OF_PLAN}emb:"


def request_channel(worker: Label) -> str:
    return f"{PREFIX}{worker}"


def reply_channel(server: Label) -> str:
    return f"{PREFIX}{server}"


@dataclass(frozen=True, slots=True)
class Gather:
    """A tensor of a message: `rows[index]` (whole rows), gathered when the
    message is written, into its memory. `rows` a tensor, or a `RowArray`
    (a server's shard, viewed once) with a numpy `index` checked in range."""

    rows: torch.Tensor | RowArray
    index: torch.Tensor | np.ndarray

    @property
    def spec(self) -> TensorSpec:
        count = self.index.size if isinstance(self.index, np.ndarray) else self.index.numel()
        return TensorSpec(self.rows.dtype, (count, *self.rows.shape[1:]))

    def write(self, out: torch.Tensor) -> None:
        if isinstance(self.rows, RowArray):
            self.rows.take_into(out, self.index)
        else:
            gather_rows_into(out, self.rows, self.index.reshape(-1))


# A tensor of a message, as it is or gathered.
Item = torch.Tensor | Gather


def nbytes_of_items(items: Sequence[Item]) -> int:
    return sum(item.spec.nbytes if isinstance(item, Gather) else item.nbytes for item in items)


def send_message(transport: Transport, dst: Label, key: MessageKey, items: Sequence[Item]
                 ) -> None:
    """Send `items`, each `Gather` gathered straight into the message (its
    rows as they are now: before this returns), the tensors copied in."""
    if not any(isinstance(item, Gather) for item in items):
        transport.send(dst, key, list(items))
        return
    specs = [item.spec if isinstance(item, Gather) else
             TensorSpec(item.dtype, tuple(item.shape)) for item in items]

    def fill(tensors: list[torch.Tensor]) -> None:
        for item, out in zip(items, tensors):
            if isinstance(item, Gather):
                item.write(out)
            elif out.numel():
                out.copy_(item)
    transport.send_filled(dst, key, specs, fill)


def request(op: Op, step: int, tables: list[int], parts: list[list[Item]] | None = None,
            extra: list[Item] = ()) -> list[Item]:
    """The tensors of one request: header, table indices, each table's part
    (`parts`, in the order of `tables`), then `extra`."""
    tensors = [torch.tensor([int(op), step, len(tables)], dtype=torch.int64),
               torch.tensor(tables, dtype=torch.int64)]
    for part in parts or ():
        tensors += part
    return tensors + list(extra)


def read_request(tensors: list[torch.Tensor]) -> tuple[Op, int, list[int], list[torch.Tensor]]:
    """(op, step, table indices, the tensors after them)."""
    if len(tensors) < 2:
        raise MessageRejected(f"an embedding request holds a header and table indices, got "
                              f"{len(tensors)} tensors")
    header, tables = tensors[0], tensors[1]
    if header.dtype != torch.int64 or header.shape != (3,):
        raise MessageRejected(f"an embedding request header is int64[3], got "
                              f"{str(header.dtype).removeprefix('torch.')}{list(header.shape)}")
    op, step, count = header.tolist()
    if tables.dtype != torch.int64 or tables.shape != (count,):
        raise MessageRejected(f"an embedding request's table indices are int64[{count}], got "
                              f"{str(tables.dtype).removeprefix('torch.')}{list(tables.shape)}")
    try:
        return Op(op), step, tables.tolist(), tensors[2:]
    except ValueError:
        raise MessageRejected(f"unknown embedding request op {op}; known: "
                              f"{', '.join(o.name for o in Op)}") from None
