"""A process's inbox: messages buffered by key until the executor takes them."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import torch

from splitrun.splitter.labels import Label

from ..errors import JobFinished, MessageRejected, RecvTimeout
from .keys import MessageKey

__all__ = ["Mailbox"]


class Mailbox:
    """Thread-safe buffer of incoming messages, keyed by `MessageKey`.

    `put` never blocks. `take` waits until the message is there, the deadline
    passes (`RecvTimeout` naming channel, peer and step) or the mailbox is
    aborted (the abort's error, e.g. `PeerFailed` naming the dead process).
    """

    def __init__(self, owner: Label, incarnation: int = 0, *,
                 routes: Sequence[tuple[str, Callable]] = ()) -> None:
        self.owner = owner
        self.incarnation = incarnation
        self._messages: dict[MessageKey, tuple[Label, list[torch.Tensor]]] = {}
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._finished_at: int | None = None
        self._routes: list[tuple[str, Callable]] = list(routes)

    @property
    def routes(self) -> tuple[tuple[str, Callable], ...]:
        """The (prefix, handler) pairs `route` added, for a mailbox that
        replaces this one (a process's new identity)."""
        with self._cond:
            return tuple(self._routes)

    def route(self, prefix: str, handler: Callable[[MessageKey, Label, list[torch.Tensor]], None]
              ) -> None:
        """Hand messages on channels starting with `prefix` to `handler` as they
        arrive (it must not block), instead of keeping them for `take`."""
        with self._cond:
            self._routes.append((prefix, handler))

    def put(self, key: MessageKey, src: Label, tensors: Sequence[torch.Tensor]) -> None:
        for prefix, handler in self._routes:
            if key.channel.startswith(prefix):
                if key.incarnation != self.incarnation:
                    raise MessageRejected(
                        f"[{self.owner.describe()}] refused {key} from {src.describe()}: "
                        f"the job's incarnation is {self.incarnation}")
                handler(key, src, list(tensors))
                return
        with self._cond:
            if key.incarnation != self.incarnation:
                raise MessageRejected(
                    f"[{self.owner.describe()}] refused {key} from {src.describe()}: "
                    f"the job's incarnation is {self.incarnation}; the sender is from a "
                    f"previous run of the job")
            entry = (src, list(tensors))
            if self._messages.setdefault(key, entry) is not entry:
                raise MessageRejected(
                    f"[{self.owner.describe()}] refused a second message for {key} "
                    f"from {src.describe()}")
            self._cond.notify_all()

    def take(self, key: MessageKey, src: Label, timeout_s: float,
             control: tuple[MessageKey, Callable[[Label, list[torch.Tensor]], None]] | None = None,
             ) -> list[torch.Tensor]:
        """The tensors `src` sent under `key`.

        `control`: while waiting, a message under the control key is taken and
        handed to the handler (in this thread), then the wait goes on. A
        process that serves steps answers requests between steps this way.
        """
        deadline = time.monotonic() + timeout_s
        messages = self._messages
        with self._cond:
            while (entry := messages.pop(key, None)) is None:
                if control is not None and control[0] in self._messages:
                    sender, tensors = self._messages.pop(control[0])
                    self._cond.release()
                    try:
                        control[1](sender, tensors)
                    finally:
                        self._cond.acquire()
                    deadline = time.monotonic() + timeout_s
                    continue
                if self._error is not None:
                    raise self._error
                if (self._finished_at is not None and key.step >= self._finished_at
                        and key.is_in_plan):
                    raise JobFinished(self._finished_at)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RecvTimeout(
                        f"[{self.owner.describe()}] receive on channel {key.channel!r} "
                        f"step {key.step}: no message from {src.describe()} within "
                        f"{timeout_s:g} s; is {src.describe()} alive and running the "
                        f"same plan? (raise recv_timeout_s if its steps are that slow)")
                self._cond.wait(remaining)
        sender, tensors = entry
        if sender != src:
            raise MessageRejected(
                f"[{self.owner.describe()}] {key} came from {sender.describe()}, "
                f"expected {src.describe()}")
        return tensors

    def abort(self, error: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = error
            self._cond.notify_all()

    def finish_at(self, num_steps: int) -> None:
        """The job ran `num_steps` steps: receives of plan channels for later
        steps end with `JobFinished`; earlier steps, and channels outside the
        plan (final state, checkpoints), still wait for their message."""
        with self._cond:
            self._finished_at = num_steps
            # Never taken: drop them (a payload lent in place frees its ring room).
            for key in [k for k in self._messages if k.is_in_plan and k.step >= num_steps]:
                del self._messages[key]
            self._cond.notify_all()

    def holds(self, key: MessageKey) -> bool:
        """True if a message under `key` is here, not taken yet."""
        return key in self._messages

    def pending(self) -> list[MessageKey]:
        """The keys of messages here and not taken yet, by step and channel."""
        with self._cond:
            return sorted(self._messages, key=lambda k: (k.step, k.channel))
