"""One end of a shared-memory ring in its own process, for tests/runtime/transport/test_shm_ring.py
and tests/e2e/test_shm_ring_e2e.py.

    ring_peer.py produce PREFIX NAME CAPACITY KIND [ARG]
    ring_peer.py consume PREFIX NAME

`produce` creates the ring, prints "created", and sends: KIND `ordered N`
(N messages of varying sizes), `big NBYTES` (one message), `int32 NUMEL` (one
tensor holding arange(NUMEL) as int32), `cuda NUMEL` (two CUDA tensors:
arange(7) and arange(NUMEL), float32, times 0.5), `idle` (nothing). Then it prints
"sent" and closes the ring (what it sent stays readable). With
SPLITRUN_TEST_HOLD=1 it stays alive instead, for the test to kill it.
`consume` attaches, prints "attached" and stays alive likewise.
Every process this starts is ended by the test, by its pid."""

import os
import sys
import threading

import torch

from splitrun.runtime.transport.shm.ring import RingReader, RingSettings, RingWriter

# Bounds each send: the test reads promptly.
SEND_TIMEOUT_S = 120.0
# Bounds how long a held process waits to be killed by the test.
HOLD_S = 300.0


def hold():
    if os.environ.get("SPLITRUN_TEST_HOLD") == "1":
        threading.Event().wait(HOLD_S)


def ordered_message(index: int) -> tuple[bytes, bytes]:
    size = (index * 7919) % 100_000
    return f"message {index}".encode(), bytes([index % 256]) * size


def produce(prefix, name, capacity, kind, arg=None):
    writer = RingWriter(prefix, name, owner="worker 7", peer="server 0",
                        settings=RingSettings(capacity_bytes=int(capacity)))
    print("created", flush=True)
    if kind == "ordered":
        for index in range(int(arg)):
            header, payload = ordered_message(index)
            writer.send(header, [memoryview(payload)], SEND_TIMEOUT_S)
    elif kind == "big":
        payload = bytes(range(256)) * (int(arg) // 256)
        writer.send(b"big", [memoryview(payload)], SEND_TIMEOUT_S)
    elif kind == "int32":
        tensor = torch.arange(int(arg), dtype=torch.int32)
        writer.send_tensors(b"int32", [tensor], SEND_TIMEOUT_S)
    elif kind == "cuda":
        tensor = torch.arange(int(arg), dtype=torch.float32, device="cuda") * 0.5
        writer.send_tensors(b"cuda", [tensor[:7], tensor], SEND_TIMEOUT_S)
    else:
        writer.wait_attached(SEND_TIMEOUT_S)
    print("sent", flush=True)
    hold()
    writer.close()


def consume(prefix, name):
    reader = RingReader.attach(prefix, name, owner="server 0", peer="worker 7",
                               timeout_s=SEND_TIMEOUT_S)
    print("attached", flush=True)
    hold()
    reader.close()


if __name__ == "__main__":
    {"produce": produce, "consume": consume}[sys.argv[1]](*sys.argv[2:])
