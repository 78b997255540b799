"""`TcpTransport`: tensors to peers on other hosts over plain TCP sockets
(TLS when the job has it), next to gRPC, which stays the control plane and
the fallback.

Why: measured on this 2-core machine (bench/transport.py, docs/data-plane.md),
grpcio's own ceiling for a chunked 64 MiB transfer (a bare streaming call,
no copy or check of ours) is below gloo's, so no tuning of the gRPC path
reaches it; a socket written from the tensors' memory and read into the
receive buffer costs the kernel's copies only.

What stays the same as over gRPC: the job's token is checked before any
frame of a connection is read (`server`), TLS off loopback (the TLS files of
the gRPC server, `ssl_contexts`), every message admitted by `admission`
before its data is given a buffer (what a connection reads ahead is bounded
and never grows: `reader`), refusals with the same gRPC status
names and texts, no traceback to a caller.

Finding a peer's data port: its gRPC server answers `DataPlane/Address`
(`service`), authenticated like every call; a peer that does not answer it
(an older process, or one with the data plane off) gets gRPC.

    tcp = TcpTransport(endpoint, tls=tls_files, reply=...)
    port = tcp.start(host)               # served over gRPC by `service`
    tcp.connect(peer, host, port)        # once per peer, before sending
    tcp.send(peer, key, tensors); tcp.flush(deadline); tcp.close()
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
from collections.abc import Callable, Sequence

import torch

from splitrun.splitter.labels import Label

from ...errors import TransportError
from ...rpc.tls import TlsFiles
from ..buffers import encode
from ..contract import ChannelContract
from ..dtypes import TensorSpec
from ..endpoint import Endpoint, Identity
from ..filled import Fill, fill_then_send
from ..framing import EnvelopeWriter
from ..keys import MessageKey
from .link import DataLink, connect
from .server import DataServer
from .settings import TcpSettings

__all__ = ["TcpTransport", "ssl_contexts", "REFUSED_CHANNEL", "Reply"]

logger = logging.getLogger(__name__)

# The channel a refusal goes back to its sender on (over gRPC), suffixed with the refuser.
REFUSED_CHANNEL = "@tcp-refused:"
# How a refusal reaches its sender at once: `reply(peer, key, tensors)` sends a
# message over the control plane (gRPC), as shared memory's refusals do.
Reply = Callable[[Label, MessageKey, list[torch.Tensor]], None]


def ssl_contexts(tls: TlsFiles | None) -> tuple[ssl.SSLContext | None, ssl.SSLContext | None]:
    """(server, client) contexts from the job's TLS files: the server shows
    its certificate, the client checks it against the CA and the host name,
    as gRPC's TLS does. (None, None) without TLS."""
    if tls is None:
        return None, None
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.minimum_version = ssl.TLSVersion.TLSv1_2
    server.load_cert_chain(tls.cert, tls.key)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.minimum_version = ssl.TLSVersion.TLSv1_2
    client.load_verify_locations(tls.ca)
    return server, client


class TcpTransport:
    """Sends to the peers it was `connect`ed to, and receives from any peer
    that authenticates, into `endpoint` (see the module's docstring)."""

    def __init__(self, endpoint: Endpoint, *, reply: Reply, tls: TlsFiles | None = None,
                 settings: TcpSettings | None = None) -> None:
        self.endpoint = endpoint
        self.settings = settings or TcpSettings()
        self.reply = reply
        server_tls, self._client_tls = ssl_contexts(tls)
        self._server = DataServer(endpoint, settings=self.settings, tls=server_tls,
                                  refuse=self._tell_refused)
        self._num_refused = 0
        endpoint.route(REFUSED_CHANNEL, self._on_refused)
        self._links: dict[Label, DataLink] = {}
        self._envelopes: EnvelopeWriter | None = None
        self._envelopes_of: Identity | None = None  # whose label they name
        self._lock = threading.Lock()
        self._is_closed = False

    @property
    def port(self) -> int | None:
        return self._server.port

    def start(self, host: str) -> int:
        """Listen on `host` (the gRPC server's); the port peers connect to."""
        port = self._server.start(host)
        logger.info("%s serving tensors over tcp on %s:%d%s", self.endpoint.tag, host, port,
                    " (TLS)" if self._client_tls is not None else "")
        return port

    def connect(self, peer: Label, host: str, port: int) -> None:
        """Open the connection to `peer`'s data port; `TransportError` if it
        cannot be opened or authenticated within connect_timeout_s."""
        # The peer's refusals come back on this channel (see `_tell_refused`).
        self.endpoint.register({REFUSED_CHANNEL + str(peer): ChannelContract(peer, None)})
        link = connect(self.endpoint.tag, peer, host, port, self.endpoint.token,
                       self._client_tls, self.settings)
        with self._lock:
            if self._is_closed:
                link.close(time.monotonic())
                raise TransportError(f"{self.endpoint.tag} connecting to {peer.describe()}: "
                                     f"the transport is closed")
            old = self._links.pop(peer, None)
            self._links[peer] = link
        if old is not None:
            old.close(time.monotonic() + self.settings.close_timeout_s)

    def carries(self, peer: Label) -> bool:
        return peer in self._links

    def connections(self, peer: Label) -> int:
        """How many connections carry messages to `peer` (the main one and
        its stripes); 0 when not connected."""
        link = self._links.get(peer)
        return 0 if link is None else link.num_connections

    def send(self, dst: Label, key: MessageKey, tensors: Sequence[torch.Tensor]) -> None:
        """Write the message to `dst`'s connection (see `link`)."""
        self.endpoint.raise_if_failed()
        link = self._links.get(dst)
        if link is None:
            raise TransportError(f"{self.endpoint.tag} send {key}: no tcp connection to "
                                 f"{dst.describe()}")
        staged = [t if t.is_cpu else t.detach().to("cpu") for t in tensors]
        encoded = encode(staged)
        identity = self.endpoint.identity
        envelopes = self._envelopes
        if envelopes is None or self._envelopes_of is not identity:  # a new label
            envelopes = self._envelopes = EnvelopeWriter(str(identity.label))
            self._envelopes_of = identity
        try:
            link.send(key, envelopes.serialize(key, encoded), encoded)
        except TransportError as exc:
            self.endpoint.fail(exc)
            self.endpoint.note_raised(exc)
            raise
        logger.debug("%s sent %s to %s over tcp (%d bytes)", self.endpoint.tag, key, dst,
                     encoded.total_bytes)

    def send_filled(self, dst: Label, key: MessageKey, specs: Sequence[TensorSpec],
                    fill: Fill) -> None:
        """`send` of new tensors `fill` wrote (the socket takes them from there)."""
        fill_then_send(self.send, dst, key, specs, fill)

    def flush(self, deadline: float) -> None:
        """Wait until every peer put every message sent so far in its mailbox."""
        for link in list(self._links.values()):
            try:
                link.flush(deadline)
            except TransportError as exc:
                self.endpoint.fail(exc)
                self.endpoint.note_raised(exc)
                raise

    def close(self) -> list[TransportError]:
        """Flush and close every connection, stop the server; what failed."""
        with self._lock:
            if self._is_closed:
                return []
            self._is_closed = True
            links = list(self._links.values())
        deadline = time.monotonic() + self.settings.close_timeout_s
        problems = [p for p in (link.close(deadline) for link in links) if p is not None]
        self._server.close(max(deadline - time.monotonic(), 0.0))
        return problems

    # -- refusals --

    def _tell_refused(self, src: Label, why: str) -> None:
        """This process refused `src`'s message: tell it over the control plane,
        so it fails now rather than at its next flush (the connection carries
        the refusal too)."""
        with self._lock:
            self._num_refused += 1
            step = self._num_refused
        text = torch.frombuffer(bytearray(why.encode()), dtype=torch.uint8)
        key = MessageKey(self.endpoint.incarnation, step,
                         REFUSED_CHANNEL + str(self.endpoint.label))
        try:
            self.reply(src, key, [text])
        except TransportError as exc:
            logger.warning("%s could not tell %s of the refusal: %s", self.endpoint.tag,
                           src.describe(), exc)

    def _on_refused(self, key: MessageKey, src: Label, tensors: list[torch.Tensor]) -> None:
        """A peer refused one of our messages: fail like a gRPC refusal."""
        why = bytes(tensors[0].numpy()).decode(errors="replace") if tensors else "?"
        link = self._links.get(src)
        where = f" at {link.address}" if link is not None else ""
        self.endpoint.fail(TransportError(f"{self.endpoint.tag} sending to {src.describe()}"
                                          f"{where} (tcp) failed: {why}"))
