"""Worker 1 in its own process, for tests/runtime/transport/test_transports.py and
tests/e2e/test_transports_e2e.py.

    transport_peer.py KIND PREFIX TOKEN INCARNATION ADDRESS_OF_WORKER_0 MODE

KIND is grpc or shm (a RoutedTransport that must use shared memory). It starts
its transport, prints "address HOST:PORT", takes worker 0 at ADDRESS as its
peer and prints "ready". MODE `hold`: it stays alive for the test to kill it
(bounded). MODE `big`: it sends worker 0 a 1 GiB int64 tensor on channel
"big" and its blake2b digest on "digest", flushes and closes."""

import hashlib
import sys
import threading

import torch

from splitrun.runtime import MessageKey
from splitrun.runtime.transport import ChannelContract
from splitrun.runtime.transport.grpc import GrpcSettings, GrpcTransport
from splitrun.runtime.transport.router import RoutedTransport, TransportChoice
from splitrun.splitter import Label

# Bounds how long a held process waits to be killed by the test.
HOLD_S = 300.0
# Bounds the flush of the 1 GiB message.
FLUSH_S = 200.0


def main():
    kind, prefix, token, incarnation, address, mode = sys.argv[1:7]
    incarnation = int(incarnation)
    torch.set_num_threads(1)
    transport = GrpcTransport(Label.worker(1), token=token, incarnation=incarnation,
                              settings=GrpcSettings(connect_timeout_s=30.0))
    if kind == "shm":
        transport = RoutedTransport(transport, prefix=prefix, choice=TransportChoice.SHM)
    print("address", transport.start(), flush=True)
    transport.set_peers({Label.worker(0): address})
    transport.expect({"w0->w1#0": ChannelContract(Label.worker(0), ((torch.float32, (2, 3)),))})
    print("ready", flush=True)
    if mode == "hold":
        threading.Event().wait(HOLD_S)
        return
    # 1 GiB whose every 8 bytes differ: a misplaced piece changes the hash.
    big = torch.arange(1 << 27, dtype=torch.int64).mul_(-7046029254386353131)
    digest = hashlib.blake2b(memoryview(big.numpy()), digest_size=16).digest()
    transport.send(Label.worker(0), MessageKey(incarnation, 0, "big"), [big])
    transport.send(Label.worker(0), MessageKey(incarnation, 0, "digest"),
                   [torch.frombuffer(bytearray(digest), dtype=torch.uint8)])
    transport.flush(FLUSH_S)
    transport.close()
    print("sent", flush=True)


if __name__ == "__main__":
    main()
