"""A process's inbox: messages buffered by key until the executor takes them."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import torch

from splitrun.splitter.labels import Label

from ..errors import JobFinished, MessageRejected, RecvTimeout
from .keys import MessageKey
from .receiving import TICK_S, tick

__all__ = ["Mailbox"]


class Mailbox:
    """Thread-safe buffer of incoming messages, keyed by `MessageKey`.

    `put` never blocks. `take` waits until the message is there, the deadline
    passes (`RecvTimeout` naming channel, peer and step) or the mailbox is
    aborted (the abort's error, e.g. `PeerFailed` naming the dead process).

    A waiting `take` sleeps on a lock of its own, registered under the keys it
    waits for; `put` wakes only the takes waiting for its key (a Condition's
    wait and notify cost twice as much Python on every message: measured, a
    4 KiB round trip pays it on both sides).
    """

    def __init__(self, owner: Label, incarnation: int = 0, *,
                 routes: Sequence[tuple[str, Callable]] = ()) -> None:
        self.owner = owner
        self.incarnation = incarnation
        self._messages: dict[MessageKey, tuple[Label, list[torch.Tensor]]] = {}
        self._lock = threading.Lock()
        # Per key: the locks of the takes waiting for it, held until woken.
        self._waiters: dict[MessageKey, list[threading.Lock]] = {}
        self._error: BaseException | None = None
        self._finished_at: int | None = None
        self._routes: list[tuple[str, Callable]] = list(routes)

    @property
    def routes(self) -> tuple[tuple[str, Callable], ...]:
        """The (prefix, handler) pairs `route` added, for a mailbox that
        replaces this one (a process's new identity)."""
        with self._lock:
            return tuple(self._routes)

    def route(self, prefix: str, handler: Callable[[MessageKey, Label, list[torch.Tensor]], None]
              ) -> None:
        """Hand messages on channels starting with `prefix` to `handler` as they
        arrive (it must not block), instead of keeping them for `take`."""
        with self._lock:
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
        with self._lock:
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
            waiters = self._waiters.pop(key, None)
            if waiters is not None:
                _wake(waiters)

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
        with self._lock:
            while (entry := messages.pop(key, None)) is None:
                tick()  # this thread's receive still waits (receiving.py)
                if control is not None and control[0] in messages:
                    sender, tensors = messages.pop(control[0])
                    self._lock.release()
                    try:
                        control[1](sender, tensors)
                    finally:
                        self._lock.acquire()
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
                self._wait((key,) if control is None else (key, control[0]),
                           min(remaining, TICK_S))
        sender, tensors = entry
        if sender != src:
            raise MessageRejected(
                f"[{self.owner.describe()}] {key} came from {sender.describe()}, "
                f"expected {src.describe()}")
        return tensors

    def _wait(self, keys: tuple[MessageKey, ...], timeout_s: float) -> None:
        """Sleep (the mailbox's lock released) until a message under one of
        `keys` is put, the mailbox is aborted or finished, or `timeout_s` passed."""
        waiter = threading.Lock()
        waiter.acquire()
        for key in keys:
            self._waiters.setdefault(key, []).append(waiter)
        self._lock.release()
        try:
            waiter.acquire(True, timeout_s)
        finally:
            self._lock.acquire()
            for key in keys:
                waiting = self._waiters.get(key)
                if waiting is not None and waiter in waiting:
                    waiting.remove(waiter)
                    if not waiting:
                        del self._waiters[key]

    def _wake_all(self) -> None:
        """Wake every waiting take (under the lock)."""
        waiters, self._waiters = self._waiters, {}
        for waiting in waiters.values():
            _wake(waiting)

    def abort(self, error: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = error
            self._wake_all()

    def finish_at(self, num_steps: int) -> None:
        """The job ran `num_steps` steps: receives of plan channels for later
        steps end with `JobFinished`; earlier steps, and channels outside the
        plan (final state, checkpoints), still wait for their message."""
        with self._lock:
            self._finished_at = num_steps
            # Never taken: drop them (a payload lent in place frees its ring room).
            for key in [k for k in self._messages if k.is_in_plan and k.step >= num_steps]:
                del self._messages[key]
            self._wake_all()

    def holds(self, key: MessageKey) -> bool:
        """True if a message under `key` is here, not taken yet."""
        return key in self._messages

    def pending(self) -> list[MessageKey]:
        """The keys of messages here and not taken yet, by step and channel."""
        with self._lock:
            return sorted(self._messages, key=lambda k: (k.step, k.channel))


def _wake(waiters: list[threading.Lock]) -> None:
    """Release each waiter still asleep (under the mailbox's lock, so no
    waiter is released twice: one waiting for two keys is listed under both)."""
    for waiter in waiters:
        if waiter.locked():
            waiter.release()
