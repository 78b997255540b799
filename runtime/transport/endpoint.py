"""`Endpoint`: this process's receiving side, shared by every transport that
delivers into it. It holds who the process is (`Identity`: label,
incarnation, mailbox), the job's token, the pool receive buffers come from,
the receive contracts, and the first fatal failure of any transport of the
process. The gRPC server and the shared-memory rings admit messages into it
(`admission`); the executor takes them out (`take`). Neither transport holds
the other, nor the endpoint's owner.

`set_identity` gives the process the label and incarnation the scheduler
assigned, once its server is up (the address is part of the registration):
the endpoint then replaces its `Identity` (a new mailbox, keeping the old
one's routes), which receivers read once per message.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from splitrun.splitter.labels import Label

from ..errors import PeerDied, TransportError
from .buffers import BufferPool
from .contract import ChannelContract, ReceiveContracts
from .framing import DEFAULT_MAX_MESSAGE_BYTES
from .keys import MessageKey
from .mailbox import Mailbox

__all__ = ["Endpoint", "Identity"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Identity:
    """Who the process is as of now; replaced (never changed) by `set_identity`."""

    label: Label
    incarnation: int
    mailbox: Mailbox
    # `[worker 1]`: how this process's log lines and errors start.
    tag: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tag", f"[{self.label.describe()}]")


class Endpoint:
    """`label`'s receiving side. `pool`: where received messages' buffers come
    from; `expect_timeout_s` bounds how long a message that came before the
    plan's contracts waits for them; envelopes declaring more than
    `max_message_bytes` are refused before any allocation."""

    def __init__(self, label: Label, incarnation: int, *, token: str,
                 pool: BufferPool | None = None, expect_timeout_s: float = 300.0,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        self.token = token
        self.pool = pool or BufferPool()
        self.contracts = ReceiveContracts()
        self.expect_timeout_s = expect_timeout_s
        self.max_message_bytes = max_message_bytes
        self._identity = Identity(label, incarnation, Mailbox(label, incarnation))
        self._lock = threading.Lock()
        self._error: TransportError | None = None
        self._error_raised = False
        # Set once the job failed (`abort`) or a transport of the process did
        # (`fail`): waits on peers end, and closing removes the job's files.
        self.job_failed = threading.Event()
        self.abort_error: BaseException | None = None

    # -- who --

    @property
    def identity(self) -> Identity:
        return self._identity

    @property
    def label(self) -> Label:
        return self._identity.label

    @property
    def incarnation(self) -> int:
        return self._identity.incarnation

    @property
    def tag(self) -> str:
        return self._identity.tag

    def set_identity(self, label: Label, incarnation: int) -> None:
        """The label and incarnation the scheduler assigned; before any message."""
        routes = self._identity.mailbox.routes
        self._identity = Identity(label, incarnation, Mailbox(label, incarnation, routes=routes))

    # -- contracts --

    def expect(self, contracts: Mapping[str, ChannelContract]) -> None:
        """The contracts of this process's plan channels (see `receive_contracts`);
        messages that arrived first were waiting for them."""
        self.contracts.expect(contracts)

    def register(self, contracts: Mapping[str, ChannelContract]) -> None:
        """Contracts of channels outside the plan, registered by their owners."""
        self.contracts.register(contracts)

    # -- the mailbox --

    def take(self, key: MessageKey, src: Label, timeout_s: float,
             control=None) -> list[torch.Tensor]:
        """The tensors `src` sent under `key`; `RecvTimeout` past the deadline.
        While waiting, a message under `control`'s key goes to its handler."""
        self.raise_if_failed()
        try:
            return self._identity.mailbox.take(key, src, timeout_s, control)
        except TransportError as exc:
            self.note_raised(exc)
            raise

    def route(self, prefix: str,
              handler: Callable[[MessageKey, Label, list[torch.Tensor]], None]) -> None:
        """Hand incoming messages on channels starting with `prefix` to `handler`."""
        self._identity.mailbox.route(prefix, handler)

    def finish_at(self, num_steps: int) -> None:
        """Receives for steps >= `num_steps` end with `JobFinished`."""
        self._identity.mailbox.finish_at(num_steps)

    def pending(self) -> list[MessageKey]:
        """The keys of messages received and not taken yet (for tests and
        diagnostics), by step and channel."""
        return self._identity.mailbox.pending()

    # -- failing --

    def abort(self, error: BaseException) -> None:
        """The job failed: wake every pending receive with `error` (and refuse
        every message still waiting for `expect`)."""
        if self.abort_error is None:
            self.abort_error = error
        self.job_failed.set()
        self._identity.mailbox.abort(error)
        self.contracts.stop_waiting()

    def fail(self, error: TransportError) -> None:
        """A transport's fatal error (a sender's, a ring's): remember the first,
        wake every receive with it; sends and flushes raise it from now on."""
        with self._lock:
            if self._error is None:
                self._error = error
                # A dead peer is its own failure's consequence (the launcher
                # names that peer); this process's own fault is an error.
                logger.log(logging.INFO if isinstance(error, PeerDied) else logging.ERROR,
                           "%s", error)
        self.job_failed.set()
        self._identity.mailbox.abort(self._error)
        self.contracts.stop_waiting()

    @property
    def has_failed(self) -> bool:
        """True once a fatal error failed a transport of this process (`fail`)."""
        return self._error is not None

    def raise_if_failed(self) -> None:
        """Raise the failure, if there is one."""
        if self._error is not None:
            self._error_raised = True
            raise self._error

    def note_raised(self, error: BaseException) -> None:
        """`error` reached a caller: if it is the failure, it is reported."""
        if error is self._error:
            self._error_raised = True

    def unreported_failure(self) -> TransportError | None:
        """The failure no caller was told about yet (closing raises it), once."""
        if self._error is None or self._error_raised:
            return None
        self._error_raised = True
        return self._error
