"""Worker 1 in its own process, for tests/runtime/transport/test_data_plane.py.

    tcp_peer.py TOKEN INCARNATION ADDRESS_OF_WORKER_0 MODE

A RoutedTransport that must use the tcp data plane (SPLITRUN_TRANSPORT=tcp).
It starts, prints "address HOST:PORT", takes worker 0 at ADDRESS as its peer
and prints "ready tcp connections=N" (N: the connections to it, stripes
included). MODE `big`: it sends worker 0 a 64 MiB float32 tensor on
channel "big" and its blake2b digest on "digest", flushes and closes. MODE
`hold`: it stays alive for the test to kill it (bounded)."""

import hashlib
import sys
import threading

import torch

from splitrun.runtime import MessageKey
from splitrun.runtime.transport.grpc import GrpcSettings, GrpcTransport
from splitrun.runtime.transport.router import RoutedTransport, TransportChoice
from splitrun.splitter import Label

# Bounds how long a held process waits to be killed by the test.
HOLD_S = 300.0
# Bounds the flush of the 64 MiB message.
FLUSH_S = 120.0


def main():
    token, incarnation, address, mode = sys.argv[1:5]
    incarnation = int(incarnation)
    torch.set_num_threads(1)
    transport = RoutedTransport(
        GrpcTransport(Label.worker(1), token=token, incarnation=incarnation,
                      settings=GrpcSettings(connect_timeout_s=30.0)),
        prefix=None, choice=TransportChoice.TCP)
    print("address", transport.start(), flush=True)
    transport.set_peers({Label.worker(0): address})
    print("ready", transport.kind_of(Label.worker(0)).value,
          f"connections={transport.tcp.connections(Label.worker(0))}", flush=True)
    if mode == "hold":
        threading.Event().wait(HOLD_S)
        return
    big = torch.randn(16 << 20, generator=torch.Generator().manual_seed(5))
    digest = hashlib.blake2b(big.numpy().tobytes()).digest()
    transport.send(Label.worker(0), MessageKey(incarnation, 0, "big"), [big])
    transport.send(Label.worker(0), MessageKey(incarnation, 0, "digest"),
                   [torch.frombuffer(bytearray(digest), dtype=torch.uint8)])
    transport.flush(FLUSH_S)
    transport.close()
    print("done", flush=True)


if __name__ == "__main__":
    main()
