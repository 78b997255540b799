"""`ShmTransport`: the `Transport` protocol with shared memory between
co-located peers and gRPC to everyone else.

It wraps a `GrpcTransport`, which stays the control path, the path to remote
peers and the owner of the mailbox, buffer pool and receive contracts. Per
peer pair on one host, payloads go through a `ring` instead, one per
direction (`<incarnation>-<src>-<dst>` under the job's prefix).

Choosing per pair. `start()` writes a marker file `<prefix>port<PORT>.peer`
holding this machine's boot id (mode 0600). In `set_peers`, a peer whose
marker (found by the port of its address) opens and holds our boot id is on
this host, can open our files, and sees ours the same way: both ends choose
shared memory for the pair without a message. Anything else (no job prefix,
another host, another user, another /dev/shm, `SPLITRUN_TRANSPORT=grpc`)
stays on gRPC. `kind_of(peer)` says which, and the choice is logged.

Receiving. A thread per incoming ring attaches to it, reads each message's
envelope, checks it with the same `find_contract` / `check_message` as the
gRPC path, copies the payload into a pooled `MessageBuffer` (one copy) and
puts it in the mailbox. A large message on a plan channel is not copied when
the ring can spare it (`RingReader.can_lend`: room kept for what the sender
still sends in the step, at most half a ring held): its tensors view the ring
itself (`RingReader.lend_payload`) until the executor drops them; `is_lent`
tells the executor which tensors those are.
A refused message is skipped and its refusal sent to the sender over gRPC
(channel `@shm-refused:<receiver>`), which fails the sender's transport as a
gRPC refusal would; it never reaches the mailbox. A ring whose writer dies
(end-of-file without a close) fails this transport with an error naming that
peer, unless the job's failure arrives first (within `peer_gone_grace_s`):
then the peer exited because of it, and saying it died would hide the cause.

Files. Rings are unlinked as soon as both ends hold them; the marker when the
transport closes. A process SIGKILLed leaves its marker (and rings nobody
attached yet): a transport that closes after the job failed (`abort`, or a
failure of its own), and a process that ends with an error (`remove_job_files`
from the bootstrap), remove every file of the job's prefix, the job being over;
so do the launcher's janitor and a standalone scheduler at their end.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from splitrun.splitter.errors import LabelError
from splitrun.splitter.labels import Label

from ...errors import MessageRejected, RecvTimeout, TransportError, WrongSender
from ..buffers import EncodedTensors, MessageBuffer, MessageLayout, encode
from ..contract import ChannelContract, check_message, find_contract, refusal_prefix
from ..framing import EnvelopeWriter, is_step_free, parse_envelope, specs_from_envelope, split_step
from ..grpc import GrpcTransport
from ..keys import MessageKey
from .ring import (
    LENDABLE_BYTES,
    SHM_DIR,
    RingAttachTimeout,
    RingClosed,
    RingError,
    RingPeerGone,
    RingReader,
    RingSettings,
    RingWriter,
    boot_id,
    job_file_path,
    remove_job_segments,
)

__all__ = ["ShmTransport", "ShmSettings", "TransportChoice", "TransportKind"]

logger = logging.getLogger(__name__)

_REFUSED_CHANNEL = "@shm-refused:"
# Bounds the known-envelope cache of one incoming ring.
_MAX_KNOWN_ENVELOPES = 4096


class TransportKind(enum.Enum):
    """How messages to one peer travel."""

    GRPC = "grpc"
    SHM = "shm"


class TransportChoice(enum.Enum):
    """`SPLITRUN_TRANSPORT`: `auto` uses shared memory for each peer on this host
    and gRPC for the others; `grpc` forces gRPC; `shm` requires shared memory
    for every peer (an error names a peer that is not on this host)."""

    AUTO = "auto"
    GRPC = "grpc"
    SHM = "shm"

    @classmethod
    def parse(cls, text: str, variable: str = "SPLITRUN_TRANSPORT") -> TransportChoice:
        try:
            return cls(text.strip().lower() or "auto")
        except ValueError:
            raise TransportError(f"{variable}={text!r}: use one of "
                                 f"{', '.join(c.value for c in cls)}") from None


@dataclass(frozen=True, slots=True)
class ShmSettings:
    # Data bytes of each ring (one per direction of each same-host pair);
    # larger messages stream through it in pieces, and messages up to half of
    # it may be lent in place (a parameter server's 27 MB in the benchmark).
    ring_bytes: int = 64 << 20
    # A process that computes on CUDA registers the rings it reads from as
    # pinned memory: what it receives in place then reaches its GPU by DMA
    # (measured on an H200: 64 MiB at 0.13x a pinned cudaMemcpy without).
    pin_incoming: bool = False
    # Bounds the wait for a peer to create or attach to a ring: peers do so in
    # `set_peers`, once their model is captured and split, which may take a
    # loaded machine minutes; the job's failure (`abort`) or a close ends the
    # wait at once.
    attach_timeout_s: float = 300.0
    # Bounds a send blocked on a full ring (the peer does not read).
    send_timeout_s: float = 300.0
    # Bounds reading one message's payload once its header came.
    message_timeout_s: float = 600.0
    # How often a ring's reader thread looks whether the transport is closing.
    poll_s: float = 0.5
    # A same-host peer whose ring ends without a close has died; it fails this
    # transport after this long, unless the job's failure (`abort`) comes first:
    # a process that exits because the job failed (a lost scheduler, a peer's
    # error) is a consequence, and this process's error should say the cause.
    # Bounds a wait on an event; the scheduler's heartbeats (every 0.5 s) tell
    # every process of a failure well within it.
    peer_gone_grace_s: float = 2.0


def _marker_path(prefix: str, address: str) -> str | None:
    port = address.rsplit(":", 1)[-1]
    if not port.isdigit():
        return None
    return job_file_path(prefix, f"port{port}", ".peer")


class _IncomingRing:
    """One peer's ring into this process, read by its own thread."""

    def __init__(self, owner: ShmTransport, peer: Label, name: str) -> None:
        self._owner = owner
        self.peer = peer
        self.name = name
        self.reader: RingReader | None = None
        self._known: dict[bytes, tuple[MessageLayout, int, str]] = {}
        self._known_for: tuple | None = None
        self._num_refused = 0
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name=f"splitrun-shm-{name}")

    def _run(self) -> None:
        owner, peer = self._owner, self.peer
        settings = owner.settings
        try:
            self.reader = self._attach()
            if self.reader is None:
                return  # the transport closes, or the job failed, first
            if settings.pin_incoming:
                self.reader.pin()
        except RingClosed:
            logger.debug("%s ring from %s closed before its first message", owner.tag,
                         peer.describe())
            return
        except RingError as exc:
            if not (owner.is_closing or owner.job_failed.is_set()):
                owner.fail(TransportError(f"{owner.tag} shared memory from {peer.describe()}: "
                                          f"{exc}"))
            return
        try:
            while not owner.is_closing:
                try:
                    header, nbytes = self.reader.recv_header(settings.poll_s)
                except RecvTimeout:
                    continue
                self._take(header, nbytes)
        except RingClosed:
            logger.debug("%s ring from %s closed", owner.tag, peer.describe())
        except RingPeerGone as exc:
            if owner.is_closing or owner.job_failed.wait(settings.peer_gone_grace_s):
                logger.debug("%s %s is gone after the job failed: %s", owner.tag,
                             peer.describe(), exc)
            elif not owner.is_closing:
                owner.fail(TransportError(f"{owner.tag} {peer.describe()} died (its end of "
                                          f"the shared-memory ring is gone): {exc}"))
        except RingError as exc:
            if not owner.is_closing:
                owner.fail(TransportError(f"{owner.tag} {peer.describe()} broke the "
                                          f"shared-memory ring: {exc}"))
        except Exception as exc:  # noqa: BLE001 - a bug here must fail the job, loudly
            logger.exception("%s reading the ring from %s failed", owner.tag, peer.describe())
            owner.fail(TransportError(f"{owner.tag} reading the ring from {peer.describe()} "
                                      f"failed: {type(exc).__name__}: {exc}"))

    def _attach(self) -> RingReader | None:
        """Attach to the peer's ring, waiting up to `attach_timeout_s` for the
        peer to create it (its `set_peers`), in slices of `poll_s`: None once
        the transport closes or the job fails meanwhile."""
        owner, settings = self._owner, self._owner.settings
        deadline = time.monotonic() + settings.attach_timeout_s
        while not (owner.is_closing or owner.job_failed.is_set()):
            remaining = deadline - time.monotonic()
            try:
                return RingReader.attach(owner.prefix, self.name, owner=owner.label.describe(),
                                         peer=self.peer.describe(),
                                         timeout_s=max(min(settings.poll_s, remaining), 0.0),
                                         directory=owner.directory)
            except RingAttachTimeout:
                if remaining <= settings.poll_s:
                    raise RingAttachTimeout(
                        f"{self.peer.describe()} did not create its ring to this "
                        f"process within {settings.attach_timeout_s:g} s; is it running on "
                        f"this host, and still setting up (capturing, splitting)?") from None
        return None

    def _take(self, header: bytes, nbytes: int) -> None:
        owner = self._owner
        endpoint = owner.grpc.endpoint
        reader = self.reader
        timeout = owner.settings.message_timeout_s
        try:
            key, layout, later_bytes = self._check(endpoint, header)
            if layout.total_bytes != nbytes:
                raise MessageRejected(
                    f"{owner.tag} refused {key} from {self.peer.describe()}: the envelope "
                    f"says {layout.total_bytes} bytes, the ring frame {nbytes}")
        except (MessageRejected, LabelError) as exc:
            reader.discard_payload(timeout)
            self._refuse(str(exc))
            return
        tensors = None
        if (later_bytes is not None and nbytes >= LENDABLE_BYTES
                and layout.is_viewable_on_wire and reader.can_lend(later_bytes)):
            # Viewed in the ring, no copy: the executor drops these within the
            # step, and the ring keeps room for what the sender still sends in it.
            wire = reader.lend_payload(timeout)
            if wire is not None:
                tensors = layout.views_on_wire(wire)
        if tensors is None:
            buffer = MessageBuffer(layout, endpoint.pool)
            buffer.fill(lambda view: reader.recv_payload_part_into(view, timeout))
            tensors = buffer.tensors()
        try:
            endpoint.mailbox.put(key, self.peer, tensors)
        except MessageRejected as exc:
            self._refuse(str(exc))

    def _check(self, endpoint, header: bytes) -> tuple[MessageKey, MessageLayout, int | None]:
        """The message's key, buffer layout and its contract's `later_bytes`
        (None: not to be lent), or `MessageRejected` saying why not."""
        # Returns at once once `expect` has run; a message that came first waits.
        table = endpoint.contracts.wait(endpoint.settings.expect_timeout_s)
        known_for = self._known_for
        if known_for is None or known_for[0] is not endpoint or known_for[1] is not table:
            # Envelopes checked against another table or identity prove nothing.
            self._known = {}
            self._known_for = (endpoint, table)
        view = memoryview(header)
        split = split_step(view)
        if split is not None:
            known = self._known.get(split[1].tobytes())
            if known is not None:
                layout, incarnation, channel, later_bytes = known
                return MessageKey(incarnation, split[0], channel), layout, later_bytes
        envelope = parse_envelope(view)
        key = MessageKey(envelope.incarnation, envelope.step, envelope.channel)
        via = f"shared memory from {self.peer.describe()}"
        where = refusal_prefix(endpoint.label, key, envelope.src, via)
        if envelope.incarnation != endpoint.incarnation:
            raise MessageRejected(
                f"{where}: incarnation {envelope.incarnation}, but the job's incarnation is "
                f"{endpoint.incarnation}; the sender belongs to another run of the job")
        if table is None:
            why = endpoint.contracts.why_no_table(endpoint.settings.expect_timeout_s)
            raise MessageRejected(f"{where}: {why}")
        contract = find_contract(table, key, envelope.src, receiver=endpoint.label, via=via)
        src = Label.parse(envelope.src)
        if src != self.peer:
            raise WrongSender(f"{where}: this ring carries {self.peer.describe()}'s messages "
                              f"only, the envelope says {src.describe()}")
        specs = specs_from_envelope(envelope, max_bytes=endpoint.settings.max_message_bytes)
        check_message(contract, key, src, specs, receiver=endpoint.label, via=via)
        layout = MessageLayout(specs)
        if split is not None and split[0] == envelope.step and is_step_free(split[1]):
            if len(self._known) >= _MAX_KNOWN_ENVELOPES:
                self._known = {}
            self._known[split[1].tobytes()] = (layout, envelope.incarnation, envelope.channel,
                                               contract.later_bytes)
        return key, layout, contract.later_bytes

    def _refuse(self, why: str) -> None:
        """Log a refusal and tell the sender (over gRPC), so that it fails."""
        owner = self._owner
        logger.warning("%s", why)
        self._num_refused += 1
        text = torch.frombuffer(bytearray(why.encode()), dtype=torch.uint8)
        key = MessageKey(owner.grpc.endpoint.incarnation, self._num_refused,
                         _REFUSED_CHANNEL + str(owner.label))
        try:
            owner.grpc.send(self.peer, key, [text])
            # Delivered before the sender's flush (which waits for this ring)
            # can return: the refusal is raised there.
            owner.grpc.flush(owner.settings.send_timeout_s)
        except TransportError as exc:
            logger.warning("%s could not tell %s of the refusal: %s", owner.tag,
                           self.peer.describe(), exc)


class ShmTransport:
    """The `Transport` protocol over shared memory to peers on this host and a
    wrapped `GrpcTransport` to the others (see the module's docstring).

        transport = ShmTransport(GrpcTransport(label, token=..., incarnation=...),
                                 prefix=new_job_prefix())
        address = transport.start()
        transport.set_peers({peer: address_of_peer, ...})
        transport.kind_of(peer)              # TransportKind.SHM on this host
        transport.close()
    """

    def __init__(self, grpc: GrpcTransport, *, prefix: str | None,
                 choice: TransportChoice = TransportChoice.AUTO,
                 settings: ShmSettings | None = None, directory: str = SHM_DIR) -> None:
        self.grpc = grpc
        self.prefix = prefix
        self.choice = choice
        self.settings = settings or ShmSettings()
        self.directory = directory
        if choice is TransportChoice.SHM and prefix is None:
            raise TransportError("SPLITRUN_TRANSPORT=shm needs the job's shared-memory prefix "
                                 "(SPLITRUN_SHM_PREFIX, set by `splitrun launch`)")
        self._boot_id = boot_id()
        self._marker: str | None = None
        self._kinds: dict[Label, TransportKind] = {}
        self._writers: dict[Label, RingWriter] = {}
        self._attach_locks: dict[Label, threading.Lock] = {}
        self._incoming: dict[Label, _IncomingRing] = {}
        self._envelopes: EnvelopeWriter | None = None
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._is_closed = False
        # Set by abort() and fail(): the job failed (close() removes its files).
        self.job_failed = threading.Event()
        self._abort_error: BaseException | None = None
        grpc.route(_REFUSED_CHANNEL, self._on_refused)

    def __enter__(self) -> ShmTransport:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def label(self) -> Label:
        return self.grpc.label

    @property
    def incarnation(self) -> int:
        return self.grpc.incarnation

    @property
    def address(self) -> str | None:
        return self.grpc.address

    @property
    def tag(self) -> str:
        return f"[{self.label.describe()}]"

    @property
    def is_closing(self) -> bool:
        return self._closing.is_set()

    # -- setup --

    def start(self) -> str:
        """Start the gRPC server; write this process's marker for same-host peers."""
        address = self.grpc.start()
        if self.choice is not TransportChoice.GRPC and self.prefix is not None \
                and self._marker is None:
            path = _marker_path(self.prefix, address)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, self._boot_id.encode())
            finally:
                os.close(fd)
            self._marker = path
        return address

    def set_identity(self, label: Label, incarnation: int) -> None:
        with self._lock:
            if self._kinds:
                raise TransportError(f"{self.tag} set_identity({label}, {incarnation}) after "
                                     f"set_peers; a process's identity is fixed by then")
        self.grpc.set_identity(label, incarnation)

    def set_peers(self, peers: Mapping[Label, str]) -> None:
        """Where each peer listens; chooses shared memory or gRPC for each new
        peer, creating this side's ring to it and attaching to its ring here."""
        self.grpc.set_peers(peers)
        with self._lock:
            if self._envelopes is None:
                self._envelopes = EnvelopeWriter(str(self.label))
            for peer, address in sorted(peers.items()):
                if peer == self.label or peer in self._kinds:
                    continue
                kind, why = self._choose(address)
                if kind is TransportKind.GRPC and self.choice is TransportChoice.SHM:
                    raise TransportError(
                        f"{self.tag} SPLITRUN_TRANSPORT=shm, but {peer.describe()} at "
                        f"{address} cannot share memory with this process: {why}")
                if kind is TransportKind.SHM:
                    self._open_rings(peer)
                self._kinds[peer] = kind
                logger.info("%s transport to %s: %s (%s)", self.tag, peer.describe(),
                            kind.value, why)

    def _choose(self, address: str) -> tuple[TransportKind, str]:
        if self.choice is TransportChoice.GRPC:
            return TransportKind.GRPC, "SPLITRUN_TRANSPORT=grpc"
        if self.prefix is None:
            return TransportKind.GRPC, "no shared-memory prefix for this job"
        if self._marker is None:
            return TransportKind.GRPC, "this process wrote no marker (start() first)"
        path = _marker_path(self.prefix, address)
        if path is None:
            return TransportKind.GRPC, f"no port in its address {address!r}"
        try:
            with open(path) as f:
                theirs = f.read().strip()
        except OSError as exc:
            return TransportKind.GRPC, f"its marker is not readable here ({exc.strerror})"
        if not theirs or theirs != self._boot_id:
            return TransportKind.GRPC, "another boot id: not this host"
        return TransportKind.SHM, f"same host, boot id {self._boot_id[:8]}"

    def _ring_name(self, src: Label, dst: Label) -> str:
        return f"{self.incarnation}-{src}-{dst}"

    def _open_rings(self, peer: Label) -> None:
        self.grpc.register({_REFUSED_CHANNEL + str(peer): ChannelContract(peer, None)})
        settings = self.settings
        self._writers[peer] = RingWriter(
            self.prefix, self._ring_name(self.label, peer), owner=self.label.describe(),
            peer=peer.describe(), directory=self.directory,
            settings=RingSettings(capacity_bytes=settings.ring_bytes,
                                  attach_timeout_s=settings.attach_timeout_s))
        self._attach_locks[peer] = threading.Lock()
        # The peer attaches in the background: its files go from /dev/shm as
        # soon as it has, whether or not this process ever sends to it.
        threading.Thread(target=self._attach_writer, args=(peer,), daemon=True,
                         name=f"splitrun-shm-attach-{peer}").start()
        incoming = _IncomingRing(self, peer, self._ring_name(peer, self.label))
        self._incoming[peer] = incoming
        incoming.thread.start()

    def _attach_writer(self, peer: Label) -> None:
        try:
            self._await_attach(peer)
        except Exception as exc:  # noqa: BLE001 - reported below unless the job ended
            # close() closes the writers first: a wait it cut short is no failure;
            # nor is one the job's failure ended.
            if not (self._is_closed or self.is_closing or self.job_failed.is_set()):
                self.fail(TransportError(f"{self.tag} shared memory to "
                                         f"{peer.describe()}: {exc}"))

    def _await_attach(self, peer: Label) -> None:
        """Wait until `peer` attached to our ring to it, up to attach_timeout_s,
        in slices of poll_s: a job that fails meanwhile (`abort`, a peer that
        failed before it ever attached) ends the wait with its error at once."""
        writer = self._writers[peer]
        lock = self._attach_locks[peer]
        deadline = time.monotonic() + self.settings.attach_timeout_s
        while not writer.is_attached:
            if self._is_closed or self.is_closing or self.job_failed.is_set():
                self.grpc.raise_if_failed()
                if self._abort_error is not None:
                    raise self._abort_error
                raise TransportError(f"{self.tag} stopped waiting for {peer.describe()} to "
                                     f"attach to shared memory: the transport is closing")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RingError(f"{self.tag} ring to {peer.describe()}: {peer.describe()} did "
                                f"not attach within {self.settings.attach_timeout_s:g} s; is it "
                                f"running and on this host?")
            wait_s = min(self.settings.poll_s, remaining)
            if not lock.acquire(timeout=wait_s):
                continue
            try:
                if not writer.is_attached:
                    writer.wait_attached(wait_s)
            except RingAttachTimeout:
                continue
            finally:
                lock.release()

    def kind_of(self, peer: Label) -> TransportKind:
        """How messages to and from `peer` travel (decided by `set_peers`)."""
        kind = self._kinds.get(peer)
        if kind is None:
            raise TransportError(f"{self.tag} {peer.describe()} is no peer yet; set_peers() "
                                 f"first")
        return kind

    def expect(self, contracts: Mapping[str, ChannelContract]) -> None:
        self.grpc.expect(contracts)

    def register(self, contracts: Mapping[str, ChannelContract]) -> None:
        self.grpc.register(contracts)

    def pending(self) -> list[MessageKey]:
        return self.grpc.pending()

    def ping(self, dst: Label, timeout_s: float = 5.0) -> str:
        return self.grpc.ping(dst, timeout_s)

    # -- the Transport protocol --

    def send(self, dst: Label, key: MessageKey, tensors: Sequence[torch.Tensor]) -> None:
        """To a same-host peer: copied into its ring before this returns (blocks
        only while the ring is full); to others: queued on gRPC."""
        writer = self._writers.get(dst)
        if writer is None:
            self.grpc.send(dst, key, tensors)
            return
        self.grpc.raise_if_failed()
        if self._is_closed:
            raise TransportError(
                f"{self.tag} send {key} to {dst.describe()}: the transport is closed")
        try:
            if not writer.is_attached:
                self._await_attach(dst)
            if any(tensor.is_cuda for tensor in tensors):
                ready = tuple(tensor.detach().contiguous() for tensor in tensors)
                header = self._envelopes.serialize(key, EncodedTensors(ready, (), 0))
                writer.send_tensors(header, ready, self.settings.send_timeout_s)
            else:
                encoded = encode(tensors)
                header = self._envelopes.serialize(key, encoded)
                writer.send(header, encoded.views, self.settings.send_timeout_s)
        except RingError as exc:
            error = TransportError(f"{self.tag} sending {key} to {dst.describe()} over shared "
                                   f"memory failed: {exc}")
            self.grpc.fail(error)
            raise error from None

    def recv(self, src: Label, key: MessageKey, timeout_s: float,
             control=None) -> list[torch.Tensor]:
        return self.grpc.recv(src, key, timeout_s, control)

    def is_lent(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` views an incoming ring (a payload lent in place).
        Asked of every output and state at every step's end: cheap, and
        nearly free where no ring ever lent."""
        if tensor.device.type != "cpu":
            return False
        address = tensor.untyped_storage().data_ptr()
        return any(ring.reader.holds_address(address) for ring in list(self._incoming.values())
                   if ring.reader is not None and ring.reader.num_lent)

    def abort(self, error: BaseException) -> None:
        if self._abort_error is None:
            self._abort_error = error
        self.job_failed.set()
        self.grpc.abort(error)

    def finish_at(self, num_steps: int) -> None:
        self.grpc.finish_at(num_steps)

    def route(self, prefix: str, handler) -> None:
        self.grpc.route(prefix, handler)

    def flush(self, timeout_s: float) -> None:
        """Wait until every message sent so far is in its receiver's mailbox
        (or refused: then that refusal is raised)."""
        self.grpc.raise_if_failed()
        deadline = time.monotonic() + timeout_s
        with self._lock:
            writers = list(self._writers.items())
        for peer, writer in writers:
            try:
                writer.wait_consumed(max(deadline - time.monotonic(), 0.0))
            except RingError as exc:
                error = TransportError(f"{self.tag} flushing the ring to {peer.describe()} "
                                       f"failed: {exc}")
                self.grpc.fail(error)
                raise error from None
        self.grpc.flush(max(deadline - time.monotonic(), 0.0))

    def close(self) -> None:
        """Close the rings (each receiver reads what was sent, then their end),
        stop reading ours, remove this process's marker, close gRPC."""
        if self._is_closed:
            return
        self._is_closed = True
        with self._lock:
            writers = list(self._writers.values())
            incoming = list(self._incoming.values())
        for writer in writers:
            writer.close()
        self._closing.set()
        deadline = time.monotonic() + self.settings.poll_s * 4 + 5.0
        for ring in incoming:
            ring.thread.join(max(deadline - time.monotonic(), 0.0))
            if ring.thread.is_alive():
                logger.warning("%s the reader of the ring from %s did not stop; leaving its "
                               "mapping open", self.tag, ring.peer.describe())
            elif ring.reader is not None:
                ring.reader.close()
        readers = [ring.reader for ring in incoming if ring.reader is not None]
        if readers:
            logger.info("%s shared memory: received %d messages, %d of them lent in place",
                        self.tag, sum(r.num_received for r in readers),
                        sum(r.num_lent for r in readers))
        if self._marker is not None:
            try:
                os.unlink(self._marker)
            except FileNotFoundError:
                pass
        if self.job_failed.is_set() or self.grpc.has_failed:
            self.remove_job_files()
        self.grpc.close()

    def remove_job_files(self) -> None:
        """Remove every file of the job's prefix (this host's /dev/shm), once the
        job failed: a SIGKILLed peer's files are nobody's to remove otherwise."""
        self.job_failed.set()
        if self.prefix is not None:
            remove_job_segments(self.prefix, self.directory)

    # -- internals --

    def fail(self, error: TransportError) -> None:
        self.job_failed.set()
        self.grpc.fail(error)

    def _on_refused(self, key: MessageKey, src: Label, tensors: list[torch.Tensor]) -> None:
        """A same-host peer refused one of our messages: fail like a gRPC refusal."""
        why = bytes(tensors[0].numpy()).decode(errors="replace") if tensors else "no reason"
        self.grpc.fail(TransportError(f"{self.tag} sending to {src.describe()} over shared "
                                      f"memory: refused: {why}"))
