"""What the transports' tests share (tests/runtime/transport/test_transports.py,
test_grpc_transport.py, tests/e2e/test_transports_e2e.py): the job's identity,
small deadlines, message keys, a transport of either kind (gRPC, or shared
memory through the router), the peer process (tests/support/scripts/
transport_peer.py), and connecting and closing transports the way processes of a
job do."""

import os
import sys
import threading

import torch
from cluster import SCRIPTS, Proc

from splitrun.runtime import MessageKey
from splitrun.runtime.transport.grpc import GrpcSettings, GrpcTransport
from splitrun.runtime.transport.router import RoutedTransport, TransportChoice
from splitrun.runtime.transport.shm.ring import SHM_DIR
from splitrun.runtime.transport.shm.transport import ShmSettings
from splitrun.splitter import Label

W0, W1, W2 = Label.worker(0), Label.worker(1), Label.worker(2)
TOKEN = "test-token"
INCARNATION = 7
# Small deadlines so failure tests end quickly; generous enough for a loaded CI box.
SETTINGS = GrpcSettings(connect_timeout_s=2.0, close_timeout_s=10.0, stream_idle_s=0.2,
                        send_timeout_s=10.0, expect_timeout_s=2.0)
# Bounds a receive that must succeed.
RECV_TIMEOUT_S = 30.0
# Bounds the 1 GiB tests' sender process (start-up, 1 GiB across, hashing).
BIG_TIMEOUT_S = 240.0
# Bounds each transport's close in close_all.
CLOSE_TIMEOUT_S = 60.0
FLOAT_2x3 = ((torch.float32, (2, 3)),)
# Small rings, so that ordinary test messages already stream through them in pieces.
SMALL_RING = ShmSettings(ring_bytes=64 << 10, attach_timeout_s=10.0, send_timeout_s=30.0,
                         message_timeout_s=60.0, poll_s=0.2)
KINDS = ["grpc", "shm"]


def key(step: int, channel: str = "w0->w1#0") -> MessageKey:
    return MessageKey(INCARNATION, step, channel)


def connect(*transports) -> None:
    addresses = {t.label: t.start() for t in transports}
    for transport in transports:
        transport.set_peers({label: address for label, address in addresses.items()
                             if label != transport.label})


def close_all(*transports) -> None:
    """Close in parallel, as processes of a job do."""
    errors = []

    def close(transport):
        try:
            transport.close()
        except Exception as exc:  # noqa: BLE001 - collected below
            errors.append(exc)
    threads = [threading.Thread(target=close, args=(t,)) for t in transports]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(CLOSE_TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), "close() must end within its deadline"
    if errors:
        raise errors[0]


def job_files(prefix: str) -> list[str]:
    return sorted(name for name in os.listdir(SHM_DIR) if name.startswith(prefix))


def make(kind: str, label: Label, prefix: str, contracts=None,
         ring: ShmSettings = SMALL_RING, settings: GrpcSettings = SETTINGS):
    grpc = GrpcTransport(label, token=TOKEN, incarnation=INCARNATION, contracts=contracts,
                         settings=settings)
    if kind == "grpc":
        return grpc
    return RoutedTransport(grpc, prefix=prefix, choice=TransportChoice.SHM, settings=ring)


def start_peer(kind: str, prefix: str, address: str, mode: str) -> Proc:
    return Proc([sys.executable, SCRIPTS / "transport_peer.py", kind, prefix, TOKEN,
                 INCARNATION, address, mode])
