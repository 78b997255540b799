"""Messages between workers' row caches and the servers' table shards.

Out of the step's plan, on the ordinary tensor transport: worker r sends
requests on `@emb:w<r>`, server k answers on `@emb:s<k>`. A message key's step
field carries the request's sequence number (so every message has its own
key); the training step is in the header. Every request starts with an int64
header `[op, table index, step]`:

    PULL   [header, ids]                      -> [rows, *state]   (state: write-back)
    PUSH   [header, ids, rows, *state]        (write-back: evicted or flushed dirty rows)
    GRADS  [header, ids, grads, lr, step]     (several workers: this worker's gradient)
    DUMP   [header]                           -> [rows, *state] of the whole shard
    SAVE   [header, directory (uint8, utf-8)] -> [report (uint8)]: the server writes
                                                 its rows of every table there

`step` in a PULL's header is the step the rows must be fresh for: with several
workers the server answers once the updates of every earlier step are applied.
"""

from __future__ import annotations

from enum import IntEnum

import torch

from splitrun.splitter.labels import Label

from ..errors import MessageRejected
from ..transport.protocol import OUT_OF_PLAN

__all__ = ["Op", "request_channel", "reply_channel", "header", "read_header"]


class Op(IntEnum):
    PULL = 1
    PUSH = 2
    GRADS = 3
    DUMP = 4
    SAVE = 5


PREFIX = f"{OUT_OF_PLAN}emb:"


def request_channel(worker: Label) -> str:
    return f"{PREFIX}{worker}"


def reply_channel(server: Label) -> str:
    return f"{PREFIX}{server}"


def header(op: Op, table: int, step: int) -> torch.Tensor:
    return torch.tensor([int(op), table, step], dtype=torch.int64)


def read_header(tensor: torch.Tensor) -> tuple[Op, int, int]:
    if tensor.dtype != torch.int64 or tensor.shape != (3,):
        raise MessageRejected(f"an embedding request header is int64[3], got "
                         f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}")
    op, table, step = (int(v) for v in tensor)
    try:
        return Op(op), table, step
    except ValueError:
        raise MessageRejected(f"unknown embedding request op {op}; known: "
                              f"{', '.join(o.name for o in Op)}") from None
