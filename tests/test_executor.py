"""Executor and mailbox failure modes: deadlines, dead peers, bad messages."""

import pytest
import torch

from splitrun.runtime import (
    ChannelMismatch,
    Executor,
    LoopbackHub,
    Mailbox,
    MessageKey,
    MessageRejected,
    PeerFailed,
    RecvTimeout,
    SplitrunError,
    receive_contracts,
    run_threaded,
)
from splitrun.splitter import Cluster, Label, OpKind, split_program
from splitrun.splitter.synthetic import random_batches, random_program

W0, W1 = Label.worker(0), Label.worker(1)


@pytest.fixture
def two_worker_plan():
    cluster = Cluster(num_workers=2)
    program = random_program(30, cluster.labels(), seed=3, run_length=3.0)
    split_prog = split_program(program, cluster)
    assert any(c.dst == W1 for c in split_prog.plan.channels)
    return split_prog.plan, split_prog


@pytest.mark.timeout(60)
def test_receive_whose_peer_never_sends_names_channel_peer_and_step(two_worker_plan):
    plan, split_prog = two_worker_plan
    program = split_prog.program
    hub = LoopbackHub(plan.labels)
    executor = Executor(plan, split_prog.program, W1, hub.transport(W1), recv_timeout_s=0.3)
    executor.load_state(program.initial_state)
    first_recv = next(i.target for i in plan.process(W1).schedule if i.kind is OpKind.RECV)
    batch = random_batches(program, 1)[0]
    # The error names the 0.3 s deadline it expired on; a receive that ignored its
    # deadline would hang into this test's timeout instead.
    with pytest.raises(RecvTimeout, match=rf"\[worker 1\] receive on channel '{first_recv}' "
                                          r"step 0: no message from worker 0 within 0.3 s"):
        executor.run_step(0, batch)


@pytest.mark.timeout(60)
def test_a_failing_process_stops_the_others_with_its_name(two_worker_plan):
    plan, split_prog = two_worker_plan
    program = split_prog.program
    batches = random_batches(program, 3)

    def feeds(step):
        if step == 1:
            return {}  # the processes fed a batch fail at step 1; worker 1 waits on them
        return batches[step]

    # Receives wait up to an hour: the run can only end within this test's timeout if
    # the failure aborts the peers' receives, and it ends with the failure itself.
    with pytest.raises(SplitrunError, match=r"step 1: feed 'batch\.\d' is missing"):
        run_threaded(split_prog, 3, feeds, recv_timeout_s=3600)


def test_abort_wakes_a_waiting_receive_with_the_failure():
    mailbox = Mailbox(W1)
    mailbox.abort(PeerFailed("stopped because worker 0 failed: boom"))
    with pytest.raises(PeerFailed, match="worker 0 failed: boom"):
        mailbox.take(MessageKey(0, 0, "w0->w1#0"), W0, timeout_s=5)


def test_mailbox_refuses_stale_incarnation_and_duplicates():
    mailbox = Mailbox(W1, incarnation=2)
    with pytest.raises(MessageRejected, match=r"incarnation is 2; the sender is from a previous"):
        mailbox.put(MessageKey(1, 0, "w0->w1#0"), W0, [])
    key = MessageKey(2, 0, "w0->w1#0")
    mailbox.put(key, W0, [torch.zeros(1)])
    with pytest.raises(MessageRejected, match=r"second message"):
        mailbox.put(key, W0, [torch.zeros(1)])


def test_wrong_shape_in_a_message_is_rejected(two_worker_plan):
    plan, split_prog = two_worker_plan
    program = split_prog.program
    hub = LoopbackHub(plan.labels)
    hub.transport(W1).expect(receive_contracts(plan, program, W1))
    schedule = plan.process(W1).schedule
    first_recv = next(i.target for i in schedule if i.kind is OpKind.RECV)
    channel = plan.channel(first_recv)
    wrong = [torch.zeros(7, dtype=torch.float64) for _ in channel.values]
    with pytest.raises(ChannelMismatch, match=rf"\[worker 1\] refused channel '{first_recv}' "
                                              rf"step 0 from 'w0': tensor 0 expected "
                                              r"float32\[4\], got float64\[7\]"):
        hub.transport(channel.src).send(W1, MessageKey(0, 0, first_recv), wrong)
    assert hub.transport(W1).pending() == [], "a refused message never reaches the mailbox"
