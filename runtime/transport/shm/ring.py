"""A single-producer, single-consumer byte ring in shared memory between two
processes of one host: the payload path of the same-host transport.

Layout. One file per (job, sender, receiver) under /dev/shm, created mode
0600 with the job's random prefix (`splitrun-<hex>-<name>.ring`): a 4 KiB
header page (magic, version, capacity, closed flag) and `capacity` data bytes, reused for
every message. The positions do not live in the shared memory: the producer's
head (bytes published) and the consumer's tail (bytes consumed) travel as
8-byte records over a Unix stream socket (`...<name>.sock`) between the two.
That socket is the wake-up (no gRPC round trip), its syscalls order the
memory accesses on any CPU, and its end-of-file is how each side learns that
the other process died. The consumer reports its tail every quarter ring, so
a stream of small messages costs one record per message, not two.

CUDA tensors (`send_tensors`, `recv_payload_into_tensor`) are copied between
the device and the ring directly, the ring registered as pinned host memory
(`cudaHostRegister`) on first use, so the copies are DMA and still one per
side. (Coded; not run on a device yet.)

Messages. A frame is a 16-byte prefix (magic, header length and padding,
payload length), the header bytes (the transport's envelope), padding to a
64-byte boundary and the payload. A payload larger than the ring streams
through it in pieces: the producer copies each piece from the tensors' own
memory into the ring (one copy), the consumer copies it into the buffer it
chose for the message (one copy); nothing is allocated per message on either
side.

Lending. A payload of 1 MiB or more that fits in half the ring is written in
one piece (a skip frame fills the ring's end if needed), so the consumer may
take it without a copy: `lend_payload` returns a tensor over the ring's own
bytes, and the consumer reports them free only when the last tensor viewing
them is gone (a finalizer). The producer waits for that room like any other.

Clean-up. Once the consumer has attached, the producer unlinks both files:
the mapping stays valid for the two processes and nothing is left in /dev/shm
whatever happens to them later. Between creation and attachment the files
exist; `remove_job_segments(prefix)` removes every file of a job (a launcher
or a surviving process after a SIGKILL).

Modules. This one gathers the ring's public names; the parts live in
`job_files` (prefixes, paths, removal, boot id), `ring_segment` (the mapping,
its layout, the byte copies), `ring_records` (positions over the socket),
`ring_writer` (`RingWriter`, `RingSettings`), `ring_reader` (`RingReader`)
and `ring_errors`.
"""

from __future__ import annotations

from .job_files import (
    SHM_DIR,
    boot_id,
    job_file_path,
    new_job_prefix,
    remove_job_segments,
    ring_paths,
)
from .ring_errors import RingAttachTimeout, RingClosed, RingError, RingPeerGone
from .ring_reader import RingReader
from .ring_segment import LENDABLE_BYTES
from .ring_writer import RingSettings, RingWriter

__all__ = [
    "SHM_DIR",
    "LENDABLE_BYTES",
    "RingSettings",
    "RingError",
    "RingAttachTimeout",
    "RingPeerGone",
    "RingClosed",
    "RingWriter",
    "RingReader",
    "new_job_prefix",
    "ring_paths",
    "job_file_path",
    "remove_job_segments",
    "boot_id",
]
