"""Parallel mode's torch.distributed backend, piece by piece: each collective
on a gloo group (threads of this process, sockets on 127.0.0.1) against the
channel backend's own spelling of it; the group formed through a real
scheduler's key-value store; deadlines; and the errors for bad use.

The whole-model equivalence with both backends is in test_parallel_equivalence
and test_parallel_blocks (threads) and test_parallel_launch (the launcher).
"""

import threading

import pytest
import torch
from parallel_models import capture_mlp

from splitrun.runtime.cluster import Scheduler, SchedulerClient, SchedulerSettings
from splitrun.runtime.cluster.rendezvous import KV_PREFIX, InProcessRendezvous, SchedulerRendezvous
from splitrun.runtime.engine.collectives import ProcessGroupCollectives
from splitrun.runtime.errors import CollectiveFailed
from splitrun.splitter import (
    Cluster,
    CollectiveBackend,
    ParallelMode,
    PlanError,
    plan_from_text,
    plan_to_text,
    split_program,
)
from splitrun.splitter.labels import Label, Role
from splitrun.splitter.modes.parallel.layout import shard_of
from splitrun.splitter.modes.parallel.rewrite import fold_sum, gather_shards
from splitrun.splitter.ops import collectives as collective_ops

NUM = 4
# Bounds joining the members' threads: each collective has its own deadline
# (OP_TIMEOUT_S), forming the group RENDEZVOUS_TIMEOUT_S; this is far above both.
JOIN_TIMEOUT_S = 120.0
OP_TIMEOUT_S = 30.0
RENDEZVOUS_TIMEOUT_S = 30.0
TOKEN = "collectives-token"


def members(rendezvous, num=NUM, timeout_s=OP_TIMEOUT_S, name="group-w0"):
    return [ProcessGroupCollectives(Label.worker(j), name, 0, j, num, rendezvous,
                                    device=torch.device("cpu"), timeout_s=timeout_s)
            for j in range(num)]


def on_every_member(groups, work):
    """Run `work(j, group)` on one thread per member; the results in rank order."""
    results, errors = [None] * len(groups), []

    def run(j):
        try:
            results[j] = work(j, groups[j])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append((j, exc))

    threads = [threading.Thread(target=run, args=(j,), daemon=True) for j in range(len(groups))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN_TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), "a member did not finish"
    for group in groups:
        group.close()
    return results, errors


def test_each_collective_equals_the_channel_backends_spelling():
    gen = torch.Generator().manual_seed(0)
    pieces = [torch.randn(8, 12, generator=gen) for _ in range(NUM)]
    groups = members(InProcessRendezvous(RENDEZVOUS_TIMEOUT_S))

    def work(j, group):
        piece = pieces[j]
        before = piece.clone()
        out = {
            "all_reduce": group.all_reduce(piece, 0, NUM),
            "all_gather": group.all_gather(piece, 1, 0, NUM),
            "reduce_scatter": group.reduce_scatter(piece, 0, 0, NUM),
            "all_to_all": group.all_to_all(piece, 0, 1, 0, NUM),
            "stacked": group.all_gather_stacked(piece[:2], 0, NUM),
        }
        assert torch.equal(piece, before), "a collective must not change its input"
        return out

    results, errors = on_every_member(groups, work)
    assert not errors, errors
    total = fold_sum(*pieces)
    for j, got in enumerate(results):
        torch.testing.assert_close(got["all_reduce"], total, rtol=0, atol=1e-6)
        assert torch.equal(got["all_reduce"], results[0]["all_reduce"]), "replicas differ"
        assert torch.equal(got["all_gather"], gather_shards(1, *pieces))
        want = fold_sum(*[shard_of(p, 0, j, NUM) for p in pieces])
        torch.testing.assert_close(got["reduce_scatter"], want, rtol=0, atol=1e-6)
        want = gather_shards(0, *[shard_of(p, 1, j, NUM) for p in pieces])
        assert torch.equal(got["all_to_all"], want)
        assert torch.equal(got["stacked"], torch.stack([p[:2] for p in pieces]))
    assert all(g.stats.calls == 5 for g in groups)


def test_the_group_meets_through_the_schedulers_key_value_store():
    scheduler = Scheduler(SchedulerSettings(2, 0, TOKEN, 5, heartbeat_timeout_s=60))
    address = scheduler.start("127.0.0.1", 0)
    clients = [SchedulerClient(address, TOKEN) for _ in range(2)]
    try:
        groups = [ProcessGroupCollectives(
            Label.worker(j), "group-w0", 0, j, 2,
            SchedulerRendezvous(clients[j], 5, "127.0.0.1", RENDEZVOUS_TIMEOUT_S),
            device=torch.device("cpu"), timeout_s=OP_TIMEOUT_S) for j in range(2)]
        results, errors = on_every_member(
            groups, lambda j, g: g.all_reduce(torch.full((3,), float(j + 1)), 0, 2))
        assert not errors, errors
        assert all(torch.equal(r, torch.full((3,), 3.0)) for r in results)
        # the first member's store is served on its advertised host
        published = clients[1].kv_get(f"{KV_PREFIX}/5/group-w0", 5).decode()
        assert published.startswith("127.0.0.1:")
    finally:
        for client in clients:
            client.close()
        scheduler.stop(0)


def test_a_member_that_never_comes_fails_forming_the_group_within_its_deadline():
    (first, _) = members(InProcessRendezvous(timeout_s=1.0), num=2)
    with pytest.raises(CollectiveFailed, match=r"worker 0.* process group group-w0 "
                                               r"\(member 0 of 2\) failed within 1 s"):
        first.all_reduce(torch.ones(2), 0, 2)
    first.close()


def test_a_collective_one_member_skips_fails_within_its_deadline():
    groups = members(InProcessRendezvous(RENDEZVOUS_TIMEOUT_S), num=2, timeout_s=1.0)

    def work(j, group):
        group.all_reduce(torch.ones(2), 0, 2)  # forms the group
        if j == 0:
            group.all_reduce(torch.ones(2), 0, 2)  # member 1 never joins this one

    _, errors = on_every_member(groups, work)
    assert [j for j, _ in errors] == [0]
    assert isinstance(errors[0][1], CollectiveFailed)
    assert "all-reduce on gloo process group group-w0" in str(errors[0][1])


def test_a_collective_of_another_group_is_refused():
    (first,) = members(InProcessRendezvous(), num=1)
    with pytest.raises(Exception, match="parallel group 3 reached a member of group 0"):
        first.all_reduce(torch.ones(2), 3, 1)


def test_an_unbound_collective_says_how_to_run_it():
    with pytest.raises(collective_ops.CollectiveUnbound, match="backend='channels'"):
        collective_ops.all_reduce(torch.ones(2), 0, 2)


def test_an_unknown_backend_is_refused_with_the_choices():
    assert ParallelMode(backend="torch.distributed").backend is \
        CollectiveBackend.TORCH_DISTRIBUTED
    with pytest.raises(PlanError, match="unknown collective backend 'nccl'.*'channels', "
                                        "'torch_distributed'"):
        ParallelMode(backend="nccl")


def test_the_split_holds_collective_nodes_and_no_channels_inside_the_group():
    program = capture_mlp("adam")
    split = split_program(program, Cluster(num_workers=2),
                          ParallelMode(backend="torch_distributed"))
    split.lint()
    targets = [n.target for n in split.program.graph.nodes if n.op == "call_function"]
    assert targets.count(collective_ops.all_reduce) == 2  # one per member
    assert split.plan.bytes_per_step() == 0
    assert all(not c.values for c in split.plan.channels), "only the per-step trigger"
    assert split.artifacts.uses_process_groups
    assert [p.label for p in split.plan.processes] == [Label(0, Role.WORKER),
                                                        Label(1, Role.WORKER)]
    text = plan_to_text(split.plan)
    assert plan_from_text(text) == split.plan
    assert "addmm_1__all_reduce__w1" in text  # the collective is a node of each member
