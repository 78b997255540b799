"""`RoutedTransport`: a job's transport, routing per peer: shared memory
(`shm.ShmTransport`) to the peers on this host that can share it, the TCP
data plane (`tcp.TcpTransport`) to the others, gRPC (`grpc.GrpcTransport`)
for control and as the fallback. See docs/data-plane.md for which path a
message takes and why. The two transports
never import each other; both deliver into the one `Endpoint` (mailbox, pool,
contracts, failure) the gRPC transport was built with, and receives take
from it whichever transport carried the message. A refusal on shared memory
goes back to its sender over gRPC.

Choosing per peer (`set_peers`): `SPLITRUN_TRANSPORT=auto` takes shared
memory for every peer whose marker says it is on this host (see
`ShmTransport.can_share_with`), else the TCP data plane when the peer's
gRPC server says where its data port is (`tcp.ask_data_port`) and the
connection opens and authenticates, else gRPC; `grpc` forces gRPC; `shm`
requires shared memory for every peer; `tcp` requires the TCP data plane
for every peer (no shared memory). `kind_of(peer)` says which, and the
choice is logged.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Mapping, Sequence

import torch

from splitrun.splitter.labels import Label

from ..errors import TransportError
from .contract import ChannelContract
from .dtypes import TensorSpec
from .filled import Fill
from .grpc import GrpcTransport
from .keys import MessageKey
from .shm.job_files import SHM_DIR, remove_job_segments
from .shm.transport import ShmSettings, ShmTransport
from .tcp import DataPlaneService, TcpSettings, TcpTransport, ask_data_port

__all__ = ["RoutedTransport", "TransportChoice", "TransportKind"]

logger = logging.getLogger(__name__)


class TransportKind(enum.Enum):
    """How messages to one peer travel."""

    GRPC = "grpc"
    SHM = "shm"
    TCP = "tcp"


class TransportChoice(enum.Enum):
    """`SPLITRUN_TRANSPORT`: `auto` uses shared memory for each peer on this host
    and gRPC for the others; `grpc` forces gRPC; `shm` requires shared memory
    for every peer (an error names a peer that is not on this host)."""

    AUTO = "auto"
    GRPC = "grpc"
    SHM = "shm"
    TCP = "tcp"

    @classmethod
    def parse(cls, text: str, variable: str = "SPLITRUN_TRANSPORT") -> TransportChoice:
        try:
            return cls(text.strip().lower() or "auto")
        except ValueError:
            raise TransportError(f"{variable}={text!r}: use one of "
                                 f"{', '.join(c.value for c in cls)}") from None


class RoutedTransport:
    """The `Transport` protocol over `grpc` and, with a job `prefix`, shared
    memory to the peers on this host (see the module's docstring).

        transport = RoutedTransport(GrpcTransport(label, token=..., incarnation=...),
                                    prefix=new_job_prefix())
        address = transport.start()
        transport.set_peers({peer: address_of_peer, ...})
        transport.kind_of(peer)              # TransportKind.SHM on this host
        transport.close()
    """

    def __init__(self, grpc: GrpcTransport, *, prefix: str | None,
                 choice: TransportChoice = TransportChoice.AUTO,
                 settings: ShmSettings | None = None, directory: str = SHM_DIR,
                 tcp_settings: TcpSettings | None = None) -> None:
        if choice is TransportChoice.SHM and prefix is None:
            raise TransportError("SPLITRUN_TRANSPORT=shm needs the job's shared-memory prefix "
                                 "(SPLITRUN_SHM_PREFIX, set by `splitrun launch`)")
        self.grpc = grpc
        self.endpoint = grpc.endpoint
        self.choice = choice
        self.prefix = prefix
        self.directory = directory
        self.shm: ShmTransport | None = None
        if prefix is not None and choice not in (TransportChoice.GRPC, TransportChoice.TCP):
            self.shm = ShmTransport(self.endpoint, prefix=prefix, reply=self._reply,
                                    settings=settings, directory=directory)
        self.tcp: TcpTransport | None = None
        if choice is not TransportChoice.GRPC:
            self.tcp = TcpTransport(self.endpoint, reply=self._reply, tls=grpc.tls,
                                    settings=tcp_settings)
            grpc.add_service(DataPlaneService(lambda: self.tcp.port).handler())
        self._kinds: dict[Label, TransportKind] = {}
        self._lock = threading.Lock()

    def __enter__(self) -> RoutedTransport:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def label(self) -> Label:
        return self.endpoint.label

    @property
    def incarnation(self) -> int:
        return self.endpoint.incarnation

    @property
    def address(self) -> str | None:
        return self.grpc.address

    @property
    def tag(self) -> str:
        return self.endpoint.tag

    # -- setup --

    def start(self) -> str:
        """Start the gRPC server; write this process's marker for same-host peers."""
        if self.tcp is not None:
            self.tcp.start(self.grpc.host)
        address = self.grpc.start()
        if self.shm is not None:
            self.shm.start(address)
        return address

    def set_identity(self, label: Label, incarnation: int) -> None:
        with self._lock:
            if self._kinds:
                raise TransportError(f"{self.tag} set_identity({label}, {incarnation}) after "
                                     f"set_peers; a process's identity is fixed by then")
        self.grpc.set_identity(label, incarnation)

    def set_peers(self, peers: Mapping[Label, str]) -> None:
        """Where each peer listens; chooses shared memory or gRPC for each new
        peer (connecting its rings when shared memory)."""
        self.grpc.set_peers(peers)
        with self._lock:
            for peer, address in sorted(peers.items()):
                if peer == self.label or peer in self._kinds:
                    continue
                kind, why = self._choose(address)
                if kind is TransportKind.GRPC and self.choice is TransportChoice.SHM:
                    raise TransportError(
                        f"{self.tag} SPLITRUN_TRANSPORT=shm, but {peer.describe()} at "
                        f"{address} cannot share memory with this process: {why}")
                if kind is TransportKind.SHM:
                    self.shm.connect(peer)
                elif self.tcp is not None:
                    kind, why = self._connect_tcp(peer, address, why)
                self._kinds[peer] = kind
                logger.info("%s transport to %s: %s (%s)", self.tag, peer.describe(),
                            kind.value, why)

    def _connect_tcp(self, peer: Label, address: str,
                     why_not_shm: str) -> tuple[TransportKind, str]:
        """The TCP data plane to `peer` if it offers one and the connection
        opens (gRPC otherwise; an error under SPLITRUN_TRANSPORT=tcp)."""
        host = address.rsplit(":", 1)[0]
        try:
            port = ask_data_port(address, token=self.endpoint.token, tls=self.grpc.tls,
                                 timeout_s=self.tcp.settings.connect_timeout_s, tag=self.tag,
                                 peer=peer.describe())
            if port is None:
                why = "it serves no tcp data plane"
            else:
                self.tcp.connect(peer, host, port)
                return TransportKind.TCP, f"{why_not_shm}; tcp data plane at {host}:{port}"
        except TransportError as exc:
            why = str(exc)
        if self.choice is TransportChoice.TCP:
            raise TransportError(f"{self.tag} SPLITRUN_TRANSPORT=tcp, but the tcp data plane "
                                 f"to {peer.describe()} at {address} is not available: {why}")
        logger.warning("%s tcp data plane to %s not available (%s); gRPC carries its "
                       "messages", self.tag, peer.describe(), why)
        return TransportKind.GRPC, f"{why_not_shm}; {why}"

    def _choose(self, address: str) -> tuple[TransportKind, str]:
        if self.choice is TransportChoice.GRPC:
            return TransportKind.GRPC, "SPLITRUN_TRANSPORT=grpc"
        if self.choice is TransportChoice.TCP:
            return TransportKind.GRPC, "SPLITRUN_TRANSPORT=tcp"
        if self.shm is None:
            return TransportKind.GRPC, "no shared-memory prefix for this job"
        shares, why = self.shm.can_share_with(address)
        return (TransportKind.SHM if shares else TransportKind.GRPC), why

    def kind_of(self, peer: Label) -> TransportKind:
        """How messages to and from `peer` travel (decided by `set_peers`)."""
        kind = self._kinds.get(peer)
        if kind is None:
            raise TransportError(f"{self.tag} {peer.describe()} is no peer yet; set_peers() "
                                 f"first")
        return kind

    def expect(self, contracts: Mapping[str, ChannelContract]) -> None:
        self.endpoint.expect(contracts)

    def register(self, contracts: Mapping[str, ChannelContract]) -> None:
        self.endpoint.register(contracts)

    def pending(self) -> list[MessageKey]:
        return self.endpoint.pending()

    def ping(self, dst: Label, timeout_s: float = 5.0) -> str:
        return self.grpc.ping(dst, timeout_s)

    # -- the Transport protocol --

    def send(self, dst: Label, key: MessageKey, tensors: Sequence[torch.Tensor]) -> None:
        """To a same-host peer: copied into its ring before this returns (blocks
        only while the ring is full); to others: queued on gRPC."""
        if self.shm is not None and self.shm.carries(dst):
            self.shm.send(dst, key, tensors)
        elif self.tcp is not None and self.tcp.carries(dst):
            self.tcp.send(dst, key, tensors)
        else:
            self.grpc.send(dst, key, tensors)

    def send_filled(self, dst: Label, key: MessageKey, specs: Sequence[TensorSpec],
                    fill: Fill) -> None:
        """To a same-host peer: `fill` writes straight into its ring; to
        others: into new tensors, sent as `send` sends them."""
        if self.shm is not None and self.shm.carries(dst):
            self.shm.send_filled(dst, key, specs, fill)
        elif self.tcp is not None and self.tcp.carries(dst):
            self.tcp.send_filled(dst, key, specs, fill)
        else:
            self.grpc.send_filled(dst, key, specs, fill)

    def recv(self, src: Label, key: MessageKey, timeout_s: float,
             control=None) -> list[torch.Tensor]:
        return self.endpoint.take(key, src, timeout_s, control)

    def is_lent(self, tensor: torch.Tensor) -> bool:
        return self.shm is not None and self.shm.is_lent(tensor)

    def abort(self, error: BaseException) -> None:
        self.endpoint.abort(error)

    def finish_at(self, num_steps: int) -> None:
        self.endpoint.finish_at(num_steps)

    def route(self, prefix: str, handler) -> None:
        self.endpoint.route(prefix, handler)

    def flush(self, timeout_s: float) -> None:
        """Wait until every message sent so far is in its receiver's mailbox
        (or refused: then that refusal is raised)."""
        self.endpoint.raise_if_failed()
        deadline = time.monotonic() + timeout_s
        if self.shm is not None:
            self.shm.flush(deadline)
        if self.tcp is not None:
            self.tcp.flush(deadline)
        self.grpc.flush(max(deadline - time.monotonic(), 0.0))

    def close(self) -> None:
        """Close shared memory (its rings, marker, and the job's files after a
        failure), the tcp data plane (its last flush: a failure is raised
        after gRPC closed), then gRPC."""
        problems = self.tcp.close() if self.tcp is not None else []
        if problems:
            self.endpoint.fail(problems[0])
        if self.shm is not None:
            self.shm.close()
        elif self.endpoint.job_failed.is_set() or self.endpoint.has_failed:
            self.remove_job_files()
        self.grpc.close()

    def remove_job_files(self) -> None:
        """Remove every file of the job's prefix on this host, once the job
        failed (a SIGKILLed peer's files are nobody's to remove otherwise)."""
        if self.shm is not None:
            self.shm.remove_job_files()
        elif self.prefix is not None:
            self.endpoint.job_failed.set()
            remove_job_segments(self.prefix, self.directory)

    # -- internals --

    def _reply(self, peer: Label, key: MessageKey, tensors: list[torch.Tensor]) -> None:
        """Shared memory's and the tcp data plane's way back to a sender (a
        refusal): over gRPC, delivered before the sender's flush can return."""
        self.grpc.send(peer, key, tensors)
        self.grpc.flush(self.grpc.settings.send_timeout_s)
