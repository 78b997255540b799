"""Parallel mode over loopback: a group of workers equals one process.

Tolerance 1e-5 (absolute): a sharded matrix product sums its partial products
in another order than the whole one.
"""

import dataclasses

import pytest
import torch
from parallel_models import BATCH, OUT, capture_mlp, mlp_batches, train_both

from splitrun.runtime import run_threaded
from splitrun.splitter import (
    Cluster,
    ParallelMode,
    SplitProgram,
    collect_state_dict,
    member_key,
    plan_from_text,
    plan_to_dot,
    plan_to_text,
    relocate_state_dict,
    split_program,
)
from splitrun.splitter.modes.parallel import CollectiveKind, R, S

NUM_STEPS = 10
TOLERANCE = 1e-5


@pytest.mark.parametrize("backend", ["channels", "torch_distributed"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adam_chain"])
@pytest.mark.parametrize("num_workers", [2, 4])
def test_column_then_row_mlp_equals_the_unsplit_step(optimizer, num_workers, backend):
    # adam: each parameter's multi-tensor update runs on its shards; adam_chain:
    # the single-tensor chain's ops do.
    program = capture_mlp(optimizer)
    trained = train_both(program, num_workers, NUM_STEPS, mlp_batches(NUM_STEPS),
                         backend=backend)
    assert trained.full_state.keys() == trained.expected_state.keys()
    for key, value in trained.expected_state.items():
        torch.testing.assert_close(trained.full_state[key], value, rtol=0, atol=TOLERANCE)
    for got, want in zip(trained.run.history, trained.expected_history):
        torch.testing.assert_close(got["loss"], want["loss"], rtol=0, atol=TOLERANCE)
    moved = program.initial_state["l2.weight"]
    assert not torch.allclose(trained.full_state["l2.weight"], moved), "training must move weights"
    layout = trained.layout
    assert layout.state["l1.weight"] == S(0) and layout.state["l2.weight"] == S(1)
    assert layout.state["l2.weight.exp_avg" if optimizer != "sgd" else "l2.weight"] == S(1)
    # No parameter is gathered to be updated whole.
    gathered = [c.value for c in layout.collectives
                if c.kind is CollectiveKind.ALL_GATHER and not c.is_forward]
    assert not gathered, gathered


@pytest.mark.parametrize("num_workers", [2, 4])
def test_one_forward_all_reduce_and_predicted_bytes_equal_the_counters(num_workers):
    trained = train_both(capture_mlp("adam"), num_workers, NUM_STEPS, mlp_batches(NUM_STEPS))
    collectives = trained.layout.collectives
    assert len(collectives) == 1, collectives
    (reduce,) = collectives
    assert reduce.kind is CollectiveKind.ALL_REDUCE and reduce.is_forward
    floats = BATCH * OUT
    # reduce-scatter then all-gather: 2(N-1)/N of the value per rank
    assert reduce.nbytes == 2 * (num_workers - 1) * floats * 4
    sent = sum(stats.bytes_sent for stats in trained.run.stats.values())
    assert sent == NUM_STEPS * trained.layout.bytes_per_step
    assert sent == NUM_STEPS * trained.plan.bytes_per_step()
    per_rank = {label: stats.bytes_sent for label, stats in trained.run.stats.items()}
    assert set(per_rank.values()) == {NUM_STEPS * reduce.nbytes // num_workers}
    # At 2 ranks each member sends its whole partial sum once (the same bytes
    # as a reduce-scatter and an all-gather of halves, in half the messages);
    # beyond, reduce-scatter then all-gather: 2(N-1) messages a rank.
    messages = {stats.messages_sent for stats in trained.run.stats.values()}
    assert messages == {NUM_STEPS * (1 if num_workers == 2 else 2 * (num_workers - 1))}


@pytest.mark.parametrize("backend", ["channels", "torch_distributed"])
def test_replicated_state_is_bit_identical_across_ranks(backend):
    trained = train_both(capture_mlp("adam"), 4, NUM_STEPS, mlp_batches(NUM_STEPS),
                         backend=backend)
    layout = trained.layout
    replicated = [key for key, placement in layout.state.items() if placement == R]
    assert "l2.bias" in replicated
    for key in replicated:
        pieces = [trained.run.held[m][member_key(key, m)] for m in layout.members]
        for piece in pieces[1:]:
            assert torch.equal(piece, pieces[0]), key


def test_relocate_then_collect_is_the_identity():
    program = capture_mlp("adam")
    layout = split_program(program, Cluster(num_workers=4), ParallelMode()).artifacts
    full = {k: torch.randn_like(v) for k, v in program.initial_state.items()}
    pieces = relocate_state_dict(layout, full)
    assert pieces[member_key("l1.weight", layout.members[1])].shape[0] == 16 // 4
    back = collect_state_dict(layout, pieces)
    assert back.keys() == full.keys()
    for key in full:
        assert torch.equal(back[key], full[key]), key


def test_save_at_four_ranks_resume_at_two_equals_unsplit_training():
    program = capture_mlp("adam")
    batches = mlp_batches(NUM_STEPS)
    first_half = 5
    four = split_program(program, Cluster(num_workers=4), ParallelMode())
    run4 = run_threaded(four, first_half, batches, recv_timeout_s=30)
    checkpoint = collect_state_dict(four.artifacts, run4.state)  # a plain full state_dict

    two = split_program(program, Cluster(num_workers=2), ParallelMode())
    resumed = relocate_state_dict(two.artifacts, checkpoint)
    # The second half: its batches, and hyperparameters at its step counts.
    hparams = two.program.hparams_fn
    later = SplitProgram(two.plan, dataclasses.replace(
        two.program, hparams_fn=lambda step: hparams(step + first_half)), two.artifacts)
    run2 = run_threaded(later, NUM_STEPS - first_half, lambda s: batches(s + first_half),
                        state=resumed, recv_timeout_s=30)
    _, expected = program.train_unsplit(NUM_STEPS, batches)
    final = collect_state_dict(two.artifacts, run2.state)
    for key, value in expected.items():
        torch.testing.assert_close(final[key], value, rtol=0, atol=TOLERANCE)


def test_plan_lints_and_its_text_form_round_trips():
    program = capture_mlp("sgd")
    split = split_program(program, Cluster(num_workers=2), ParallelMode())
    split.lint()
    plan = split.plan
    assert plan == split_program(program, Cluster(num_workers=2), ParallelMode()).plan
    text = plan_to_text(plan)
    back = plan_from_text(text)
    assert back == plan and plan_to_text(back) == text
    assert "group w0 w1" in text
    assert "shard l2.weight S(1) w0" in text
    assert f"collective all-reduce addmm_1 P->R {2 * BATCH * OUT * 4}" in text
    explained = plan.explain()
    assert "l1.weight: S(0) on group w0" in explained
    assert "addmm_1: P -> R all-reduce" in explained
    dot = plan_to_dot(plan)
    assert "cluster_group_w0" in dot
    assert "addmm_1: P→R all-reduce 256 B" in dot


def test_layout_explains_every_node_with_its_alternatives():
    layout = split_program(capture_mlp("sgd"), Cluster(num_workers=2), ParallelMode()).artifacts
    text = layout.explain()
    assert "addmm_1: (P, S(1), S(0)) -> P" in text and "alternatives:" in text
    assert "collectives per step:" in text
