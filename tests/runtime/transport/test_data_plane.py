"""The router's tcp data plane (docs/data-plane.md): which path a message
takes, and that the tcp path keeps gRPC's promises between real processes:
the data port is learned over gRPC with the job's token, a 64 MiB tensor
arrives bit for bit, a refusal fails the sender at once (its pending receive
wakes with the receiver's reason), a peer without the data plane gets gRPC,
SPLITRUN_TRANSPORT=tcp says which peer lacks it, TLS carries it, and a
killed receiver fails the sender naming it."""

import hashlib
import os
import signal
import subprocess
import sys
import time

import pytest
import tls_files
import torch
from cluster import SCRIPTS

from splitrun.runtime import MessageKey
from splitrun.runtime.errors import TransportError
from splitrun.runtime.rpc.tls import TlsFiles
from splitrun.runtime.transport import ChannelContract
from splitrun.runtime.transport.grpc import GrpcSettings, GrpcTransport
from splitrun.runtime.transport.router import RoutedTransport, TransportChoice, TransportKind
from splitrun.splitter import Label

W0, W1 = Label.worker(0), Label.worker(1)
TOKEN = "test-token"
INCARNATION = 5
SETTINGS = GrpcSettings(connect_timeout_s=5.0, close_timeout_s=10.0, stream_idle_s=0.2,
                        send_timeout_s=10.0, expect_timeout_s=2.0)
RECV_TIMEOUT_S = 60.0
# Bounds the peer process's start and its lines.
PEER_TIMEOUT_S = 120.0
FLOAT_2x3 = {"w0->w1#0": ChannelContract(W0, ((torch.float32, (2, 3)),))}


def key(step: int, channel: str = "w0->w1#0") -> MessageKey:
    return MessageKey(INCARNATION, step, channel)


def routed(label: Label, choice=TransportChoice.AUTO, tls=None, contracts=None):
    grpc = GrpcTransport(label, token=TOKEN, incarnation=INCARNATION, settings=SETTINGS,
                         contracts=contracts, tls=tls)
    return RoutedTransport(grpc, prefix=None, choice=choice)


def connect_pair(a, b) -> None:
    addresses = {a.label: a.start(), b.label: b.start()}
    a.set_peers({b.label: addresses[b.label]})
    b.set_peers({a.label: addresses[a.label]})


def close_quietly(*transports):
    for transport in transports:
        try:
            transport.close()
        except TransportError:
            pass


def test_tcp_carries_messages_between_hosts_auto():
    a, b = routed(W0), routed(W1, contracts=FLOAT_2x3)
    try:
        connect_pair(a, b)
        assert a.kind_of(W1) is TransportKind.TCP and b.kind_of(W0) is TransportKind.TCP
        for step in range(5):
            a.send(W1, key(step), [torch.full((2, 3), float(step))])
        for step in range(5):
            (got,) = b.recv(W0, key(step), RECV_TIMEOUT_S)
            assert torch.equal(got, torch.full((2, 3), float(step)))
        a.flush(RECV_TIMEOUT_S)
    finally:
        a.close()
        b.close()


def test_a_refusal_wakes_the_senders_receive_with_the_reason():
    """The receiver refuses (wrong shape): the sender's pending receive (the
    reply it waits for) ends with the receiver's reason, well before its
    deadline, as over gRPC."""
    a, b = routed(W0, contracts={}), routed(W1, contracts=FLOAT_2x3)
    try:
        connect_pair(a, b)
        a.send(W1, key(0), [torch.zeros(4)])
        started = time.monotonic()
        with pytest.raises(TransportError, match=r"sending to worker 1 .*\(tcp\) failed: "
                                                 r"INVALID_ARGUMENT: \[worker 1\] refused "
                                                 r"channel 'w0->w1#0' step 0"):
            a.recv(W1, key(0, "reply"), RECV_TIMEOUT_S)
        assert time.monotonic() - started < RECV_TIMEOUT_S / 2
    finally:
        close_quietly(a, b)


def test_a_peer_without_the_data_plane_gets_grpc_and_tcp_choice_names_it():
    bare = GrpcTransport(W1, token=TOKEN, incarnation=INCARNATION, settings=SETTINGS,
                         contracts=FLOAT_2x3)
    auto, forced = routed(W0), routed(W0, TransportChoice.TCP)
    try:
        address = bare.start()
        auto.start()
        auto.set_peers({W1: address})
        assert auto.kind_of(W1) is TransportKind.GRPC
        auto.send(W1, key(0), [torch.ones(2, 3)])
        assert torch.equal(bare.recv(W0, key(0), RECV_TIMEOUT_S)[0], torch.ones(2, 3))
        forced.start()
        with pytest.raises(TransportError, match=r"SPLITRUN_TRANSPORT=tcp, but the tcp data "
                                                 r"plane to worker 1 .* serves no tcp data "
                                                 r"plane"):
            forced.set_peers({W1: address})
    finally:
        close_quietly(bare, auto, forced)


def test_grpc_choice_keeps_grpc():
    a, b = routed(W0, TransportChoice.GRPC), routed(W1, contracts=FLOAT_2x3)
    try:
        connect_pair(a, b)
        assert a.kind_of(W1) is TransportKind.GRPC
        a.send(W1, key(0), [torch.ones(2, 3)])
        assert torch.equal(b.recv(W0, key(0), RECV_TIMEOUT_S)[0], torch.ones(2, 3))
    finally:
        close_quietly(a, b)


def test_the_data_port_is_not_told_without_the_token():
    from splitrun.runtime.transport.tcp import ask_data_port
    b = routed(W1, contracts=FLOAT_2x3)
    try:
        address = b.start()
        with pytest.raises(TransportError, match="UNAUTHENTICATED"):
            ask_data_port(address, token="wrong", tls=None, timeout_s=5.0, tag="[test]",
                          peer="worker 1")
        assert ask_data_port(address, token=TOKEN, tls=None, timeout_s=5.0, tag="[test]",
                             peer="worker 1") is not None
    finally:
        close_quietly(b)


@pytest.mark.skipif(not tls_files.have_openssl(), reason="needs the openssl command")
def test_tls_jobs_carry_tcp_over_tls(tmp_path):
    files = tls_files.make(tmp_path)
    tls = TlsFiles(str(files.cert), str(files.key), str(files.ca))
    a, b = routed(W0, tls=tls), routed(W1, tls=tls, contracts=FLOAT_2x3)
    try:
        connect_pair(a, b)
        assert a.kind_of(W1) is TransportKind.TCP
        value = torch.randn(2, 3)
        a.send(W1, key(0), [value])
        assert torch.equal(b.recv(W0, key(0), RECV_TIMEOUT_S)[0], value)
    finally:
        close_quietly(a, b)


class Peer:
    """tests/support/scripts/tcp_peer.py as worker 1, its lines read with a deadline."""

    def __init__(self, address: str, mode: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(SCRIPTS / "tcp_peer.py"), TOKEN, str(INCARNATION), address,
             mode], stdout=subprocess.PIPE, text=True, start_new_session=True)

    def line(self) -> str:
        import selectors
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(PEER_TIMEOUT_S):
                raise TimeoutError("worker 1 said nothing in time")
        return self.proc.stdout.readline().strip()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(PEER_TIMEOUT_S)
        self.proc.stdout.close()


def test_64mib_between_processes_arrives_bit_for_bit():
    contracts = {"big": ChannelContract(W1, ((torch.float32, (16 << 20,)),)),
                 "digest": ChannelContract(W1, ((torch.uint8, (64,)),))}
    a = routed(W0, contracts=contracts)
    peer = Peer(a.start(), "big")
    try:
        address = peer.line().split()[1]
        a.set_peers({W1: address})
        # 64 MiB is striped over the main connection and its default stripe.
        assert peer.line() == "ready tcp connections=2"
        assert a.kind_of(W1) is TransportKind.TCP
        (big,) = a.recv(W1, MessageKey(INCARNATION, 0, "big"), RECV_TIMEOUT_S)
        (digest,) = a.recv(W1, MessageKey(INCARNATION, 0, "digest"), RECV_TIMEOUT_S)
        assert hashlib.blake2b(big.numpy().tobytes()).digest() == bytes(digest.numpy())
        assert peer.line() == "done"
        assert peer.proc.wait(PEER_TIMEOUT_S) == 0
    finally:
        peer.stop()
        a.close()


@pytest.mark.parametrize("floats, steps", [(1 << 18, 200), (4 << 20, 20)],
                         ids=["1MiB", "16MiB-striped"])
def test_a_killed_receiver_fails_the_sender_naming_it(floats, steps):
    a = routed(W0)
    peer = Peer(a.start(), "hold")
    try:
        address = peer.line().split()[1]
        a.set_peers({W1: address})
        assert peer.line().startswith("ready tcp")
        peer.stop()  # SIGKILL
        with pytest.raises(TransportError, match=r"worker 1 at .* \(tcp\) failed: "
                                                 r"UNAVAILABLE.*gone or unreachable"):
            for step in range(steps):  # the first writes may land in the socket buffer
                a.send(W1, key(step), [torch.zeros(floats)])
            a.flush(RECV_TIMEOUT_S)
    finally:
        peer.stop()
        close_quietly(a)
