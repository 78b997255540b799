"""Fusion groups edges into few messages; control edges trigger idle-fed
processes; the executor's counters show it."""

import torch
from models import TiedBigramLM, lm_loss, markov_batches
from torch import fx

from splitrun.runtime import run_threaded
from splitrun.splitter import (
    ChannelKind,
    Cluster,
    InputKind,
    InputSpec,
    Label,
    OpKind,
    OutputKind,
    OutputSpec,
    Program,
    capture,
    check_plan,
    optim,
    split_program,
)
from splitrun.splitter.program import set_node_annotation

NUM_STEPS = 4


def test_channels_carry_several_tensors_and_messages_match_channels():
    torch.manual_seed(0)
    data = markov_batches(NUM_STEPS, batch=8)
    program = capture(TiedBigramLM(num_workers=3), lm_loss, optim.Adam(lr=0.01), data[0])
    split_prog = split_program(program, Cluster(num_workers=3))
    plan = split_prog.plan
    values_crossing = sum(len(c.values) for c in plan.channels)
    assert any(len(c.values) >= 3 for c in plan.channels)
    assert len(plan.channels) < values_crossing, "fusion must put several tensors in a message"

    run = run_threaded(split_prog, NUM_STEPS,
                       lambda s: {"batch.0": data[s][0], "batch.1": data[s][1]})
    sent = sum(stats.messages_sent for stats in run.stats.values())
    assert sent == NUM_STEPS * len(plan.channels)
    received = sum(c.messages for stats in run.stats.values() for c in stats.received.values())
    assert received == sent
    # lr and step count ride an existing message instead of their own.
    carrying_lr = [c for c in plan.channels if "lr" in c.values]
    assert carrying_lr and all(len(c.values) > 2 for c in carrying_lr)


def _producer_only_program():
    """Worker 1 computes from its own state and sends to worker 0; nothing
    flows into worker 1, so it needs a per-step control edge."""
    graph = fx.Graph()
    x = graph.placeholder("in_0")
    w = graph.placeholder("state_w")
    aten = torch.ops.aten
    scaled = graph.call_function(aten.mul.Tensor, (w, 2.0))
    set_node_annotation(scaled, "w1")
    new_w = graph.call_function(aten.add.Tensor, (w, 1.0))
    set_node_annotation(new_w, "w1")
    out = graph.call_function(aten.add.Tensor, (x, scaled))
    loss = graph.call_function(aten.sum.default, (out,))
    graph.output((loss, new_w))
    for node in graph.nodes:
        if node.op != "output":
            node.meta["val"] = torch.empty(() if node is loss else (3,), device="meta")
    program = Program(
        fx.GraphModule(torch.nn.Module(), graph),
        (InputSpec("in_0", InputKind.BATCH, "batch.0"),
         InputSpec("state_w", InputKind.PARAM, "w")),
        (OutputSpec(loss.name, OutputKind.LOSS, "loss"),
         OutputSpec(new_w.name, OutputKind.STATE, "w")),
        {"w": torch.zeros(3)})
    return program


def test_process_without_inbound_data_gets_a_control_edge():
    program = _producer_only_program()
    split_prog = split_program(program, Cluster(num_workers=2))
    plan = split_prog.plan
    check_plan(plan, program)
    control = [c for c in plan.channels if c.kind is ChannelKind.CONTROL]
    assert [(str(e.src), str(e.dst)) for e in control] == [("w0", "w1")]
    assert plan.channel(control[0].name).kind is ChannelKind.CONTROL
    assert plan.channel(control[0].name).values == ()
    # The trigger is the first thing worker 1 waits for each step.
    assert str(plan.process(Label.worker(1)).schedule[0]) == f"recv {control[0].name}"

    batches = [{"batch.0": torch.full((3,), float(s))} for s in range(NUM_STEPS)]
    expected, state = program.train_unsplit(NUM_STEPS, batches.__getitem__)
    run = run_threaded(split_prog, NUM_STEPS, batches.__getitem__, recv_timeout_s=10)
    assert [h["loss"] for h in run.history] == [h["loss"] for h in expected]
    assert torch.equal(run.state["w"], state["w"])
    assert run.stats[Label.worker(1)].received[control[0].name].messages == NUM_STEPS


def _server_feeding_server_program():
    """Server 1 computes from its state and sends to server 0 before it receives
    anything; server 0 updates its state from that. (Found by the property test:
    without a trigger, server 1 started the step after the workers' last on its
    own, and server 0 ran it too.)"""
    graph = fx.Graph()
    x = graph.placeholder("in_0")
    a = graph.placeholder("state_a")
    b = graph.placeholder("state_b")
    aten = torch.ops.aten
    nodes = {}

    def op(name, target, args, label):
        node = graph.call_function(target, args)
        set_node_annotation(node, label)
        nodes[name] = node
        return node

    scaled = op("scaled", aten.mul.Tensor, (a, 2.0), "s1")
    new_b = op("new_b", aten.add.Tensor, (b, scaled), "s0")
    y = op("y", aten.mul.Tensor, (x, 3.0), "w0")
    z = op("z", aten.add.Tensor, (y, scaled), "s1")
    new_a = op("new_a", aten.add.Tensor, (a, 1.0), "s1")
    loss = op("loss", aten.sum.default, (z,), "w0")
    graph.output((loss, new_a, new_b))
    for node in graph.nodes:
        if node.op != "output":
            node.meta["val"] = torch.empty(() if node is loss else (3,), device="meta")
    return Program(
        fx.GraphModule(torch.nn.Module(), graph),
        (InputSpec("in_0", InputKind.BATCH, "batch.0"),
         InputSpec("state_a", InputKind.PARAM, "a"),
         InputSpec("state_b", InputKind.PARAM, "b")),
        (OutputSpec(loss.name, OutputKind.LOSS, "loss"),
         OutputSpec(new_a.name, OutputKind.STATE, "a"),
         OutputSpec(new_b.name, OutputKind.STATE, "b")),
        {"a": torch.ones(3), "b": torch.zeros(3)})


def test_a_server_that_sends_to_a_server_before_receiving_waits_for_a_trigger():
    program = _server_feeding_server_program()
    split_prog = split_program(program, Cluster(num_workers=1, num_servers=2))
    plan = split_prog.plan
    check_plan(plan, program)
    first = plan.process(Label.server(1)).schedule[0]
    assert first.kind is OpKind.RECV
    assert plan.channel(first.target).kind is ChannelKind.CONTROL
    assert plan.channel(first.target).src == Label.worker(0)

    batches = [{"batch.0": torch.full((3,), float(s))} for s in range(NUM_STEPS)]
    expected, state = program.train_unsplit(NUM_STEPS, batches.__getitem__)
    run = run_threaded(split_prog, NUM_STEPS, batches.__getitem__, recv_timeout_s=10)
    assert [h["loss"] for h in run.history] == [h["loss"] for h in expected]
    assert torch.equal(run.state["b"], state["b"]), "server 0 ran a step the workers never ran"
    assert run.stats[Label.server(0)].steps == NUM_STEPS
