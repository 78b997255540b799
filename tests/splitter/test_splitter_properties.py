"""Property tests on random DAGs with random labellings (hypothesis)."""

from collections import Counter

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitrun.runtime import run_threaded
from splitrun.splitter import Cluster, OpKind, check_plan, plan_to_text, split, split_program
from splitrun.splitter.testing import random_batches, random_program

NUM_STEPS = 3
# A receive in these tiny graphs waits microseconds; 10 s only bounds a deadlock.
RECV_TIMEOUT_S = 10.0

clusters = st.builds(Cluster, num_workers=st.integers(1, 4), num_servers=st.integers(0, 2))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cluster=clusters, seed=st.integers(0, 2**31 - 1), num_nodes=st.integers(1, 60),
       run_length=st.sampled_from([1.0, 2.5, 8.0]), num_state=st.integers(0, 3))
def test_random_split_computes_what_the_graph_computes(cluster, seed, num_nodes, run_length,
                                                       num_state):
    program = random_program(num_nodes, cluster.labels(), seed=seed, run_length=run_length,
                             num_state=num_state)
    split_prog = split_program(program, cluster)
    plan = split_prog.plan
    check_plan(plan, program)

    # Every send is matched by exactly one receive of the same tensor list.
    sends, recvs = Counter(), Counter()
    for proc in plan.processes:
        for instr in proc.schedule:
            if instr.kind is OpKind.SEND:
                sends[instr.target] += 1
                assert plan.channel(instr.target).src == proc.label
            elif instr.kind is OpKind.RECV:
                recvs[instr.target] += 1
                assert plan.channel(instr.target).dst == proc.label
    assert sends == recvs == Counter({c.name: 1 for c in plan.channels})

    # Two processes building the program independently compute the same plan.
    twin = random_program(num_nodes, cluster.labels(), seed=seed, run_length=run_length,
                          num_state=num_state)
    again = split(twin, cluster)
    assert again == plan
    assert plan_to_text(again) == plan_to_text(plan)

    # The split run finishes (no deadlock) and equals the unsplit run exactly.
    batches = random_batches(program, NUM_STEPS, seed=seed)
    expected_history, expected_state = program.train_unsplit(NUM_STEPS, batches.__getitem__)
    run = run_threaded(split_prog, NUM_STEPS, batches.__getitem__, recv_timeout_s=RECV_TIMEOUT_S)
    for step in range(NUM_STEPS):
        assert run.history[step].keys() == expected_history[step].keys()
        for key, value in expected_history[step].items():
            assert torch.equal(run.history[step][key], value)
    for key, value in expected_state.items():
        assert torch.equal(run.state[key], value)
