"""The mailbox's waits: a waiting take sleeps until a message under its key
(or its control key) is put, the mailbox is aborted or finished, or its
deadline passes; a put for another key leaves it waiting. Real threads; every
wait bounded."""

import threading
import time

import pytest
import torch

from splitrun.runtime import Mailbox, MessageKey, PeerFailed, RecvTimeout
from splitrun.runtime.errors import JobFinished
from splitrun.runtime.transport.receiving import receiving
from splitrun.splitter import Label

W0, W1 = Label.worker(0), Label.worker(1)
WAIT_S = 30.0  # bounds every wait here; none should come close


def key(step: int, channel: str = "w0->w1#0") -> MessageKey:
    return MessageKey(0, step, channel)


class Taker:
    """`mailbox.take(...)` on a thread of its own; `result()` is what it
    returned or raised."""

    def __init__(self, mailbox: Mailbox, k: MessageKey, **kwargs) -> None:
        self.started = threading.Event()
        self._outcome: list = []
        timeout_s = kwargs.pop("timeout_s", WAIT_S)

        def run() -> None:
            self.started.set()
            try:
                self._outcome.append(("ok", mailbox.take(k, W0, timeout_s, **kwargs)))
            except BaseException as exc:  # noqa: BLE001 - handed to the test
                self._outcome.append(("raised", exc))

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        assert self.started.wait(WAIT_S)

    def result(self):
        self._thread.join(WAIT_S)
        assert not self._thread.is_alive(), "the take never returned"
        return self._outcome[0]


def test_a_waiting_take_gets_its_message_and_not_another_keys():
    mailbox = Mailbox(W1)
    taker = Taker(mailbox, key(1))
    mailbox.put(key(0), W0, [torch.zeros(1)])  # another step: the take waits on
    mailbox.put(key(1), W0, [torch.ones(1)])
    kind, tensors = taker.result()
    assert kind == "ok" and torch.equal(tensors[0], torch.ones(1))
    assert mailbox.pending() == [key(0)]


def test_many_takes_each_get_their_own_message():
    mailbox = Mailbox(W1)
    takers = [Taker(mailbox, key(step)) for step in range(8)]
    for step in reversed(range(8)):
        mailbox.put(key(step), W0, [torch.full((1,), float(step))])
    for step, taker in enumerate(takers):
        kind, tensors = taker.result()
        assert kind == "ok" and tensors[0].item() == step
    assert mailbox.pending() == []


def test_a_control_message_is_handled_by_the_waiting_take_which_waits_on():
    mailbox = Mailbox(W1)
    control_key = key(0, "@control")
    handled = []
    handler_done = threading.Event()

    def handle(sender, tensors):
        handled.append((sender, threading.current_thread().name, tensors[0].item()))
        handler_done.set()

    taker = Taker(mailbox, key(5), control=(control_key, handle))
    mailbox.put(control_key, W0, [torch.full((1,), 7.0)])
    assert handler_done.wait(WAIT_S)
    mailbox.put(key(5), W0, [torch.ones(2)])
    kind, tensors = taker.result()
    assert kind == "ok" and torch.equal(tensors[0], torch.ones(2))
    assert handled == [(W0, handled[0][1], 7.0)]
    assert handled[0][1] != threading.current_thread().name  # on the taking thread


def test_abort_wakes_a_waiting_take_with_the_failure():
    mailbox = Mailbox(W1)
    taker = Taker(mailbox, key(0))
    mailbox.abort(PeerFailed("stopped because worker 0 failed: boom"))
    kind, error = taker.result()
    assert kind == "raised" and isinstance(error, PeerFailed), error
    assert "worker 0 failed: boom" in str(error)


def test_finishing_wakes_a_take_of_a_later_step():
    mailbox = Mailbox(W1)
    taker = Taker(mailbox, key(4))
    mailbox.finish_at(3)
    kind, error = taker.result()
    assert kind == "raised" and isinstance(error, JobFinished), error


def test_a_take_nobody_answers_ends_at_its_deadline_naming_the_peer():
    mailbox = Mailbox(W1)
    taker = Taker(mailbox, key(2), timeout_s=0.2)
    kind, error = taker.result()
    assert kind == "raised" and isinstance(error, RecvTimeout), error
    assert "step 2: no message from worker 0 within 0.2 s" in str(error)
    mailbox.put(key(2), W0, [torch.ones(1)])  # a late message is kept, not lost
    assert mailbox.pending() == [key(2)]


def test_a_second_message_for_a_key_is_refused_while_a_take_waits_elsewhere():
    mailbox = Mailbox(W1)
    taker = Taker(mailbox, key(1))
    mailbox.put(key(0), W0, [torch.zeros(1)])
    with pytest.raises(Exception, match="second message"):
        mailbox.put(key(0), W0, [torch.zeros(1)])
    mailbox.put(key(1), W0, [torch.ones(1)])
    assert taker.result()[0] == "ok"


def test_a_receive_stuck_in_its_control_handler_is_told_from_one_that_waits():
    # The receiving thread runs the control message's handler, which does not
    # return: the receive no longer turns (receiving.py), so its process waits
    # on no one and a stall check may name it; the other receive still waits.
    mailbox = Mailbox(W1)
    control_key = key(0, "@control")
    release, in_handler = threading.Event(), threading.Event()
    receives = {}

    def handle(sender, tensors):
        in_handler.set()
        release.wait(WAIT_S)

    def take(name, k, **kwargs):
        with receiving(W0) as receive:
            receives[name] = receive
            mailbox.take(k, W0, WAIT_S, **kwargs)

    threads = [threading.Thread(target=take, args=("stuck", key(5)),
                                kwargs={"control": (control_key, handle)}, daemon=True),
               threading.Thread(target=take, args=("waiting", key(6)), daemon=True)]
    for thread in threads:
        thread.start()
    mailbox.put(control_key, W0, [torch.zeros(1)])
    assert in_handler.wait(WAIT_S)
    deadline = time.monotonic() + WAIT_S
    while not receives["stuck"].is_stuck() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert receives["stuck"].is_stuck(), "a receive stuck in its handler counts as waiting"
    assert not receives["waiting"].is_stuck(), "a receive that waits counts as stuck"
    release.set()
    mailbox.put(key(5), W0, [torch.ones(1)])
    mailbox.put(key(6), W0, [torch.ones(1)])
    for thread in threads:
        thread.join(WAIT_S)
    assert not any(thread.is_alive() for thread in threads)
