"""Executor and mailbox failure modes: deadlines, dead peers, bad messages."""

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

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
from splitrun.splitter import (
    Cluster,
    Label,
    OpKind,
    capture,
    optim,
    place,
    region,
    split_program,
)
from splitrun.splitter.program import InputKind
from splitrun.splitter.testing import random_batches, random_program

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


def test_finishing_drops_plan_messages_no_step_will_take():
    mailbox = Mailbox(W1)
    kept, dropped = MessageKey(0, 2, "w0->w1#0"), MessageKey(0, 3, "w0->w1#0")
    final_state = MessageKey(0, 3, "@state")  # outside the plan: still taken later
    for key in (kept, dropped, final_state):
        mailbox.put(key, W0, [torch.ones(2)])
    mailbox.finish_at(3)
    assert mailbox.pending() == [kept, final_state]


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


class LendingTransport:
    """A loopback transport that says every tensor it received is lent (as the
    shared-memory transport says of payloads it views in its ring)."""

    def __init__(self, inner):
        self.inner = inner
        self.label = inner.label
        self.received: list[torch.Tensor] = []
        self.asked_of_received = 0

    def recv(self, *args, **kwargs):
        tensors = self.inner.recv(*args, **kwargs)
        self.received += tensors
        return tensors

    def is_lent(self, tensor):
        lent = any(tensor.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
                   for t in self.received)
        self.asked_of_received += lent
        return lent

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.timeout(60)
def test_outputs_and_state_that_view_lent_memory_are_copied_at_the_steps_end():
    # The loss is computed on worker 1 and delivered to worker 0: there it is
    # a received value that outlives the step.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3))
    place(net[1], rank=1)

    def loss_fn(model, x, y):
        out = model(x)
        with region(rank=1):
            return F.cross_entropy(out, y)
    batch = (torch.randn(5, 4), torch.randint(0, 3, (5,)))
    cluster = Cluster(num_workers=2)
    split_prog = split_program(capture(net, loss_fn, optim.SGD(lr=0.1), batch), cluster)
    plan, program = split_prog.plan, split_prog.program
    hub = LoopbackHub(plan.labels)
    transports = {label: LendingTransport(hub.transport(label)) for label in plan.labels}
    executors = {label: Executor(plan, program, label, transports[label])
                 for label in plan.labels}
    for label, executor in executors.items():
        executor.load_state(program.initial_state)
        hub.transport(label).expect(receive_contracts(plan, program, label))
    batch_keys = [spec.key for spec in program.inputs if spec.kind is InputKind.BATCH]
    feeds = {**program.hparams(0), **dict(zip(batch_keys, batch))}
    outputs, errors = {}, []

    def run(label):
        try:
            outputs[label] = executors[label].run_step(0, feeds)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
    threads = [threading.Thread(target=run, args=(label,)) for label in plan.labels]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors
    w0 = transports[W0]
    assert w0.asked_of_received == 1, "the loss should have been received, then copied"
    (loss,) = outputs[W0].values()
    assert not w0.is_lent(loss) and loss.shape == ()
