"""Parameter-server mode over loopback: W workers on their shards equal one
process on the whole global batch.

Tolerance 1e-5 (absolute): the mean of W shard gradients sums in another order
than one full-batch gradient.
"""

import pytest
import torch
from ps_models import feeds, make
from torch import nn

from splitrun.runtime import run_threaded
from splitrun.runtime.job.data import shard_batch
from splitrun.splitter import (
    Cluster,
    Label,
    OpKind,
    ParameterServerMode,
    PlanError,
    SplitrunError,
    capture,
    optim,
    place,
    plan_from_text,
    plan_to_text,
    region,
    split_program,
)
from splitrun.splitter.labels import MODULE_ANNOTATION
from splitrun.splitter.modes.parameter_server import assign_servers, gradient_slot

NUM_STEPS = 20
TOLERANCE = 1e-5


def train_both(kind, optimizer, num_workers, num_servers, num_steps=NUM_STEPS):
    program, batches = make(kind, optimizer, num_workers, num_steps)
    full, _ = make(kind, optimizer, 1, num_steps)  # the whole batch
    split_prog = split_program(program, Cluster(num_workers, num_servers),
                               ParameterServerMode())
    split_prog.lint()
    run = run_threaded(split_prog, num_steps, feeds(batches), recv_timeout_s=30)
    _, expected = full.train_unsplit(num_steps, feeds(batches))
    return split_prog, run, expected, program


@pytest.mark.parametrize("optimizer", ["sgd_momentum", "adam", "adagrad"])
@pytest.mark.parametrize("num_workers, num_servers", [(2, 1), (2, 2)])
def test_dense_equals_single_process_on_the_global_batch(optimizer, num_workers, num_servers):
    _, run, expected, program = train_both("dense", optimizer, num_workers, num_servers)
    assert run.state.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(run.state[key], value, rtol=0, atol=TOLERANCE)
    moved = program.initial_state["body.0.weight"]
    assert not torch.allclose(run.state["body.0.weight"], moved), "training must move weights"


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_sparse_embedding_through_the_sparse_path(optimizer):
    split_prog, run, expected, program = train_both("sparse", optimizer, 2, 2)
    update_targets = {n.target.__name__ for n in split_prog.program.graph.nodes
                      if n.op == "call_function" and hasattr(n.target, "__name__")}
    assert f"sparse_{optimizer}" in update_targets, "the table must get a row-wise update"
    assert any(n.target is torch.ops.aten.cat.default for n in split_prog.program.graph.nodes)
    for key, value in expected.items():
        torch.testing.assert_close(run.state[key], value, rtol=0, atol=TOLERANCE)


def test_one_worker_needs_no_accumulation():
    split_prog, run, expected, _ = train_both("dense", "adam", 1, 2)
    assert not any(n.target is gradient_slot for n in split_prog.program.graph.nodes)
    for key, value in expected.items():
        torch.testing.assert_close(run.state[key], value, rtol=0, atol=TOLERANCE)


def test_server_has_a_slot_per_worker_and_an_accumulation_per_gradient():
    num_workers, num_servers = 3, 2
    program, _ = make("dense", "adam", num_workers, 1)
    split_prog = split_program(program, Cluster(num_workers, num_servers),
                               ParameterServerMode())
    plan, servers = split_prog.plan, split_prog.artifacts
    owner = servers.owner
    nodes = {n.name: n for n in split_prog.program.graph.nodes}
    for rank in range(num_servers):
        server = plan.process(Label.server(rank))
        params = [p for p, s in owner.items() if s == rank]
        assert params, "both servers hold parameters"
        receives = [i.target for i in server.schedule if i.kind is OpKind.RECV]
        assert receives == [f"w{r}->s{rank}#0" for r in range(num_workers)]
        for param in params:
            grad = program.grads[param]
            slots = servers.slots[grad]
            assert len(slots) == num_workers
            for worker, slot in enumerate(slots):
                channel = plan.channel(f"w{worker}->s{rank}#0")
                assert channel.recv_names[channel.values.index(grad)] == slot
            means = [n for n in nodes.values()
                     if (n.meta.get("custom") or {}).get(MODULE_ANNOTATION) == f"accumulate.{param}"
                     and n.target is torch.ops.aten.div.Tensor]
            assert len(means) == 1 and means[0].args[1] == num_workers
    assert plan_from_text(plan_to_text(plan)) == plan


def test_one_message_per_worker_server_pair_per_direction_per_step():
    num_workers, num_servers, steps = 2, 2, 3
    split_prog, run, _, _ = train_both("dense", "sgd_momentum", num_workers, num_servers, steps)
    plan = split_prog.plan
    assert plan.messages_per_step() == 2 * num_workers * num_servers
    for worker in range(num_workers):
        stats = run.stats[Label.worker(worker)]
        for server in range(num_servers):
            assert stats.sent[f"w{worker}->s{server}#0"].messages == steps
            assert stats.received[f"s{server}->w{worker}#0"].messages == steps
        assert stats.messages_sent == steps * num_servers
    # The learning rate and step count come from worker 0 only.
    assert "lr" in plan.channel("w0->s0#0").values
    assert "lr" not in plan.channel("w1->s0#0").values


def test_parameters_are_balanced_by_bytes_or_pinned():
    sizes = {"a": 400, "b": 300, "c": 200, "d": 100, "e": 100}
    owner = assign_servers(sizes, {}, 2)
    loads = [sum(sizes[p] for p, s in owner.items() if s == k) for k in range(2)]
    assert sorted(loads) == [500, 600]
    assert assign_servers(sizes, {}, 2) == owner  # deterministic
    assert assign_servers(sizes, {"e": 1}, 2)["e"] == 1

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    place(model[1], role="server", rank=1)
    program = capture(model, lambda m, x: m(x).sum(), optim.SGD(lr=0.1), torch.randn(2, 4))
    split_prog = split_program(program, Cluster(1, 2), ParameterServerMode())
    assert split_prog.artifacts.owner["1.weight"] == 1
    assert "1.weight" in split_prog.plan.process(Label.server(1)).state


def test_bad_parameter_server_setups_name_the_problem():
    program, _ = make("dense", "adam", 2, 1)
    with pytest.raises(PlanError, match=r"needs at least one server; launch with --servers"):
        split_program(program, Cluster(2, 0), ParameterServerMode())

    torch.manual_seed(0)
    model = nn.Linear(4, 2)

    def loss_on_worker_1(m, x):
        with region(rank=1):
            return m(x).sum()
    program = capture(model, loss_on_worker_1, optim.SGD(lr=0.1), torch.randn(2, 4))
    with pytest.raises(PlanError, match=r"placed on worker 1: in parameter-server mode every "
                                        r"worker runs the same worker subgraph"):
        split_program(program, Cluster(2, 1), ParameterServerMode())

    place(model, role="server", rank=3)
    program = capture(model, lambda m, x: m(x).sum(), optim.SGD(lr=0.1), torch.randn(2, 4))
    with pytest.raises(PlanError, match=r"parameter 'weight' is placed on server 3, but the "
                                        r"cluster has 2 servers"):
        split_program(program, Cluster(2, 2), ParameterServerMode())

    with pytest.raises(SplitrunError, match=r"has 5 rows, which 2 workers cannot share evenly"):
        shard_batch((torch.zeros(5, 3),), 0, 2)


@pytest.mark.parametrize("kind, optimizer, num_workers, num_servers", [
    ("dense", "sgd_momentum", 2, 2), ("dense", "adam", 2, 2), ("sparse", "adagrad", 2, 2),
    ("dense", "adam", 1, 1), ("sparse", "sgd", 1, 1)])
def test_gradient_buckets_overlap_the_update_and_train_exactly_as_one_message(
        kind, optimizer, num_workers, num_servers):
    steps = 4
    program, batches = make(kind, optimizer, num_workers, steps)
    cluster = Cluster(num_workers, num_servers)
    whole = split_program(program, cluster, ParameterServerMode())
    bucketed = split_program(program, cluster, ParameterServerMode(gradient_bucket_bytes=1))
    bucketed.lint()
    plan = bucketed.plan
    overlapped = 0
    for server in range(num_servers):
        schedule = plan.process(Label.server(server)).schedule
        receives = [index for index, i in enumerate(schedule) if i.kind is OpKind.RECV]
        # Several gradient messages from each worker, and updates between them:
        # the server works while the workers are still in their backward.
        overlapped += len(receives) > num_workers and any(
            i.kind is OpKind.RUN for i in schedule[receives[0]:receives[-1]])
    assert overlapped
    assert plan.messages_per_step() > whole.plan.messages_per_step()
    # The learning rate still comes from worker 0 only, riding a gradient bucket.
    lr_channels = [c for c in plan.channels if "lr" in c.values]
    assert lr_channels and all(c.src == Label.worker(0) for c in lr_channels)
    # Same ops in another order: the same numbers, bit for bit.
    runs = [run_threaded(split, steps, feeds(batches), recv_timeout_s=30)
            for split in (whole, bucketed)]
    assert runs[0].state.keys() == runs[1].state.keys()
    for key, value in runs[0].state.items():
        assert torch.equal(runs[1].state[key], value), key


def test_a_bucket_size_is_positive_bytes_or_none():
    with pytest.raises(PlanError, match="gradient_bucket_bytes=0: give a positive number"):
        ParameterServerMode(gradient_bucket_bytes=0)
