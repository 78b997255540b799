"""The data connection's bytes: a hello carrying the job's token, then frames.

Client (sender) to server (receiver), after the TLS handshake when the job
has TLS:

    hello    MAGIC, u16 token length, the token (at most MAX_TOKEN_BYTES)
    frame    u8 kind, u32 length, `length` bytes, and for MESSAGE the payload:
             MESSAGE  the serialized envelope (`framing.EnvelopeWriter`), then
                      the envelope's total_bytes of tensor data, unframed
             SYNC     nothing: the server answers DELIVERED
             BYE      nothing: the sender is done; the server closes

Server to client: frames of the same shape: ACCEPTED (the token passed),
DELIVERED (u64: messages put in the mailbox so far on this connection), or
REFUSED (u64 delivered before it, then "<STATUS>\\n<details>"), after which
the server closes. Status names are gRPC's, so a refusal reads the same
whichever path carried the message.
"""

from __future__ import annotations

import socket
import struct

__all__ = ["MAGIC", "MAX_TOKEN_BYTES", "MAX_ENVELOPE_BYTES", "MAX_REPLY_BYTES", "HEADER",
           "MESSAGE", "SYNC", "BYE", "ACCEPTED", "DELIVERED", "REFUSED", "hello", "token_length",
           "frame", "delivered", "count_of", "refusal", "parse_refusal", "read_exact",
           "read_into", "PeerClosed"]

MAGIC = b"splitrun-data/1\n"
MAX_TOKEN_BYTES = 4096
# An envelope is a few hundred bytes; this bounds what a bad peer makes us buffer.
MAX_ENVELOPE_BYTES = 1 << 20
MAX_REPLY_BYTES = 1 << 16
HEADER = struct.Struct("<BI")
_TOKEN_LENGTH = struct.Struct("<H")
_COUNT = struct.Struct("<Q")

MESSAGE, SYNC, BYE = 1, 2, 3
ACCEPTED, DELIVERED, REFUSED = 10, 11, 12


class PeerClosed(ConnectionError):
    """The other end closed the connection (end of file)."""


def hello(token: str) -> bytes:
    raw = token.encode()
    return MAGIC + _TOKEN_LENGTH.pack(len(raw)) + raw


def token_length(raw: bytes) -> int:
    return _TOKEN_LENGTH.unpack(raw)[0]


def frame(kind: int, body: bytes = b"") -> bytes:
    return HEADER.pack(kind, len(body)) + body


def delivered(count: int) -> bytes:
    return frame(DELIVERED, _COUNT.pack(count))


def count_of(body: bytes) -> int:
    return _COUNT.unpack_from(body)[0]


def refusal(count: int, status: str, details: str) -> bytes:
    body = _COUNT.pack(count) + f"{status}\n{details}".encode()[:MAX_REPLY_BYTES - 8]
    return frame(REFUSED, body)


def parse_refusal(body: bytes) -> tuple[int, str, str]:
    """(messages delivered before the refusal, status name, details)."""
    count = _COUNT.unpack_from(body)[0] if len(body) >= 8 else 0
    status, _, details = body[8:].decode(errors="replace").partition("\n")
    return count, status, details


def read_into(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from `sock` (the kernel copies straight into it)."""
    got, size = 0, view.nbytes
    while got < size:
        count = sock.recv_into(view[got:], size - got)
        if count == 0:
            raise PeerClosed(f"the connection ended after {got} of {size} bytes")
        got += count


def read_exact(sock: socket.socket, size: int) -> bytes:
    buffer = bytearray(size)
    read_into(sock, memoryview(buffer))
    return bytes(buffer)
