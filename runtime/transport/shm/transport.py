"""`ShmTransport`: messages between processes of one host through shared
memory, one ring per direction of each peer pair (`<incarnation>-<src>-<dst>`
under the job's prefix, see `ring`). It delivers into the process's
`Endpoint` (mailbox, pool, contracts, failure), as the gRPC transport does;
neither transport knows the other. `RoutedTransport` (`..router`) picks, per
peer, which of the two carries the messages.

Sharing memory with a peer. `start(address)` writes a marker file
`<prefix>port<PORT>.peer` holding this machine's boot id (mode 0600), PORT
being the port of the address peers reach this process at. A peer whose
marker (found by the port of its address) opens and holds our boot id is on
this host, can open our files, and sees ours the same way: both ends choose
shared memory for the pair without a message (`can_share_with`). Anything
else (another host, another user, another /dev/shm) cannot.

Receiving. A thread per incoming ring attaches to it, reads each message's
envelope, admits it (`admission`, the check the gRPC server runs too),
copies the payload into a pooled `MessageBuffer` (one copy) and puts it in
the mailbox. A large message on a plan channel is not copied when the ring
can spare it (`RingReader.can_lend`: room kept for what the sender still
sends in the step, at most half a ring held): its tensors view the ring
itself (`RingReader.lend_payload`) until the executor drops them; `is_lent`
tells the executor which tensors those are.
A refused message is skipped and its refusal sent back to the sender by the
`reply` path the transport is given (channel `@shm-refused:<receiver>`),
which fails the sender's transport as a gRPC refusal would; it never reaches
the mailbox. A ring whose writer dies (end-of-file without a close) fails the
process's transport with an error naming that peer, unless the job's failure
arrives first (within `peer_gone_grace_s`): then the peer exited because of
it, and saying it died would hide the cause.

Files. Rings are unlinked as soon as both ends hold them; the marker when the
transport closes. A process SIGKILLed leaves its marker (and rings nobody
attached yet): a transport that closes after the job failed (`abort`, or a
failure of its own), and a process that ends with an error (`remove_job_files`
from the bootstrap), remove every file of the job's prefix, the job being over;
so do the launcher's janitor and a standalone scheduler at their end.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from splitrun.splitter.labels import Label

from ...errors import MessageRejected, PeerDied, RecvTimeout, TransportError
from ..admission import Admission
from ..buffers import EncodedTensors, MessageBuffer, MessageLayout, encode
from ..contract import ChannelContract
from ..dtypes import TensorSpec
from ..endpoint import Endpoint
from ..filled import Fill, fill_then_send
from ..framing import EnvelopeWriter
from ..keys import MessageKey
from .job_files import DEFAULT_RING_BYTES
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

__all__ = ["ShmTransport", "ShmSettings", "REFUSED_CHANNEL", "Reply"]

logger = logging.getLogger(__name__)

# The channel a refusal goes back to its sender on, suffixed with the refuser.
REFUSED_CHANNEL = "@shm-refused:"

# How a refusal reaches its sender: `reply(peer, key, tensors)` sends a message
# over another path (gRPC: the sender's ring reader does not wait on it) and
# returns once it is delivered.
Reply = Callable[[Label, MessageKey, list[torch.Tensor]], None]


@dataclass(frozen=True, slots=True)
class ShmSettings:
    # Data bytes of each ring (one per direction of each same-host pair);
    # larger messages stream through it in pieces, and messages up to half of
    # it may be lent in place (a parameter server's 27 MB in the benchmark).
    ring_bytes: int = DEFAULT_RING_BYTES
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
        self._admission = Admission(owner.endpoint, sender=peer)
        self._via = f"{peer.describe()} over shared memory"
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
            if not (owner.is_closing or owner.endpoint.job_failed.is_set()):
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
            if owner.is_closing or owner.endpoint.job_failed.wait(settings.peer_gone_grace_s):
                logger.debug("%s %s is gone after the job failed: %s", owner.tag,
                             peer.describe(), exc)
            elif not owner.is_closing:
                owner.fail(PeerDied(f"{owner.tag} {peer.describe()} died (its end of the "
                                    f"shared-memory ring is gone): {exc}", peer=peer))
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
        while not (owner.is_closing or owner.endpoint.job_failed.is_set()):
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
        reader = self.reader
        timeout = owner.settings.message_timeout_s
        try:
            admitted = self._admission.admit(memoryview(header), self._via)
            layout = admitted.layout
            if layout.total_bytes != nbytes:
                raise MessageRejected(
                    f"{admitted.receiver.tag} refused {admitted.key} from "
                    f"{self.peer.describe()}: the envelope says {layout.total_bytes} bytes, "
                    f"the ring frame {nbytes}")
        except MessageRejected as exc:
            reader.discard_payload(timeout)
            self._refuse(str(exc))
            return
        tensors = None
        later_bytes = admitted.contract.later_bytes
        if (later_bytes is not None and nbytes >= LENDABLE_BYTES
                and layout.is_viewable_on_wire and reader.can_lend(later_bytes)):
            # Viewed in the ring, no copy: the executor drops these within the
            # step, and the ring keeps room for what the sender still sends in it.
            wire = reader.lend_payload(timeout)
            if wire is not None:
                tensors = layout.views_on_wire(wire)
        if tensors is None:
            buffer = MessageBuffer(layout, owner.endpoint.pool)
            buffer.fill(lambda view: reader.recv_payload_part_into(view, timeout))
            tensors = buffer.tensors()
        try:
            admitted.receiver.mailbox.put(admitted.key, admitted.src, tensors)
        except MessageRejected as exc:
            self._refuse(str(exc))

    def _refuse(self, why: str) -> None:
        """Log a refusal and tell the sender (by the reply path), so that it fails."""
        owner = self._owner
        logger.warning("%s", why)
        self._num_refused += 1
        text = torch.frombuffer(bytearray(why.encode()), dtype=torch.uint8)
        key = MessageKey(owner.endpoint.incarnation, self._num_refused,
                         REFUSED_CHANNEL + str(owner.label))
        try:
            # Delivered before the sender's flush (which waits for this ring)
            # can return: the refusal is raised there.
            owner.reply(self.peer, key, [text])
        except TransportError as exc:
            logger.warning("%s could not tell %s of the refusal: %s", owner.tag,
                           self.peer.describe(), exc)


class ShmTransport:
    """Messages to and from the peers on this host that share memory with
    this process (see the module's docstring), delivered into `endpoint`;
    `reply` carries refusals back to their senders.

        shm = ShmTransport(endpoint, prefix=new_job_prefix(), reply=...)
        shm.start(address)                   # this process's gRPC address
        if shm.can_share_with(peer_address)[0]:
            shm.connect(peer)
        shm.send(peer, key, tensors)
        shm.close()
    """

    def __init__(self, endpoint: Endpoint, *, prefix: str, reply: Reply,
                 settings: ShmSettings | None = None, directory: str = SHM_DIR) -> None:
        self.endpoint = endpoint
        self.prefix = prefix
        self.reply = reply
        self.settings = settings or ShmSettings()
        self.directory = directory
        self._boot_id = boot_id()
        self._marker: str | None = None
        self._writers: dict[Label, RingWriter] = {}
        self._attach_locks: dict[Label, threading.Lock] = {}
        self._incoming: dict[Label, _IncomingRing] = {}
        self._envelopes: EnvelopeWriter | None = None
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._is_closed = False
        endpoint.route(REFUSED_CHANNEL, self._on_refused)

    @property
    def label(self) -> Label:
        return self.endpoint.label

    @property
    def tag(self) -> str:
        return self.endpoint.tag

    @property
    def is_closing(self) -> bool:
        return self._closing.is_set()

    # -- setup --

    def start(self, address: str) -> None:
        """Write this process's marker for same-host peers; `address`: where
        peers reach this process (its port names the marker)."""
        if self._marker is not None:
            return
        path = _marker_path(self.prefix, address)
        if path is None:
            return
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, self._boot_id.encode())
        finally:
            os.close(fd)
        self._marker = path

    def can_share_with(self, address: str) -> tuple[bool, str]:
        """Whether the peer at `address` shares memory with this process, and why."""
        if self._marker is None:
            return False, "this process wrote no marker (start() first)"
        path = _marker_path(self.prefix, address)
        if path is None:
            return False, f"no port in its address {address!r}"
        try:
            with open(path) as f:
                theirs = f.read().strip()
        except OSError as exc:
            return False, f"its marker is not readable here ({exc.strerror})"
        if not theirs or theirs != self._boot_id:
            return False, "another boot id: not this host"
        return True, f"same host, boot id {self._boot_id[:8]}"

    def _ring_name(self, src: Label, dst: Label) -> str:
        return f"{self.endpoint.incarnation}-{src}-{dst}"

    def connect(self, peer: Label) -> None:
        """Create this side's ring to `peer` and attach to its ring here (in
        the background: the peer creates it in its own time)."""
        with self._lock:
            if self._envelopes is None:
                self._envelopes = EnvelopeWriter(str(self.label))
            self.endpoint.register({REFUSED_CHANNEL + str(peer): ChannelContract(peer, None)})
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

    def carries(self, peer: Label) -> bool:
        """True once `connect(peer)`: messages to `peer` go through its ring."""
        return peer in self._writers

    def _attach_writer(self, peer: Label) -> None:
        try:
            self._await_attach(peer)
        except Exception as exc:  # noqa: BLE001 - reported below unless the job ended
            # close() closes the writers first: a wait it cut short is no failure;
            # nor is one the job's failure ended.
            if not (self._is_closed or self.is_closing or self.endpoint.job_failed.is_set()):
                self.endpoint.fail(TransportError(f"{self.tag} shared memory to "
                                                  f"{peer.describe()}: {exc}"))

    def _await_attach(self, peer: Label) -> None:
        """Wait until `peer` attached to our ring to it, up to attach_timeout_s,
        in slices of poll_s: a job that fails meanwhile (`abort`, a peer that
        failed before it ever attached) ends the wait with its error at once."""
        writer = self._writers[peer]
        lock = self._attach_locks[peer]
        deadline = time.monotonic() + self.settings.attach_timeout_s
        while not writer.is_attached:
            if self._is_closed or self.is_closing or self.endpoint.job_failed.is_set():
                self.endpoint.raise_if_failed()
                if self.endpoint.abort_error is not None:
                    raise self.endpoint.abort_error
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

    # -- messages --

    def send(self, dst: Label, key: MessageKey, tensors: Sequence[torch.Tensor]) -> None:
        """Copied into `dst`'s ring before this returns (blocks only while the
        ring is full); `dst` must be connected."""
        writer = self._attached_writer(dst, key)
        try:
            if any(tensor.is_cuda for tensor in tensors):
                ready = tuple(tensor.detach().contiguous() for tensor in tensors)
                header = self._envelopes.serialize(key, EncodedTensors(ready, (), 0))
                writer.send_tensors(header, ready, self.settings.send_timeout_s)
            else:
                encoded = encode(tensors)
                header = self._envelopes.serialize(key, encoded)
                writer.send(header, encoded.views, self.settings.send_timeout_s)
        except RingError as exc:
            raise self._send_failed(key, dst, exc) from None

    def _attached_writer(self, dst: Label, key: MessageKey) -> RingWriter:
        """The ring to `dst`, its consumer attached, for one send of `key`."""
        writer = self._writers[dst]
        self.endpoint.raise_if_failed()
        if self._is_closed:
            raise TransportError(
                f"{self.tag} send {key} to {dst.describe()}: the transport is closed")
        if not writer.is_attached:
            try:
                self._await_attach(dst)
            except RingError as exc:
                raise self._send_failed(key, dst, exc) from None
        return writer

    def _send_failed(self, key: MessageKey, dst: Label, exc: RingError) -> TransportError:
        """A ring's failure in a send: the endpoint fails with it, named (a
        `PeerDied` where the peer dropped its end)."""
        message = f"{self.tag} sending {key} to {dst.describe()} over shared memory failed: {exc}"
        error = (PeerDied(message, peer=dst) if isinstance(exc, RingPeerGone)
                 else TransportError(message))
        self.endpoint.fail(error)
        return error

    def send_filled(self, dst: Label, key: MessageKey, specs: Sequence[TensorSpec],
                    fill: Fill) -> None:
        """`fill` writes the message straight into its slot in `dst`'s ring
        (`RingWriter.send_filled`), where it fits in half the ring and its
        tensors can be viewed there (each at a multiple of its item size);
        else into new tensors, then `send`."""
        writer = self._attached_writer(dst, key)
        layout = MessageLayout(specs)
        sent = False
        if layout.is_viewable_on_wire:
            try:
                header = self._envelopes.serialize_specs(key, layout.specs)
                sent = writer.send_filled(header, layout.total_bytes,
                                          lambda payload: fill(layout.views_on_wire(payload)),
                                          self.settings.send_timeout_s)
            except RingError as exc:
                raise self._send_failed(key, dst, exc) from None
        if not sent:
            fill_then_send(self.send, dst, key, specs, fill)

    def is_lent(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` views an incoming ring (a payload lent in place).
        Asked of every output and state at every step's end: cheap, and
        nearly free where no ring ever lent."""
        if tensor.device.type != "cpu":
            return False
        address = tensor.untyped_storage().data_ptr()
        return any(ring.reader.holds_address(address) for ring in list(self._incoming.values())
                   if ring.reader is not None and ring.reader.num_lent)

    def flush(self, deadline: float) -> None:
        """Wait until every message sent so far is in its receiver's mailbox
        (or refused: then the refusal fails this process's transport)."""
        with self._lock:
            writers = list(self._writers.items())
        for peer, writer in writers:
            try:
                writer.wait_consumed(max(deadline - time.monotonic(), 0.0))
            except RingError as exc:
                error = TransportError(f"{self.tag} flushing the ring to {peer.describe()} "
                                       f"failed: {exc}")
                self.endpoint.fail(error)
                raise error from None

    def close(self) -> None:
        """Close the rings (each receiver reads what was sent, then their end),
        stop reading ours, remove this process's marker; after the job
        failed, every file of the job."""
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
        if self.endpoint.job_failed.is_set() or self.endpoint.has_failed:
            self.remove_job_files()

    def remove_job_files(self) -> None:
        """Remove every file of the job's prefix (this host's /dev/shm), once the
        job failed: a SIGKILLed peer's files are nobody's to remove otherwise.
        The step files stay: the launcher still reads a killed peer's (it
        removes the job's files when it ends)."""
        self.endpoint.job_failed.set()
        remove_job_segments(self.prefix, self.directory, keep_step_files=True)

    # -- internals --

    def fail(self, error: TransportError) -> None:
        self.endpoint.fail(error)

    def _on_refused(self, key: MessageKey, src: Label, tensors: list[torch.Tensor]) -> None:
        """A same-host peer refused one of our messages: fail like a gRPC refusal."""
        why = bytes(tensors[0].numpy()).decode(errors="replace") if tensors else "no reason"
        self.endpoint.fail(TransportError(f"{self.tag} sending to {src.describe()} over shared "
                                          f"memory: refused: {why}"))
