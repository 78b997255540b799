"""The plan's text form round-trips; its DOT picture parses; lint catches
broken plans with a message naming the problem."""

import dataclasses

import pydot
import pytest
import torch
from models import TiedBigramLM, lm_loss, markov_batches

from splitrun.splitter import (
    Cluster,
    Instruction,
    Label,
    OpKind,
    PlanError,
    PlanParseError,
    capture,
    check_plan,
    optim,
    plan_from_text,
    plan_to_dot,
    plan_to_text,
    split,
    split_program,
)
from splitrun.splitter.testing import random_program


@pytest.fixture(scope="module")
def lm_plan():
    torch.manual_seed(0)
    program = capture(TiedBigramLM(num_workers=3), lm_loss, optim.SGD(lr=0.1, momentum=0.9),
                      markov_batches(1, batch=4)[0])
    done = split_program(program, Cluster(num_workers=3))
    return done.plan, done.program  # the program the plan's names refer to


def test_text_form_round_trips(lm_plan):
    plan, _ = lm_plan
    text = plan_to_text(plan)
    parsed = plan_from_text(text)
    assert parsed == plan
    assert plan_to_text(parsed) == text
    assert parsed.fingerprint == plan.fingerprint
    assert "sync embed.weight w0 -> w2" in text


def test_text_form_round_trips_random_plans():
    for seed in range(20):
        cluster = Cluster(num_workers=3, num_servers=1)
        plan = split(random_program(50, cluster.labels(), seed=seed, run_length=2.0), cluster)
        assert plan_from_text(plan_to_text(plan)) == plan


@pytest.mark.parametrize("text, match", [
    ("not a plan\n", r"line 1: expected 'splitrun-plan 1'"),
    ("splitrun-plan 1\nmode general\ncluster workers=1 servers=0\nbogus x\n",
     r"line 4: unknown line kind 'bogus'"),
    ("splitrun-plan 1\nmode general\ncluster workers=1 servers=0\nprocess q9\nend\n",
     r"line 4: .*malformed label 'q9'"),
    ("splitrun-plan 1\nmode general\ncluster workers=1 servers=0\nprocess w0\n",
     r"process w0 has no 'end' line"),
    ("splitrun-plan 1\nmode sideways\n", r"line 2: 'sideways' is not a valid ModeKind"),
])
def test_malformed_text_names_the_line(text, match):
    with pytest.raises(PlanParseError, match=match):
        plan_from_text(text)


def test_dot_is_valid_and_shows_processes_and_channels(lm_plan):
    plan, _ = lm_plan
    dot = plan_to_dot(plan)
    graphs = pydot.graph_from_dot_data(dot)
    assert graphs and len(graphs) == 1
    graph = graphs[0]
    clusters = {sub.get_name() for sub in graph.get_subgraphs()}
    assert clusters == {f"cluster_{label}" for label in plan.labels}
    labelled = [e for e in graph.get_edges() if e.get("label")]
    assert len(labelled) == len(plan.channels)
    assert all("/step" in e.get("label") for e in labelled)


def _replace_schedule(plan, label, schedule):
    processes = tuple(dataclasses.replace(p, schedule=tuple(schedule)) if p.label == label
                      else p for p in plan.processes)
    return dataclasses.replace(plan, processes=processes)


def test_lint_catches_a_missing_receive(lm_plan):
    plan, program = lm_plan
    w1 = Label.worker(1)
    schedule = [i for i in plan.process(w1).schedule if i.kind is not OpKind.RECV][:]
    with pytest.raises(PlanError, match=r"channel w0->w1#0 has 0 receives"):
        check_plan(_replace_schedule(plan, w1, schedule), program)


def test_lint_catches_a_deadlock(lm_plan):
    plan, program = lm_plan
    w0 = Label.worker(0)
    schedule = list(plan.process(w0).schedule)
    first_recv = next(i for i, ins in enumerate(schedule) if ins.kind is OpKind.RECV)
    # Wait for worker 1's message before sending worker 1 anything: a cycle.
    recv = schedule.pop(first_recv)
    schedule.insert(0, recv)
    with pytest.raises(PlanError, match=r"the schedules deadlock: worker 0 waits on"):
        check_plan(_replace_schedule(plan, w0, schedule))


def test_lint_catches_a_value_nobody_provides(lm_plan):
    plan, program = lm_plan
    w2 = Label.worker(2)
    schedule = list(plan.process(w2).schedule)
    first_run = next(i for i, ins in enumerate(schedule) if ins.kind is OpKind.RUN)
    dropped = schedule.pop(first_run)
    assert isinstance(dropped, Instruction)
    with pytest.raises(PlanError, match=rf"\[worker 2\] node .* reads {dropped.target}, "
                                        r"which worker 2 neither computes"):
        check_plan(_replace_schedule(plan, w2, schedule), program)
