"""Parallel mode on more than linears: a vocabulary-parallel embedding with a
column-parallel head and parallel cross-entropy, and a layer-norm block with
only one layer pinned. Through `run_threaded`, equal to the unsplit step.

Tolerance 1e-5 (absolute): shards sum in another order than the whole.
"""

import pytest
import torch
from parallel_models import make_optimizer, whole_state
from torch import nn

from splitrun.runtime import run_threaded
from splitrun.splitter import (
    Cluster,
    Label,
    ParallelCrossEntropyLoss,
    ParallelEmbedding,
    ParallelLinear,
    ParallelMode,
    PlanError,
    capture,
    place,
    split_program,
)
from splitrun.splitter.modes.parallel import CollectiveKind, R, S

NUM_STEPS = 10
TOLERANCE = 1e-5
VOCAB, DIM, BATCH, TOKENS = 16, 8, 4, 6
IGNORE = 0


class VocabModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = ParallelEmbedding(VOCAB, DIM, dim=0)
        self.head = ParallelLinear(DIM, VOCAB, dim=-1)
        self.loss = ParallelCrossEntropyLoss(ignore_index=IGNORE)

    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids)))


def vocab_loss(model, ids, targets):
    return model.loss(model(ids).reshape(-1, VOCAB), targets.reshape(-1))


def boundary_batches(num_workers: int):
    """Ids and targets on every shard's first and last row, plus ignored targets."""
    rows = VOCAB // num_workers
    edges = sorted({r * rows for r in range(num_workers)}
                   | {r * rows - 1 for r in range(1, num_workers + 1)})
    gen = torch.Generator().manual_seed(3)
    data = []
    for _ in range(NUM_STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, TOKENS), generator=gen)
        targets = torch.randint(0, VOCAB, (BATCH, TOKENS), generator=gen)
        flat_ids, flat_targets = ids.view(-1), targets.view(-1)
        flat_ids[:len(edges)] = torch.tensor(edges)
        flat_targets[:len(edges)] = torch.tensor(edges)
        flat_targets[-2:] = IGNORE
        data.append((ids, targets))
    return lambda step: {"batch.0": data[step][0], "batch.1": data[step][1]}


def train(program, num_workers, batches, policy="global", backend="channels"):
    split = split_program(program, Cluster(num_workers=num_workers),
                          ParallelMode(policy=policy, backend=backend))
    split.lint()
    run = run_threaded(split, NUM_STEPS, batches, recv_timeout_s=30)
    history, expected = program.train_unsplit(NUM_STEPS, batches)
    full = whole_state(split.artifacts, run.state)
    for key, value in expected.items():
        torch.testing.assert_close(full[key], value, rtol=0, atol=TOLERANCE)
    for got, want in zip(run.history, history):
        torch.testing.assert_close(got["loss"], want["loss"], rtol=0, atol=TOLERANCE)
    return split.artifacts, run


@pytest.mark.parametrize("optimizer, backend", [("sgd", "channels"), ("adam", "channels"),
                                                ("adam", "torch_distributed")])
@pytest.mark.parametrize("num_workers", [2, 4])
def test_vocab_parallel_embedding_head_and_cross_entropy(optimizer, num_workers, backend):
    torch.manual_seed(0)
    batches = boundary_batches(num_workers)
    program = capture(VocabModel(), vocab_loss, make_optimizer(optimizer),
                      tuple(batches(0).values()))
    layout, _ = train(program, num_workers, batches, backend=backend)
    assert layout.state["emb.weight"] == S(0)
    assert layout.state["head.weight"] == S(0)
    # The class dimension stays sharded through the loss: members exchange
    # row statistics, never logits, and with them each member's sum of the
    # target logits it holds: the loss comes out whole from that one exchange
    # (rows + 1 numbers a member), with no all-reduce of its own.
    exchanges = [c for c in layout.collectives if c.kind is CollectiveKind.EXCHANGE]
    rows = BATCH * TOKENS
    assert [c.nbytes for c in exchanges] == [num_workers * (num_workers - 1) * (rows + 1) * 4]
    losses = [s for s in layout.sharding.strategies.values()
              if getattr(s.local, "__name__", "") == "vocab_nll_loss_from_exchange"]
    assert [s.outputs for s in losses] == [(R, R)], "the loss itself comes out whole"
    loss_sums = [c for c in layout.collectives if c.kind is CollectiveKind.ALL_REDUCE
                 and c.nbytes == num_workers * (num_workers - 1) * 4]
    assert not loss_sums, layout.collectives


def test_the_vocab_parallel_path_itself_under_greedy():
    torch.manual_seed(0)
    batches = boundary_batches(2)
    program = capture(VocabModel(), vocab_loss, make_optimizer("adam"),
                      tuple(batches(0).values()))
    layout, _ = train(program, 2, batches, policy="greedy")
    strategies = layout.sharding.strategies
    used = {str(s.local.__name__) for s in strategies.values() if s.local is not None}
    # The backward of the log-softmax needs no exchange after nll_loss: the
    # row sums of its gradient follow from the targets on every member.
    assert {"vocab_embedding", "vocab_log_softmax_with_loss", "vocab_nll_loss_from_exchange",
            "vocab_nll_loss_backward", "vocab_log_softmax_backward_after_nll"} <= used


class NormBlock(nn.Module):
    """Only the first linear is pinned; propagation places the rest."""

    def __init__(self) -> None:
        super().__init__()
        self.up = ParallelLinear(8, 16, dim=-1)
        self.down = nn.Linear(16, 8)
        self.norm = nn.LayerNorm(8)
        self.out = nn.Linear(8, 4)

    def forward(self, x):
        hidden = self.down(nn.functional.gelu(self.up(x))) + x
        return self.out(self.norm(hidden))


@pytest.mark.parametrize("num_workers, policy, backend", [
    (2, "first", "channels"), (2, "greedy", "channels"), (2, "global", "channels"),
    (4, "global", "channels"), (4, "global", "torch_distributed")])
def test_layer_norm_block_with_one_layer_pinned(num_workers, policy, backend):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(5)
    data = [(torch.randn(8, 8, generator=gen), torch.randn(8, 4, generator=gen))
            for _ in range(NUM_STEPS)]
    batches = lambda step: {"batch.0": data[step][0], "batch.1": data[step][1]}  # noqa: E731
    program = capture(NormBlock(), lambda m, x, y: nn.functional.mse_loss(m(x), y),
                      make_optimizer("adam"), data[0])
    layout, _ = train(program, num_workers, batches, policy=policy, backend=backend)
    assert layout.state["up.weight"] == S(0)
    if policy == "global":
        assert layout.state["norm.weight"] == R


class Stage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = ParallelLinear(8, 16, dim=-1)
        self.down = ParallelLinear(16, 8, dim=0)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class TwoStages(nn.Module):
    """Stage a on group {0, 1}, stage b and the head on group {2, 3}."""

    def __init__(self) -> None:
        super().__init__()
        self.a = Stage()
        self.b = place(Stage(), rank=2)
        self.head = place(nn.Linear(8, 4), rank=2)

    def forward(self, x):
        return self.head(self.b(self.a(x)))


@pytest.mark.parametrize("backend", ["channels", "torch_distributed"])
def test_pipeline_and_tensor_parallel_groups(backend):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(6)
    data = [(torch.randn(8, 8, generator=gen), torch.randn(8, 4, generator=gen))
            for _ in range(NUM_STEPS)]
    batches = lambda step: {"batch.0": data[step][0], "batch.1": data[step][1]}  # noqa: E731
    program = capture(TwoStages(), lambda m, x, y: nn.functional.mse_loss(m(x), y),
                      make_optimizer("adam"), data[0])
    split = split_program(program, Cluster(num_workers=4),
                          ParallelMode(groups=[[0, 1], [2, 3]], backend=backend))
    split.lint()
    plan = split.plan
    run = run_threaded(split, NUM_STEPS, batches, recv_timeout_s=30)
    _, expected = program.train_unsplit(NUM_STEPS, batches)
    layout = split.artifacts
    full = whole_state(layout, run.state)
    for key, value in expected.items():
        torch.testing.assert_close(full[key], value, rtol=0, atol=TOLERANCE)
    # each stage's state lives in its own group, sharded as pinned
    assert layout.members_of("a.up.weight") == (Label.worker(0), Label.worker(1))
    assert layout.members_of("b.up.weight") == (Label.worker(2), Label.worker(3))
    assert layout.state["b.down.weight"] == S(1)
    assert any(c.kind is CollectiveKind.GROUP_TO_GROUP for c in layout.collectives)
    sent = sum(stats.bytes_sent for stats in run.stats.values())
    if backend == "channels":
        assert sent == NUM_STEPS * layout.bytes_per_step == NUM_STEPS * plan.bytes_per_step()
    else:  # within a group: two process groups; between groups: channels, member to member
        between = sum(c.nbytes for c in layout.collectives
                      if c.kind is CollectiveKind.GROUP_TO_GROUP)
        assert sent == NUM_STEPS * between == NUM_STEPS * plan.bytes_per_step()
        pairs = {(c.src.rank, c.dst.rank) for c in plan.channels if c.values}
        assert pairs == {(0, 2), (1, 3), (2, 0), (3, 1)}


def test_a_cost_per_collective_trades_a_few_bytes_for_fewer_collectives():
    torch.manual_seed(0)
    batches = boundary_batches(4)
    program = capture(VocabModel(), vocab_loss, make_optimizer("adam"),
                      tuple(batches(0).values()))
    cluster = Cluster(num_workers=4)
    bytes_only = split_program(program, cluster, ParallelMode(collective_latency_bytes=0))
    default = split_program(program, cluster, ParallelMode())
    latency = ParallelMode().collective_latency_bytes
    assert latency > 0

    def cost(layout):
        return layout.bytes_per_step + 4 * latency * len(layout.collectives)

    fewest_bytes, fewest_rounds = bytes_only.artifacts, default.artifacts
    assert fewest_bytes.bytes_per_step < fewest_rounds.bytes_per_step
    assert len(fewest_rounds.collectives) < len(fewest_bytes.collectives)
    assert cost(fewest_rounds) <= cost(fewest_bytes)
    # the log-softmax's members exchange one log-sum-exp per row, and the
    # loss rides along (one number)
    (exchange,) = [c for c in fewest_rounds.collectives if c.kind is CollectiveKind.EXCHANGE]
    assert exchange.nbytes == 4 * 3 * (BATCH * TOKENS + 1) * 4
    with pytest.raises(PlanError, match="collective_latency_bytes must be .* got -1"):
        ParallelMode(collective_latency_bytes=-1)


@pytest.mark.parametrize("num_workers", [2, 4])
def test_the_transformer_block_example_takes_five_collectives(num_workers):
    # examples/tp_train.py: the embedding's all-gather, the MLP's all-reduce,
    # the loss's one exchange (log-sum-exps and the loss together) and two
    # all-reduces in the backward; at 2 ranks one message a rank each.
    import tp_train

    program, batches = tp_train.build(3, 0.01)
    split = split_program(program, Cluster(num_workers=num_workers), ParallelMode())
    kinds = [c.kind for c in split.artifacts.collectives]
    assert kinds.count(CollectiveKind.EXCHANGE) == 1 and len(kinds) == 5, kinds
    if num_workers == 2:
        assert len(split.plan.channels) == 2 * 5
    run = run_threaded(split, 3, tp_train.feeds(batches), recv_timeout_s=30)
    history, expected = program.train_unsplit(3, tp_train.feeds(batches))
    full = whole_state(split.artifacts, run.state)
    for key, value in expected.items():  # the example's own tolerance (Adam's small moments)
        torch.testing.assert_close(full[key], value, rtol=0, atol=tp_train.TOLERANCE)
    for got, want in zip(run.history, history):
        torch.testing.assert_close(got["loss"], want["loss"], rtol=0, atol=TOLERANCE)
