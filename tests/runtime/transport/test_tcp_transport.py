"""The TCP data plane (runtime/transport/tcp): real sockets between two
endpoints, checked for what the gRPC path promises: numbers arrive exactly,
the job's token is checked before any frame is read (and wrong bytes are
refused with a reason, never a traceback), a stalled connection holds no
message, TLS works and plaintext to a TLS server is refused, a refusal fails
the sender with the receiver's reason, a dead receiver fails it too."""

import dataclasses
import re
import socket
import threading
import time

import pytest
import tls_files
import torch

from splitrun.runtime import MessageKey
from splitrun.runtime.errors import TransportError
from splitrun.runtime.rpc.tls import TlsFiles
from splitrun.runtime.transport.contract import ChannelContract
from splitrun.runtime.transport.endpoint import Endpoint
from splitrun.runtime.transport.tcp import TcpSettings, TcpTransport, wire
from splitrun.splitter import Label

W0, W1 = Label.worker(0), Label.worker(1)
TOKEN = "test-token"
INCARNATION = 3
RECV_TIMEOUT_S = 30.0
SETTINGS = TcpSettings(connect_timeout_s=5.0, hello_timeout_s=0.5, close_timeout_s=10.0)
# Bounds reading one reply in these tests.
READ_TIMEOUT_S = 10.0


def key(step: int, channel: str = "w0->w1#0") -> MessageKey:
    return MessageKey(INCARNATION, step, channel)


class Pair:
    """W0 sends to W1 over tcp; a refusal W1 sends back (over gRPC in a job)
    is recorded and put in W0's mailbox, as gRPC would."""

    def __init__(self, contracts, tls: TlsFiles | None = None,
                 settings: TcpSettings = SETTINGS,
                 sender_settings: TcpSettings = SETTINGS) -> None:
        self.receiver_endpoint = Endpoint(W1, INCARNATION, token=TOKEN, expect_timeout_s=2.0)
        self.receiver_endpoint.expect(contracts)
        self.sender_endpoint = Endpoint(W0, INCARNATION, token=TOKEN)
        self.refusals: list[tuple[Label, str]] = []
        self.receiver = TcpTransport(self.receiver_endpoint, reply=self._reply, tls=tls,
                                     settings=settings)
        self.sender = TcpTransport(self.sender_endpoint, reply=self._reply, tls=tls,
                                   settings=sender_settings)
        self.port = self.receiver.start("127.0.0.1")
        self.sender.start("127.0.0.1")

    def _reply(self, dst: Label, k: MessageKey, tensors: list[torch.Tensor]) -> None:
        assert dst == W0
        self.refusals.append((dst, bytes(tensors[0].numpy()).decode()))
        self.sender_endpoint.identity.mailbox.put(k, W1, tensors)

    def connect(self) -> None:
        self.sender.connect(W1, "127.0.0.1", self.port)

    def recv(self, k: MessageKey) -> list[torch.Tensor]:
        return self.receiver_endpoint.take(k, W0, RECV_TIMEOUT_S)

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()


@pytest.fixture
def pair_factory():
    made = []

    def make(contracts, tls=None, settings=SETTINGS, sender_settings=SETTINGS):
        made.append(Pair(contracts, tls, settings, sender_settings))
        return made[-1]
    yield make
    for pair in made:
        pair.close()


def raw_connection(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=READ_TIMEOUT_S)
    return sock


def read_reply(sock: socket.socket) -> tuple[int, bytes]:
    kind, length = wire.HEADER.unpack(wire.read_exact(sock, wire.HEADER.size))
    return kind, wire.read_exact(sock, length)


def test_messages_arrive_exactly_small_and_large(pair_factory):
    big = torch.randn(3 << 20)  # 12 MiB: written from the tensor, read into the buffer
    ints = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    small = torch.randn(2, 3)
    contracts = {
        "big": ChannelContract(W0, ((torch.float32, tuple(big.shape)),
                                    (torch.int64, (3, 4)))),
        "w0->w1#0": ChannelContract(W0, ((torch.float32, (2, 3)),)),
    }
    pair = pair_factory(contracts)
    pair.connect()
    for step in range(3):
        pair.sender.send(W1, key(step), [small + step])
    pair.sender.send(W1, key(0, "big"), [big, ints.t().contiguous().t()])  # non-contiguous
    pair.sender.flush(time.monotonic() + RECV_TIMEOUT_S)
    for step in range(3):
        (got,) = pair.recv(key(step))
        assert torch.equal(got, small + step)
    got_big, got_ints = pair.recv(key(0, "big"))
    assert torch.equal(got_big, big)
    assert torch.equal(got_ints, ints)
    assert pair.refusals == []


def test_wrong_token_is_refused_before_any_frame(pair_factory):
    pair = pair_factory({"w0->w1#0": ChannelContract(W0, ((torch.float32, (2, 3)),))})
    sock = raw_connection(pair.port)
    with sock:
        # A whole message follows the wrong token: none of it may be read as one.
        sock.sendall(wire.hello("not-the-token") + wire.frame(wire.MESSAGE, b"\x00" * 10))
        kind, body = read_reply(sock)
        assert kind == wire.REFUSED
        _, status, details = wire.parse_refusal(body)
        assert status == "UNAUTHENTICATED"
        assert "[worker 1] refused a data connection" in details
        assert "the job token is wrong" in details
        assert "Traceback" not in details
        try:
            assert sock.recv(1) == b""  # then closed
        except ConnectionResetError:
            pass  # closed with the unread frame
    assert pair.receiver_endpoint.pending() == []


def test_sender_with_wrong_token_gets_a_clear_error(pair_factory):
    pair = pair_factory({})
    stranger = TcpTransport(Endpoint(W0, INCARNATION, token="other"), reply=lambda *a: None,
                            settings=SETTINGS)
    try:
        with pytest.raises(TransportError, match=r"refused the data connection: "
                                                 r"UNAUTHENTICATED: .*job token is wrong"):
            stranger.connect(W1, "127.0.0.1", pair.port)
    finally:
        stranger.close()


@pytest.mark.parametrize("garbage", [
    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    wire.MAGIC + b"\xff\xff",                                  # a 64 KiB token
    wire.MAGIC + b"\x00\x00",                                  # no token
])
def test_bad_hellos_are_refused_with_a_reason(pair_factory, garbage):
    pair = pair_factory({})
    with raw_connection(pair.port) as sock:
        sock.sendall(garbage)
        kind, body = read_reply(sock)
        assert kind == wire.REFUSED
        _, status, details = wire.parse_refusal(body)
        assert status == "UNAUTHENTICATED", details
        assert "every process of a job must use the job's token" in details


def test_wire_fuzz_after_the_hello_never_crashes_the_receiver(pair_factory):
    """Random frames from an authenticated peer: each connection is refused
    (INVALID_ARGUMENT and a reason) or closed; nothing reaches the mailbox and
    the receiver keeps serving real messages."""
    contract = {"w0->w1#0": ChannelContract(W0, ((torch.float32, (2, 3)),))}
    pair = pair_factory(contract)
    rng = torch.Generator().manual_seed(28)
    for case in range(40):
        size = int(torch.randint(1, 200, (1,), generator=rng))
        junk = bytes(torch.randint(0, 256, (size,), generator=rng, dtype=torch.uint8).tolist())
        if case % 2:  # a message frame whose envelope is junk
            junk = wire.frame(wire.MESSAGE, junk)
        with raw_connection(pair.port) as sock:
            sock.sendall(wire.hello(TOKEN))
            assert read_reply(sock)[0] == wire.ACCEPTED
            sock.sendall(junk)
            sock.shutdown(socket.SHUT_WR)
            try:
                kind, body = read_reply(sock)
            except wire.PeerClosed:
                continue  # a frame cut short by the end of the connection
            assert kind == wire.REFUSED, (case, kind)
            _, status, details = wire.parse_refusal(body)
            assert status in ("INVALID_ARGUMENT", "NOT_FOUND"), (case, status, details)
            assert "[worker 1] refused" in details and "Traceback" not in details
    assert pair.receiver_endpoint.pending() == []
    pair.connect()
    pair.sender.send(W1, key(0), [torch.ones(2, 3)])
    assert torch.equal(pair.recv(key(0))[0], torch.ones(2, 3))


def test_a_stalled_connection_holds_nothing(pair_factory):
    """A caller that connects and says nothing is dropped after
    hello_timeout_s; meanwhile a real sender is served."""
    pair = pair_factory({"w0->w1#0": ChannelContract(W0, ((torch.float32, (2, 3)),))})
    with raw_connection(pair.port) as stalled:
        pair.connect()
        pair.sender.send(W1, key(0), [torch.zeros(2, 3)])
        assert torch.equal(pair.recv(key(0))[0], torch.zeros(2, 3))
        started = time.monotonic()
        assert stalled.recv(1) == b""  # the server closed it
        assert time.monotonic() - started < READ_TIMEOUT_S


def test_a_sender_stalled_mid_message_is_dropped(pair_factory):
    contract = {"w0->w1#0": ChannelContract(W0, ((torch.float32, (1024,)),))}
    pair = pair_factory(contract, settings=TcpSettings(message_timeout_s=0.5))
    from splitrun.runtime.transport.buffers import encode
    from splitrun.runtime.transport.framing import EnvelopeWriter
    encoded = encode([torch.zeros(1024)])
    envelope = EnvelopeWriter(str(W0)).serialize(key(0), encoded)
    with raw_connection(pair.port) as sock:
        sock.sendall(wire.hello(TOKEN))
        assert read_reply(sock)[0] == wire.ACCEPTED
        sock.sendall(wire.frame(wire.MESSAGE, envelope) + b"\x00" * 100)  # 100 of 4096 bytes
        kind, body = read_reply(sock)
        assert kind == wire.REFUSED
        _, status, details = wire.parse_refusal(body)
        assert status == "DEADLINE_EXCEEDED", details
        assert "stalled" in details
    assert pair.receiver_endpoint.pending() == []


def _message_frame(step: int, tensor: torch.Tensor) -> bytes:
    """One MESSAGE frame from W0 on channel w0->w1#0, as a DataLink writes it."""
    from splitrun.runtime.transport.buffers import encode
    from splitrun.runtime.transport.framing import EnvelopeWriter
    encoded = encode([tensor])
    envelope = EnvelopeWriter(str(W0)).serialize(key(step), encoded)
    return wire.frame(wire.MESSAGE, envelope) + b"".join(bytes(v) for v in encoded.views)


def test_frames_cut_anywhere_or_packed_together_arrive_exactly(pair_factory):
    """The receiver reads through a read-ahead buffer: a frame that comes a
    byte at a time (its header cut too), several frames in one write, and a
    frame cut in the middle of the next one's header all arrive exactly."""
    contract = {"w0->w1#0": ChannelContract(W0, ((torch.float32, (3, 5)),))}
    pair = pair_factory(contract)
    values = [torch.randn(3, 5) for _ in range(6)]
    frames = [_message_frame(step, value) for step, value in enumerate(values)]
    with raw_connection(pair.port) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(wire.hello(TOKEN))
        assert read_reply(sock)[0] == wire.ACCEPTED
        for byte in frames[0]:  # one byte per write
            sock.sendall(bytes((byte,)))
        assert torch.equal(pair.recv(key(0))[0], values[0])
        sock.sendall(frames[1] + frames[2] + frames[3])  # three in one write
        together = frames[4] + frames[5]
        cut = len(frames[4]) + 2  # inside the sixth frame's header
        sock.sendall(together[:cut])
        assert torch.equal(pair.recv(key(4))[0], values[4])
        sock.sendall(together[cut:] + wire.frame(wire.SYNC))
        assert read_reply(sock) == (wire.DELIVERED, (6).to_bytes(8, "little"))
    for step in (1, 2, 3, 5):
        assert torch.equal(pair.recv(key(step))[0], values[step])
    assert pair.refusals == []


def test_a_sender_stalled_mid_header_is_dropped(pair_factory):
    """Only the wait for a frame's first byte has no deadline: a header cut
    short and never finished is a stall like any other."""
    pair = pair_factory({}, settings=TcpSettings(message_timeout_s=0.5))
    with raw_connection(pair.port) as sock:
        sock.sendall(wire.hello(TOKEN))
        assert read_reply(sock)[0] == wire.ACCEPTED
        sock.sendall(wire.frame(wire.SYNC)[:2])  # 2 of a header's 5 bytes
        kind, body = read_reply(sock)
        assert kind == wire.REFUSED
        _, status, details = wire.parse_refusal(body)
        assert status == "DEADLINE_EXCEEDED", details
        assert "stalled" in details


def test_refused_message_fails_the_sender_with_the_receivers_reason(pair_factory):
    pair = pair_factory({"w0->w1#0": ChannelContract(W0, ((torch.float32, (2, 3)),))})
    pair.connect()
    pair.sender.send(W1, key(0), [torch.zeros(3, 3)])  # the contract says (2, 3)
    with pytest.raises(TransportError) as caught:
        pair.sender.flush(time.monotonic() + RECV_TIMEOUT_S)
    text = str(caught.value)
    assert "[worker 0] sending" in text and "to worker 1" in text, text
    assert "INVALID_ARGUMENT" in text and "float32[2, 3], got float32[3, 3]" in text, text
    # ...and the receiver told the sender over the control plane at once,
    # which failed the sender's endpoint (waking its receives).
    assert pair.refusals and pair.refusals[0][0] == W0
    assert "got float32[3, 3]" in pair.refusals[0][1]
    assert pair.sender_endpoint.has_failed
    with pytest.raises(TransportError):
        pair.sender.send(W1, key(1), [torch.zeros(2, 3)])


def test_unknown_channel_is_not_found(pair_factory):
    pair = pair_factory({})
    pair.connect()
    pair.sender.send(W1, key(0, "nowhere"), [torch.zeros(1)])
    with pytest.raises(TransportError, match="NOT_FOUND.*nowhere"):
        pair.sender.flush(time.monotonic() + RECV_TIMEOUT_S)


def test_dead_receiver_fails_the_sender_naming_it(pair_factory):
    pair = pair_factory({"w0->w1#0": ChannelContract(W0, ((torch.float32, (1 << 20,)),))})
    pair.connect()
    pair.receiver.close()
    with pytest.raises(TransportError, match=r"worker 1 at 127\.0\.0\.1:\d+ \(tcp\) failed: "
                                             r"UNAVAILABLE.*gone or unreachable"):
        for step in range(50):  # the first writes may still land in the socket buffer
            pair.sender.send(W1, key(step), [torch.zeros(1 << 20)])
    assert pair.sender_endpoint.has_failed


@pytest.mark.skipif(not tls_files.have_openssl(), reason="needs the openssl command")
def test_tls_round_trip_and_plaintext_refused(pair_factory, tmp_path):
    files = tls_files.make(tmp_path)
    tls = TlsFiles(str(files.cert), str(files.key), str(files.ca))
    pair = pair_factory({"w0->w1#0": ChannelContract(W0, ((torch.float32, (2, 3)),))}, tls)
    pair.connect()
    value = torch.randn(2, 3)
    pair.sender.send(W1, key(0), [value])
    pair.sender.flush(time.monotonic() + RECV_TIMEOUT_S)
    assert torch.equal(pair.recv(key(0))[0], value)
    plain = TcpTransport(Endpoint(W0, INCARNATION, token=TOKEN), reply=lambda *a: None,
                         settings=SETTINGS)
    try:
        with pytest.raises(TransportError, match="cannot open the data connection"):
            plain.connect(W1, "127.0.0.1", pair.port)
    finally:
        plain.close()


def test_close_ends_every_thread(pair_factory):
    pair = pair_factory({"w0->w1#0": ChannelContract(W0, ((torch.float32, (2, 3)),))})
    pair.connect()
    pair.sender.send(W1, key(0), [torch.zeros(2, 3)])
    pair.recv(key(0))
    ours = [t for t in threading.enumerate() if t.name.startswith("splitrun-tcp")]
    assert ours  # an accept thread per transport, a connection thread at the receiver
    pair.close()  # joins them
    assert [t.name for t in ours if t.is_alive()] == []


# -- large messages striped over several connections --------------------------------

STRIPED = dataclasses.replace(SETTINGS, stripes=3, stripe_min_bytes=1 << 10)


def test_striped_messages_arrive_exactly(pair_factory):
    """Three connections; parts cut across tensors of several dtypes, small
    (unstriped) messages in between, every byte where it belongs."""
    rng = torch.Generator().manual_seed(28)
    tensors = [torch.randn(1000, 37, generator=rng),
               torch.randint(-9, 9, (3, 5), generator=rng, dtype=torch.int64),
               torch.empty(0),
               torch.randint(0, 255, (4097,), generator=rng, dtype=torch.uint8)]
    contracts = {
        "big": ChannelContract(W0, tuple((t.dtype, tuple(t.shape)) for t in tensors)),
        "w0->w1#0": ChannelContract(W0, ((torch.float32, (2, 3)),)),
    }
    pair = pair_factory(contracts, sender_settings=STRIPED)
    pair.connect()
    assert pair.sender.connections(W1) == 3
    for step in range(4):
        pair.sender.send(W1, key(step, "big"), [t + step for t in tensors])
        pair.sender.send(W1, key(step), [torch.full((2, 3), float(step))])
    pair.sender.flush(time.monotonic() + RECV_TIMEOUT_S)
    for step in range(4):
        got = pair.recv(key(step, "big"))
        assert all(torch.equal(g, t + step) for g, t in zip(got, tensors))
        assert torch.equal(pair.recv(key(step))[0], torch.full((2, 3), float(step)))
    assert pair.refusals == []


def test_a_refused_striped_message_fails_the_sender_with_the_reason(pair_factory):
    pair = pair_factory({"w0->w1#0": ChannelContract(W0, ((torch.float32, (2, 3)),))},
                        sender_settings=STRIPED)
    pair.connect()
    with pytest.raises(TransportError) as caught:
        pair.sender.send(W1, key(0), [torch.zeros(3, 300)])  # striped; the contract: (2, 3)
        pair.sender.flush(time.monotonic() + RECV_TIMEOUT_S)
    text = str(caught.value)
    assert "to worker 1" in text and "INVALID_ARGUMENT" in text, text
    assert "float32[2, 3], got float32[3, 300]" in text, text
    assert pair.receiver_endpoint.pending() == []


class FakeReceiver:
    """A data port that accepts a main connection and one stripe, reads a
    little of the stripe's part and resets it, and never reads the main
    connection's data: the sender must fail, naming the peer, not hang."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(READ_TIMEOUT_S)
        self.port = self.listener.getsockname()[1]
        self.main: socket.socket | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _accept(self, link_id: bytes) -> socket.socket:
        sock, _ = self.listener.accept()
        sock.settimeout(READ_TIMEOUT_S)
        wire.read_exact(sock, len(wire.hello(TOKEN)))
        sock.sendall(wire.frame(wire.ACCEPTED, link_id))
        return sock

    def _serve(self) -> None:
        self.main = self._accept(b"L" * wire.LINK_ID_BYTES)
        with self._accept(b"S" * wire.LINK_ID_BYTES) as stripe:
            assert read_reply(stripe)[0] == wire.JOIN
            stripe.sendall(wire.frame(wire.ACCEPTED))
            wire.read_exact(stripe, 1 << 20)  # the PART frame and some of its bytes
            stripe.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00"
                              b"\x00\x00\x00")  # close with a reset

    def close(self) -> None:
        self.thread.join(READ_TIMEOUT_S)
        if self.main is not None:
            self.main.close()
        self.listener.close()


def test_a_stripe_dying_mid_message_fails_the_sender_naming_it():
    receiver = FakeReceiver()
    sender = TcpTransport(Endpoint(W0, INCARNATION, token=TOKEN), reply=lambda *a: None,
                          settings=dataclasses.replace(SETTINGS, stripes=2))
    outcome: list[BaseException] = []

    def send() -> None:
        try:
            sender.send(W1, key(0), [torch.zeros(16 << 20)])  # 64 MiB, 32 on each
        except BaseException as exc:  # noqa: BLE001 - checked below
            outcome.append(exc)
    try:
        sender.connect(W1, "127.0.0.1", receiver.port)
        assert sender.connections(W1) == 2
        thread = threading.Thread(target=send, daemon=True)
        thread.start()
        thread.join(READ_TIMEOUT_S)
        assert not thread.is_alive(), "the send hung after its stripe died"
        assert outcome and isinstance(outcome[0], TransportError), outcome
        assert re.search(r"\[worker 0\] sending .* to worker 1 at 127\.0\.0\.1:\d+ \(tcp\) "
                         r"failed: UNAVAILABLE: ConnectionError: stripe connection 1: .*worker 1 "
                         r"is gone or unreachable", str(outcome[0])), str(outcome[0])
        with pytest.raises(TransportError, match="stripe connection 1"):
            sender.send(W1, key(1), [torch.zeros(4)])  # the link stays failed
    finally:
        sender.close()
        receiver.close()


def test_a_stripe_cut_mid_part_delivers_nothing_and_the_receiver_goes_on(pair_factory):
    """A raw sender splits a message over a main connection and a stripe,
    then cuts the stripe mid-part: the receiver ends the main connection
    (no hang), puts nothing in the mailbox, refuses a join naming no
    connection, and still serves a real sender."""
    from splitrun.runtime.transport.buffers import encode
    from splitrun.runtime.transport.framing import EnvelopeWriter
    contract = {"w0->w1#0": ChannelContract(W0, ((torch.float32, (1 << 18,)),))}
    pair = pair_factory(contract)
    encoded = encode([torch.ones(1 << 18)])  # 1 MiB: 512 KiB a part
    envelope = EnvelopeWriter(str(W0)).serialize(key(0), encoded)
    with raw_connection(pair.port) as main, raw_connection(pair.port) as stripe:
        main.sendall(wire.hello(TOKEN))
        kind, link_id = read_reply(main)
        assert kind == wire.ACCEPTED and len(link_id) == wire.LINK_ID_BYTES
        stripe.sendall(wire.hello(TOKEN))
        assert read_reply(stripe)[0] == wire.ACCEPTED
        stripe.sendall(wire.join(link_id, 1))
        assert read_reply(stripe)[0] == wire.ACCEPTED
        main.sendall(wire.split(2, envelope) + bytes(encoded.views[0][:1 << 19]))
        stripe.sendall(wire.part(0) + bytes(1000))  # 1000 of its 512 KiB
        stripe.shutdown(socket.SHUT_WR)
        stripe.close()
        assert main.recv(1) == b""  # the receiver ended the message's connection
    with raw_connection(pair.port) as stranger:
        stranger.sendall(wire.hello(TOKEN))
        assert read_reply(stranger)[0] == wire.ACCEPTED
        stranger.sendall(wire.join(b"x" * wire.LINK_ID_BYTES, 1))
        kind, body = read_reply(stranger)
        assert kind == wire.REFUSED
        _, status, details = wire.parse_refusal(body)
        assert status == "INVALID_ARGUMENT" and "names no open data connection" in details
    assert pair.receiver_endpoint.pending() == []
    pair.connect()
    pair.sender.send(W1, key(0), [torch.full((1 << 18,), 2.0)])
    assert torch.equal(pair.recv(key(0))[0], torch.full((1 << 18,), 2.0))
