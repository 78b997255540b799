"""Micro-batched general mode: the step cut into M micro-batches that flow
through the stages on a schedule (GPipe, 1F1B), gradients summed, the
optimizer once per step; in threads (each stage its own process, through the
real launcher: tests/e2e/test_pipeline_schedules_e2e.py).

Tolerance: the micro-batched step sums each gradient over micro-batches (and
scales a mean loss's by 1/M) where the unsplit step sums over the whole batch
at once, so the float rounding differs: losses, gradients and parameters are
compared with `torch.testing.assert_close` at rtol = atol = 1e-5 after every
one of 6 steps (float32; the differences seen are ~1e-7).
"""

import pytest
import torch
import torch.nn.functional as F
from models import TiedBigramLM, lm_loss, markov_batches
from test_split_equivalence import PipelineMLP, mlp_loss
from torch import nn

from splitrun.runtime import run_threaded
from splitrun.splitter import (
    Cluster,
    GeneralMode,
    PlanError,
    capture,
    check_plan,
    optim,
    place,
    plan_from_text,
    plan_to_dot,
    plan_to_text,
    region,
    split_program,
)
from splitrun.splitter.plan import PipelineSchedule

NUM_STEPS = 6
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


class Stages(nn.Module):
    """`num_workers` stages of linear+GELU blocks, the loss on the last stage."""

    def __init__(self, num_workers: int, width: int = 24) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([
            place(nn.Sequential(nn.Linear(12 if rank == 0 else width, width), nn.GELU()),
                  rank=rank) for rank in range(num_workers)])
        self.head = place(nn.Linear(width, 5), rank=num_workers - 1)
        self.num_workers = num_workers

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def stages_loss(model, x, y):
    logits = model(x)
    with region(rank=model.num_workers - 1):
        return F.cross_entropy(logits, y)


def batches(rows=16, steps=NUM_STEPS):
    generator = torch.Generator().manual_seed(2)
    return [(torch.randn(rows, 12, generator=generator),
             torch.randint(0, 5, (rows,), generator=generator)) for _ in range(steps)]


def feeds_of(data):
    return lambda step: {"batch.0": data[step][0], "batch.1": data[step][1]}


def stages_program(num_workers, optimizer=None, rows=16):
    torch.manual_seed(1)
    data = batches(rows)
    program = capture(Stages(num_workers), stages_loss, optimizer or optim.Adam(lr=0.01),
                      data[0], return_grads=True)
    return program, data


def assert_equals_unsplit(program, split, data):
    expected_history, expected_state = program.train_unsplit(NUM_STEPS, feeds_of(data))
    run = run_threaded(split, NUM_STEPS, feeds_of(data), recv_timeout_s=30)
    for step in range(NUM_STEPS):
        assert run.history[step].keys() == expected_history[step].keys()
        for key, value in expected_history[step].items():
            torch.testing.assert_close(run.history[step][key], value, **TOLERANCE,
                                       msg=f"step {step}: {key} differs")
    assert run.state.keys() == expected_state.keys()
    for key, value in expected_state.items():
        torch.testing.assert_close(run.state[key], value, **TOLERANCE, msg=f"state {key}")
    first = next(iter(program.grads))
    assert not torch.equal(run.state[first], program.initial_state[first]), "nothing trained"
    return run


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("num_workers, microbatches", [(2, 4), (3, 2), (3, 8)])
def test_microbatched_step_equals_the_unsplit_step(schedule, num_workers, microbatches):
    program, data = stages_program(num_workers, optim.SGD(lr=0.05, momentum=0.9))
    split = split_program(program, Cluster(num_workers=num_workers),
                          GeneralMode(microbatches=microbatches, schedule=schedule))
    split.lint()
    assert split.plan.pipeline.num_microbatches == microbatches
    assert split.plan.pipeline.stages == tuple(split.plan.labels)
    assert_equals_unsplit(program, split, data)


def test_weight_gradients_accumulate_inside_the_matrix_product():
    # Each micro-batch after the first adds its weight gradient to the sum in
    # the product itself (addmm), instead of a product and a pass to add it.
    program, _ = stages_program(2)
    split = split_program(program, Cluster(num_workers=2), GeneralMode(microbatches=4))
    nodes = {n.name: n for n in split.program.graph.nodes}
    for param in ("blocks.0.0.weight", "blocks.1.0.weight", "head.weight"):
        sums = [nodes[f"grad_{param.replace('.', '_')}_sum__B{m}"] for m in (1, 2, 3)]
        assert all(n.target is torch.ops.aten.addmm.default for n in sums), param
    biases = [n for name, n in nodes.items() if name.startswith("grad_head_bias_sum__B")]
    assert [n.target for n in biases] == [torch.ops.aten.add.Tensor] * 3


def test_a_sum_loss_is_summed_over_micro_batches():
    torch.manual_seed(1)
    data = batches()
    loss = lambda model, x, y: F.cross_entropy(model(x), y, reduction="sum")  # noqa: E731
    program = capture(Stages(2), loss, optim.Adam(lr=0.01), data[0], return_grads=True)
    split = split_program(program, Cluster(num_workers=2),
                          GeneralMode(microbatches=4, schedule="gpipe"))
    assert_equals_unsplit(program, split, data)


def test_a_loss_back_on_the_first_stage_runs_under_gpipe_and_is_refused_by_1f1b():
    # PipelineMLP computes its loss on worker 0, after worker 2's head: worker
    # 0 is two pieces of the forward, and 1F1B's order for it cannot finish.
    torch.manual_seed(1)
    model = PipelineMLP(3)
    data = batches()
    program = capture(model, mlp_loss, optim.Adagrad(lr=0.05), data[0], return_grads=True)
    with pytest.raises(PlanError, match=r"schedule '1f1b' cannot run this split: worker 0 "
                                        r"waits at _log_softmax \(micro-batch 1\) for addmm_2 "
                                        r"on worker 2.*put the loss on the last stage"):
        split_program(program, Cluster(num_workers=3), GeneralMode(microbatches=4))
    split = split_program(program, Cluster(num_workers=3),
                          GeneralMode(microbatches=4, schedule="gpipe"))
    split.lint()
    assert_equals_unsplit(program, split, data)


def test_a_tied_weight_read_by_data_sync_is_micro_batched_too():
    # The embedding (worker 0) is read by the output head (worker 2) by
    # data-sync; its gradient has parts from both, summed over micro-batches.
    torch.manual_seed(1)
    model = TiedBigramLM(num_workers=3)
    data = markov_batches(NUM_STEPS, batch=8)
    program = capture(model, lm_loss, optim.Adam(lr=0.01), data[0], return_grads=True)
    split = split_program(program, Cluster(num_workers=3),
                          GeneralMode(microbatches=4, schedule="gpipe"))
    split.lint()
    assert split.plan.data_syncs
    assert_equals_unsplit(program, split, data)


def test_the_schedule_is_in_the_plan_text_and_picture():
    program, _ = stages_program(2)
    plan = split_program(program, Cluster(num_workers=2),
                         GeneralMode(microbatches=4, schedule="1f1b")).plan
    text = plan_to_text(plan)
    assert "pipeline 1f1b microbatches=4" in text
    assert "stage w0: F0 F1 B0 F2 B1 F3 B2 B3" in text
    assert "stage w1: F0 B0 F1 B1 F2 B2 F3 B3" in text
    assert plan_from_text(text) == plan
    # Every micro-batch's activations leave in a message of their own, as
    # soon as its forward is done.
    sent = [c.values for c in plan.channels if c.src.rank == 0 and c.dst.rank == 1]
    assert [sorted({v.rsplit("__", 1)[1] for v in values if "__F" in v}) for values in sent] \
        == [["F0"], ["F1"], ["F2"], ["F3"]]
    dot = plan_to_dot(plan)
    assert "bubble in theory 20%" in dot
    # One slot per action: each stage idles 2 slots of 10 (w0 waiting for
    # B0, w1 for F0 and after B3), the 20 % the theory gives.
    assert dot.count("&nbsp;") == 4
    # Blocks name their actions: w0 runs B0 then F2 before it next sends.
    assert 'label="B0 F2\\n' in dot


def test_lint_catches_a_schedule_that_breaks_its_promise():
    program, _ = stages_program(2)
    plan = split_program(program, Cluster(num_workers=2),
                         GeneralMode(microbatches=4, schedule="gpipe")).plan
    check_plan(plan)
    as_1f1b = plan_to_text(plan).replace("pipeline gpipe", "pipeline 1f1b")
    with pytest.raises(PlanError, match=r"worker 0\] holds 3 micro-batches in flight at F2; "
                                        r"1f1b promises at most 2"):
        check_plan(plan_from_text(as_1f1b))
    reordered = plan_to_text(plan).replace("stage w1: F0 F1 F2 F3 B0 B1 B2 B3",
                                       "stage w1: F0 B0 F1 B1 F2 B2 F3 B3")
    with pytest.raises(PlanError, match=r"worker 1\] the schedule runs F0 F1 F2 F3 B0 B1 B2 "
                                        r"B3 but the pipeline \(gpipe\) says F0 B0"):
        check_plan(plan_from_text(reordered))


def test_1f1b_holds_fewer_activations_than_gpipe():
    """Stage s of S holds at most S-s micro-batches' activations under 1F1B,
    all M under GPipe (measured by the executor, bytes of forward values)."""
    program, data = stages_program(2, rows=32)
    microbatches = 8
    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        split = split_program(program, Cluster(num_workers=2),
                              GeneralMode(microbatches=microbatches, schedule=schedule))
        run = run_threaded(split, 2, feeds_of(data))
        peaks[schedule] = [run.stats[label].peak_activation_bytes for label in split.plan.labels]
    for stage, (gpipe, one_f_one_b) in enumerate(zip(peaks["gpipe"], peaks["1f1b"])):
        per_microbatch = gpipe / microbatches
        # In flight: 2 - stage micro-batches, plus one's values on their way out.
        assert one_f_one_b <= (2 - stage + 1) * per_microbatch, (stage, peaks)
        assert one_f_one_b < gpipe / 2, (stage, peaks)


def test_a_batch_that_does_not_divide_is_refused():
    program, _ = stages_program(2)
    with pytest.raises(PlanError, match=r"a batch of 16 rows does not divide into 3 "
                                        r"micro-batches; choose microbatches among \[2, 4, 8"):
        split_program(program, Cluster(num_workers=2), GeneralMode(microbatches=3))


def test_batch_norm_is_refused_naming_the_op():
    class Normed(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(12, 8),
                                      nn.BatchNorm1d(8, track_running_stats=False),
                                      nn.Linear(8, 5))

        def forward(self, x):
            return self.body(x)

    data = batches()
    program = capture(Normed(), mlp_loss, optim.SGD(lr=0.1), data[0])
    with pytest.raises(PlanError, match=r"batch_norm.*module 'body.1'.*mixes samples"):
        split_program(program, Cluster(num_workers=1), GeneralMode(microbatches=2))


def test_a_loss_that_is_not_a_mean_or_sum_is_refused_naming_the_op():
    data = batches()
    loss = lambda model, x, y: F.cross_entropy(model(x), y).sqrt()  # noqa: E731
    program = capture(Stages(1), loss, optim.SGD(lr=0.1), data[0])
    with pytest.raises(PlanError, match=r"the loss comes from node sqrt.*mean or a sum"):
        split_program(program, Cluster(num_workers=1), GeneralMode(microbatches=2))


def test_bad_mode_settings_are_refused():
    with pytest.raises(PlanError, match="unknown schedule; choose one of 'gpipe', '1f1b', "
                                        "'interleaved'"):
        GeneralMode(microbatches=4, schedule="zero-bubble")
    with pytest.raises(PlanError, match="at least 1"):
        GeneralMode(microbatches=0)
    assert GeneralMode(microbatches=2, schedule=PipelineSchedule.GPIPE).schedule \
        is PipelineSchedule.GPIPE


# -- interleaved 1F1B ---------------------------------------------------------------


class Chunks(nn.Module):
    """`num_chunks` pieces of linear+GELU per worker, placed in turn (piece i
    on rank i % workers), the head and loss with the last piece."""

    def __init__(self, num_workers: int, num_chunks: int, width: int = 24) -> None:
        super().__init__()
        self.pieces = nn.ModuleList([
            place(nn.Sequential(nn.Linear(12 if i == 0 else width, width), nn.GELU()),
                  rank=i % num_workers) for i in range(num_workers * num_chunks)])
        self.head = place(nn.Linear(width, 5), rank=num_workers - 1)
        self.num_workers = num_workers

    def forward(self, x):
        for piece in self.pieces:
            x = piece(x)
        return self.head(x)


def chunks_program(num_workers, num_chunks, rows=16, optimizer=None):
    torch.manual_seed(1)
    data = batches(rows)
    program = capture(Chunks(num_workers, num_chunks), stages_loss,
                      optimizer or optim.SGD(lr=0.05, momentum=0.9), data[0],
                      return_grads=True)
    return program, data


def test_interleaved_order_is_torchs():
    # Learned from torch's ScheduleInterleaved1F1B, compared with its own
    # order (the actions it computes per rank, its timing gaps left out).
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    from splitrun.splitter.plan import stage_actions
    compared = 0
    for processes in (2, 3, 4):
        for chunks in (1, 2, 3):
            for microbatches in range(1, 13):
                rounds = max(1, microbatches // processes)
                if microbatches % rounds:
                    continue
                torch_schedule = SimpleNamespace(
                    pp_group_size=processes, n_local_stages=chunks,
                    _n_microbatches=microbatches,
                    microbatches_per_round=microbatches // rounds)
                for rank in range(processes):
                    theirs = [str(a) for a in  # torch's _Action prints as "2F0"
                              ScheduleInterleaved1F1B._calculate_single_rank_operations(
                                  torch_schedule, rank) if a is not None]
                    ours = [str(a) for a in stage_actions(PipelineSchedule.INTERLEAVED,
                                                          processes, rank, microbatches, chunks)]
                    assert ours == theirs, (processes, chunks, microbatches, rank)
                    compared += 1
    assert compared > 100


@pytest.mark.parametrize("num_workers, num_chunks, microbatches, rows",
                         [(2, 2, 4, 16), (2, 3, 4, 16), (3, 2, 2, 16), (2, 2, 3, 24)])
def test_interleaved_step_equals_the_unsplit_step(num_workers, num_chunks, microbatches, rows):
    program, data = chunks_program(num_workers, num_chunks, rows)
    split = split_program(program, Cluster(num_workers=num_workers),
                          GeneralMode(microbatches=microbatches, schedule="interleaved"))
    split.lint()
    pipeline = split.plan.pipeline
    assert (pipeline.num_chunks, pipeline.stages) == (num_chunks, tuple(split.plan.labels))
    # Each process runs its own chunks only: virtual stage v on process v mod P.
    for process, actions in enumerate(pipeline.actions):
        assert {int(a[:-2]) % num_workers for a in actions} == {process}
        assert len(actions) == 2 * num_chunks * microbatches
    assert_equals_unsplit(program, split, data)


def test_the_interleaved_schedule_is_in_the_plan_text_and_picture():
    program, _ = chunks_program(2, 2)
    plan = split_program(program, Cluster(num_workers=2),
                         GeneralMode(microbatches=4, schedule="interleaved")).plan
    text = plan_to_text(plan)
    assert "pipeline interleaved microbatches=4 chunks=2" in text
    assert "stage w0: 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3" in text
    assert "stage w1: 1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3" in text
    assert plan_from_text(text) == plan
    # Each chunk's activations leave as soon as its forward is done.
    sent = [c.values for c in plan.channels if c.src.rank == 0 and c.dst.rank == 1]
    actions = [sorted({v.rsplit("__", 1)[1] for v in values if "F" in v.rsplit("__", 1)[-1]})
               for values in sent]
    assert [a for a in actions if a] == [["0F0"], ["0F1"], ["2F0"], ["2F1"], ["0F2"], ["0F3"],
                                         ["2F2"], ["2F3"]]
    dot = plan_to_dot(plan)
    assert "4 micro-batches, 2 chunks each: bubble in theory 11%" in dot
    # One slot per chunk action (16 per process): 18 slots wide, 2 idle
    # on each process, the 1/9 = (P-1)/(V*M+P-1) of the theory.
    assert dot.count("&nbsp;") == 4
    assert 'bgcolor="#bfdbfe">2F0</td>' in dot


def test_lint_checks_the_interleaved_order():
    program, _ = chunks_program(2, 2)
    plan = split_program(program, Cluster(num_workers=2),
                         GeneralMode(microbatches=2, schedule="interleaved")).plan
    check_plan(plan)
    text = plan_to_text(plan)
    line = next(x for x in text.splitlines() if x.startswith("stage w0:"))
    gpipe_like = "stage w0: 0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1"
    assert line == gpipe_like  # M = P: all forwards first is the schedule itself
    program, _ = chunks_program(2, 2, rows=24)
    plan = split_program(program, Cluster(num_workers=2),
                         GeneralMode(microbatches=6, schedule="interleaved")).plan
    text = plan_to_text(plan)
    line = next(x for x in text.splitlines() if x.startswith("stage w1:"))
    swapped = line.replace("1F2 1B0", "1B0 1F2")
    assert swapped != line
    with pytest.raises(PlanError, match=r"worker 1\] the schedule runs .* but the pipeline "
                                        r"\(interleaved\) says .*1B0 1F2"):
        check_plan(plan_from_text(text.replace(line, swapped)))


def test_interleaved_holds_the_activations_it_promises():
    """Process p holds at most its warm-up forwards plus one (stage,
    micro-batch) pairs, each a chunk's activations (measured by the executor)."""
    program, data = chunks_program(2, 2, rows=32)
    microbatches = 8
    peaks = {}
    for schedule in ("gpipe", "interleaved"):
        split = split_program(program, Cluster(num_workers=2),
                              GeneralMode(microbatches=microbatches, schedule=schedule))
        run = run_threaded(split, 2, feeds_of(data))
        peaks[schedule] = [run.stats[label].peak_activation_bytes for label in split.plan.labels]
        if schedule == "interleaved":
            bounds = [split.plan.pipeline.max_in_flight(p) for p in range(2)]
    assert bounds == [5, 3]  # (V-1)*M/rounds + 2*(P-1-p) + 1 of M*V = 16 pairs
    for process, (gpipe, interleaved) in enumerate(zip(peaks["gpipe"], peaks["interleaved"])):
        per_pair = gpipe / (microbatches * 2)  # GPipe holds all 16 pairs
        # In flight: the bound, plus one pair's values on their way out.
        assert interleaved <= (bounds[process] + 1) * per_pair, (process, peaks)
        assert interleaved < gpipe / 2, (process, peaks)


def test_interleaved_refusals_name_the_fix():
    program, _ = chunks_program(2, 2, rows=20)
    with pytest.raises(PlanError, match=r"interleaved 1F1B over 2 processes runs 5 micro-batches "
                                        r"in 2 rounds of 2, which leaves 1 over; choose "
                                        r"microbatches among \[2, 3, 4, 6, 8\]"):
        split_program(program, Cluster(num_workers=2),
                      GeneralMode(microbatches=5, schedule="interleaved"))
    contiguous, _ = stages_program(2)
    with pytest.raises(PlanError, match=r"one piece of the forward \(w0 w1\); use "
                                        r"schedule='1f1b'"):
        split_program(contiguous, Cluster(num_workers=2),
                      GeneralMode(microbatches=4, schedule="interleaved"))
    chunked, _ = chunks_program(2, 2)
    with pytest.raises(PlanError, match=r"schedule '1f1b' cannot run this split.*use "
                                        r"schedule='interleaved'"):
        split_program(chunked, Cluster(num_workers=2), GeneralMode(microbatches=4))
    # Pieces out of turn (w0 w1 w1 w0): no process order makes them chunks.
    torch.manual_seed(1)
    model = Chunks(2, 2)
    for piece, rank in zip(model.pieces, (0, 1, 1, 0)):
        place(piece, rank=rank)
    place(model.head, rank=0)
    data = batches()
    loss = lambda m, x, y: F.cross_entropy(m(x), y)  # noqa: E731
    program = capture(model, loss, optim.SGD(lr=0.1), data[0])
    with pytest.raises(PlanError, match=r"hold chunks of the forward in turn \(w0 w1 w0 w1 "
                                        r"\.\.\.\); this split's forward runs through w0 w1 w0"):
        split_program(program, Cluster(num_workers=2),
                      GeneralMode(microbatches=4, schedule="interleaved"))
