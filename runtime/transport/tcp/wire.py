"""The data connection's bytes: a hello carrying the job's token, then frames.

Client (sender) to server (receiver), after the TLS handshake when the job
has TLS:

    hello    MAGIC, u16 token length, the token (at most MAX_TOKEN_BYTES)
    frame    u8 kind, u32 length, `length` bytes, and for MESSAGE the payload:
             MESSAGE  the serialized envelope (`framing.EnvelopeWriter`), then
                      the envelope's total_bytes of tensor data, unframed
             SPLIT    u8 parts, then the envelope: a message striped over
                      `parts` connections (`stripes`); its first part follows
             SYNC     nothing: the server answers DELIVERED
             BYE      nothing: the sender is done; the server closes

A stripe connection (after its own hello and ACCEPTED) sends JOIN (the
main connection's link id, u8 its index), answered by ACCEPTED, then for
each striped message PART (u64 the message's index on the main connection)
followed by its part of the bytes, unframed; BYE at the end.

Server to client: frames of the same shape: ACCEPTED (the token passed;
its body: LINK_ID_BYTES naming the connection, for stripes to join),
DELIVERED (u64: messages put in the mailbox so far on this connection), or
REFUSED (u64 delivered before it, then "<STATUS>\\n<details>"), after which
the server closes. Status names are gRPC's, so a refusal reads the same
whichever path carried the message.
"""

from __future__ import annotations

import socket
import struct

__all__ = ["MAGIC", "MAX_TOKEN_BYTES", "MAX_ENVELOPE_BYTES", "MAX_REPLY_BYTES", "HEADER",
           "MAX_STRIPES", "LINK_ID_BYTES", "MESSAGE", "SYNC", "BYE", "SPLIT", "PART", "JOIN",
           "ACCEPTED", "DELIVERED", "REFUSED", "hello", "token_length", "frame", "split", "part",
           "seq_of", "join", "parse_join", "delivered", "count_of", "refusal", "parse_refusal",
           "read_exact", "read_into", "PeerClosed"]

MAGIC = b"splitrun-data/1\n"
MAX_TOKEN_BYTES = 4096
# An envelope is a few hundred bytes; this bounds what a bad peer makes us buffer.
MAX_ENVELOPE_BYTES = 1 << 20
MAX_REPLY_BYTES = 1 << 16
HEADER = struct.Struct("<BI")
_TOKEN_LENGTH = struct.Struct("<H")
_COUNT = struct.Struct("<Q")

# Connections per peer at most (the main one and its stripes).
MAX_STRIPES = 16
LINK_ID_BYTES = 16
_JOIN = struct.Struct(f"<{LINK_ID_BYTES}sB")

MESSAGE, SYNC, BYE, SPLIT, PART, JOIN = 1, 2, 3, 4, 5, 6
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


def split(parts: int, envelope: bytes) -> bytes:
    """The header of a message striped over `parts` connections."""
    return HEADER.pack(SPLIT, len(envelope) + 1) + bytes((parts,)) + envelope


def part(seq: int) -> bytes:
    return frame(PART, _COUNT.pack(seq))


def seq_of(body: bytes) -> int:
    return _COUNT.unpack(body)[0]


def join(link_id: bytes, index: int) -> bytes:
    return frame(JOIN, _JOIN.pack(link_id, index))


def parse_join(body: bytes) -> tuple[bytes, int]:
    """(link id, index); ValueError if the body is not a JOIN's."""
    if len(body) != _JOIN.size:
        raise ValueError(f"a join of {len(body)} bytes (expected {_JOIN.size})")
    return _JOIN.unpack(body)


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
