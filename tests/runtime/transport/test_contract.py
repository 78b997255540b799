"""Receive contracts: one check for every transport, each refusal naming the
receiver, channel, step and sender, expected vs got; the loopback transport
checks them as the gRPC transport does."""

import re

import pytest
import torch

from splitrun.runtime import (
    ChannelMismatch,
    MessageKey,
    MessageRejected,
    TransportError,
    UnknownChannel,
    WrongSender,
    run_threaded,
)
from splitrun.runtime.transport import (
    ChannelContract,
    LoopbackHub,
    ReceiveContracts,
    check_message,
    find_contract,
    receive_contracts,
)
from splitrun.runtime.transport.dtypes import TensorSpec
from splitrun.splitter import Cluster, Label, OpKind, split_program
from splitrun.splitter.testing import random_batches, random_program

W0, W1, W2 = Label.worker(0), Label.worker(1), Label.worker(2)
KEY = MessageKey(7, 3, "w0->w1#0")
FLOAT_2x3 = ChannelContract(W0, ((torch.float32, (2, 3)),))
PREFIX = r"\[worker 1\] refused channel 'w0->w1#0' step 3 from 'w0'"


def check(contract, tensors, src=W0, **kwargs):
    check_message(contract, KEY, src, tensors, receiver=W1, **kwargs)


# -- check_message ------------------------------------------------------------------------


def test_a_message_that_meets_its_contract_passes_as_tensors_or_specs():
    check(FLOAT_2x3, [torch.zeros(2, 3)])
    check(FLOAT_2x3, [TensorSpec(torch.float32, (2, 3))])


def test_the_wrong_sender_is_refused():
    with pytest.raises(WrongSender, match=PREFIX.replace("'w0'", "'w2'") +
                       r": this channel comes from worker 0, the envelope says worker 2$"):
        check(FLOAT_2x3, [torch.zeros(2, 3)], src=W2)


def test_another_number_of_tensors_is_refused():
    with pytest.raises(ChannelMismatch, match=PREFIX + r": expected 1 tensors, got 2; the "
                                                       r"sender's plan differs from this one"):
        check(FLOAT_2x3, [torch.zeros(2, 3), torch.zeros(2, 3)])


@pytest.mark.parametrize("tensor, got", [(torch.zeros(2, 3, dtype=torch.float64), "float64[2, 3]"),
                                         (torch.zeros(3, 2), "float32[3, 2]"),
                                         (torch.zeros(()), "float32[]")])
def test_another_dtype_or_shape_is_refused(tensor, got):
    with pytest.raises(ChannelMismatch, match=PREFIX + r": tensor 0 expected float32\[2, 3\], "
                                                       rf"got {re.escape(got)}; the sender's step "
                                                       r"differs from the plan"):
        check(FLOAT_2x3, [tensor])


def test_the_peer_a_message_came_through_is_named():
    with pytest.raises(ChannelMismatch, match=PREFIX + r" \(ipv4:127.0.0.1:5\): tensor 0"):
        check(FLOAT_2x3, [torch.zeros(1)], via="ipv4:127.0.0.1:5")


def test_open_entries_and_dynamic_channels_take_any_tensor_but_check_the_sender():
    some_open = ChannelContract(W0, (None, (torch.int64, (2,))))
    check(some_open, [torch.zeros(9, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.int64)])
    with pytest.raises(ChannelMismatch, match=r"tensor 1 expected int64\[2\], got int64\[3\]"):
        check(some_open, [torch.zeros(9), torch.zeros(3, dtype=torch.int64)])
    dynamic = ChannelContract(W0, None)
    check(dynamic, [])
    check(dynamic, [torch.zeros(5), torch.ones(2, 2, dtype=torch.int8)])
    with pytest.raises(WrongSender, match="this channel comes from worker 0"):
        check(dynamic, [], src=W2)


def test_contract_errors_are_message_rejections():
    assert issubclass(WrongSender, ChannelMismatch) and issubclass(UnknownChannel, ChannelMismatch)
    assert issubclass(ChannelMismatch, MessageRejected)


def test_shapes_given_as_any_sequence_compare_as_tuples_of_ints():
    contract = ChannelContract(W0, ((torch.float32, [2, torch.tensor(3).item()]),))
    assert contract == FLOAT_2x3 and contract.tensors == (TensorSpec(torch.float32, (2, 3)),)
    assert contract.is_static and not ChannelContract(W0, (None,)).is_static


# -- the table of one process's contracts --------------------------------------------------


def test_an_unknown_channel_is_refused_naming_the_known_ones():
    table = {"w0->w1#0": FLOAT_2x3, "open": ChannelContract(W0, None)}
    assert find_contract(table, KEY, "w0", receiver=W1) is FLOAT_2x3
    with pytest.raises(UnknownChannel, match=r"\[worker 1\] refused channel 'w0->w1#9' step 3 "
                                             r"from 'w0': no such channel into this process "
                                             r"\(it receives open, w0->w1#0\); the sender's "
                                             r"plan differs"):
        find_contract(table, MessageKey(7, 3, "w0->w1#9"), "w0", receiver=W1)


def test_registered_contracts_join_the_plans_once_it_is_expected():
    contracts = ReceiveContracts()
    control = {"@ctl": ChannelContract(W0, ((torch.int64, ()),))}
    contracts.register(control)
    assert contracts.table is None, "no message is taken before the plan's contracts"
    assert contracts.wait(0.01) is None
    contracts.expect({"w0->w1#0": FLOAT_2x3})
    assert dict(contracts.wait(0.01)) == {**control, "w0->w1#0": FLOAT_2x3}
    contracts.register(control)  # the same contract again: nothing changes
    with pytest.raises(TransportError, match=r"channel '@ctl' is registered twice with "
                                             r"different contracts"):
        contracts.register({"@ctl": ChannelContract(W2, ((torch.int64, ()),))})
    with pytest.raises(TransportError, match=r"channel 'w0->w1#0' is registered twice"):
        contracts.register({"w0->w1#0": ChannelContract(W0, None)})


# -- the loopback transport checks them too -------------------------------------------------


def test_loopback_refuses_a_mismatch_in_the_sender_and_keeps_it_out_of_the_mailbox():
    hub = LoopbackHub([W0, W1], incarnation=7)
    hub.transport(W1).expect({"w0->w1#0": FLOAT_2x3})
    sender = hub.transport(W0)
    with pytest.raises(ChannelMismatch, match=PREFIX + r": tensor 0 expected float32\[2, 3\], "
                                                       r"got float64\[2, 3\]"):
        sender.send(W1, KEY, [torch.zeros(2, 3, dtype=torch.float64)])
    with pytest.raises(UnknownChannel, match=r"refused channel 'w0->w1#5' step 3 from 'w0': "
                                             r"no such channel"):
        sender.send(W1, MessageKey(7, 3, "w0->w1#5"), [torch.zeros(2, 3)])
    with pytest.raises(WrongSender, match=r"comes from worker 0, the envelope says worker 2"):
        hub.transport(W2).send(W1, KEY, [torch.zeros(2, 3)])
    assert hub.transport(W1).pending() == []
    sender.send(W1, KEY, [torch.ones(2, 3)])
    assert hub.transport(W1).pending() == [KEY]


def test_loopback_without_contracts_checks_nothing():
    hub = LoopbackHub([W0, W1], incarnation=7)
    hub.transport(W0).send(W1, KEY, [torch.zeros(5, dtype=torch.int8)])
    assert hub.transport(W1).pending() == [KEY]


def test_run_threaded_refuses_a_batch_of_another_dtype_than_the_plans():
    program = random_program(30, [W0, W1], seed=3, run_length=3.0, shape=(4,))
    split = split_program(program, Cluster(num_workers=2))
    batches = random_batches(program, 2)
    run_threaded(split, 2, lambda step: batches[step])  # the captured shapes: fine
    doubles = {name: value.double() for name, value in batches[0].items()}
    with pytest.raises(ChannelMismatch, match=r"refused channel '\w+->\w+#\d+' step 0 from "
                                              r"'w\d': tensor \d+ expected float32\[4\], got "
                                              r"float64\[4\]"):
        run_threaded(split, 1, lambda step: doubles)


def test_each_plan_channel_knows_what_its_sender_still_sends_in_the_step():
    cluster = Cluster(num_workers=3)
    split_prog = split_program(random_program(40, cluster.labels(), seed=5, run_length=2.0),
                               cluster)
    plan = split_prog.plan
    checked = 0
    for label in cluster.labels():
        received = [plan.channel(i.target) for i in plan.process(label).schedule
                    if i.kind is OpKind.RECV]
        contracts = receive_contracts(plan, split_prog.program, label)
        for index, channel in enumerate(received):
            later = [c for c in received[index + 1:] if c.src == channel.src]
            expected = sum(spec.nbytes for c in later for spec in contracts[c.name].tensors)
            assert contracts[channel.name].later_bytes == expected, channel.name
            checked += bool(later)
    assert checked, "no process receives twice from one sender: the test proves nothing"
    # Outside the plan nothing is lent.
    assert not ChannelContract(W0, None).lendable
