"""nn.EmbeddingBag (sum and mean, offsets, per-sample weights, padding_idx) and
nn.Embedding(padding_idx=...) with sparse gradients: captured, they train as
eager torch does; in parameter-server mode (W=2, S=2) as one process does on the
global batch (within 1e-5: the mean of two shard gradients sums in another order).
Cached (embedding-cache mode): one worker equals the whole tables in one process
bit for bit, with evictions; two workers without staleness equal parameter-server
mode bit for bit."""

import cache_models
import pytest
import torch
import torch.nn.functional as F
from ps_models import BagNet, all_feeds, bag_batches, bag_loss, make_bag
from torch import nn

from splitrun.runtime import run_threaded
from splitrun.splitter import (
    CaptureError,
    Cluster,
    EmbeddingCacheMode,
    Label,
    ParameterServerMode,
    capture,
    optim,
    split_program,
)
from splitrun.splitter.ops.bags import (
    bag_forward,
    bag_gradient,
    bag_gradient_rows,
    sorted_groups,
    sparse_bag,
)

NUM_STEPS = 12
TOLERANCE = 1e-5
EAGER = {"sgd": (lambda params: torch.optim.SGD(params, lr=0.5)),
         "adagrad": (lambda params: torch.optim.Adagrad(params, lr=0.1))}


def eager_training(optimizer: str, batches):
    torch.manual_seed(0)
    model = BagNet()
    opt = EAGER[optimizer](model.parameters())
    for ids, weights, labels in batches:
        opt.zero_grad()
        bag_loss(model, ids, weights, labels).backward()
        opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_captured_bags_train_as_eager_torch(optimizer):
    full, batches = make_bag(optimizer, 1, NUM_STEPS)
    _, state = full.train_unsplit(NUM_STEPS, all_feeds(batches))
    expected = eager_training(optimizer, batches)
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=TOLERANCE)
    for table in ("sum_bag.weight", "mean_bag.weight", "emb.weight"):
        assert torch.equal(state[table][0], torch.zeros(6)), f"{table}: padding row moved"
        assert not torch.equal(state[table], full.initial_state[table])


BAG_FORMS = [(mode, padding, two_d, weighted, last)
             for mode in ("sum", "mean") for padding in (None, 2) for two_d in (False, True)
             for weighted in ((False, True) if mode == "sum" else (False,))
             for last in ((False,) if two_d else (False, True))]


@pytest.mark.parametrize("mode, padding, two_d, weighted, last", BAG_FORMS)
def test_every_form_of_bag_matches_eager_torch(mode, padding, two_d, weighted, last):
    """One SGD step: flat ids with offsets (an empty bag, bags of different
    lengths, include_last_offset) or fixed-length rows of ids; with and
    without per-sample weights and padding."""
    torch.manual_seed(0)
    bag = nn.EmbeddingBag(12, 3, mode=mode, sparse=True, padding_idx=padding,
                          include_last_offset=last)
    ids = torch.tensor([1, 2, 3, 3, 5, 2, 7, 11])
    offsets = None if two_d else torch.tensor([0, 3, 3, 6] + ([8] if last else []))
    weights = torch.rand(8)
    if two_d:
        ids, weights = ids.reshape(4, 2), weights.reshape(4, 2)
    batch = (ids, *(() if two_d else (offsets,)), *((weights,) if weighted else ()))

    def loss(m, ids, *rest):
        return (m(ids, None if two_d else rest[0],
                  per_sample_weights=rest[-1] if weighted else None) ** 2).sum()
    program = capture(bag, loss, optim.SGD(lr=0.1), batch)
    _, state = program.train_unsplit(1, lambda step: {f"batch.{i}": t
                                                     for i, t in enumerate(batch)})
    reference = bag.weight.detach().clone().requires_grad_(True)
    out = F.embedding_bag(ids, reference, offsets, mode=mode, padding_idx=padding,
                          per_sample_weights=weights if weighted else None,
                          include_last_offset=last)
    (out ** 2).sum().backward()
    expected = reference.detach() - 0.1 * reference.grad.to_dense()
    torch.testing.assert_close(state["weight"], expected, rtol=0, atol=1e-6)
    assert not torch.equal(state["weight"], bag.weight.detach())


@pytest.mark.parametrize("mode, padding, weighted", [
    ("sum", None, False), ("sum", 0, True), ("sum", None, True), ("mean", None, False),
    ("mean", 0, False)])
def test_fused_bag_matches_torch_values_and_gradients(mode, padding, weighted):
    """The fused bag (`sparse_bag`) against torch's embedding_bag: outputs, and
    its gradient summed per unique id (`bag_gradient`) against torch's sparse
    gradient coalesced (within float32 rounding: torch adds in another order);
    the same bag read from a cache's slots (rows permuted,
    as the embedding cache holds them) is bit for bit the whole table's."""
    generator = torch.Generator().manual_seed(5)
    table = torch.randn(40, 8, generator=generator)
    ids = torch.randint(0, 40, (300,), generator=generator)
    ids[::7] = 0  # padding (when padding is 0), and ids that recur
    offsets = torch.tensor([0, 5, 5, 60, 61, 200])  # an empty bag, bags of every size
    weights = torch.rand(300, generator=generator) if weighted else None
    grad = torch.randn(6, 8, generator=generator)

    reference = table.clone().requires_grad_(True)
    expected = F.embedding_bag(ids, reference, offsets, mode=mode, padding_idx=padding,
                               per_sample_weights=weights, sparse=True)
    expected.backward(grad)
    expected_grad = reference.grad.coalesce()
    if padding is not None:  # torch keeps the padding row's (zero) gradient row
        assert torch.equal(expected_grad.to_dense()[padding], torch.zeros(8))

    whole = table.clone().requires_grad_(True)
    out = sparse_bag(whole, ids, offsets, weights, mode == "mean", padding)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    rows, sums = bag_gradient(grad, ids, offsets, weights, mode == "mean", padding)
    assert torch.equal(rows, torch.unique(ids))
    torch.testing.assert_close(sums, expected_grad.to_dense()[rows], rtol=1e-5, atol=1e-6)
    out.backward(grad)  # the traced form: one row per lookup, coalesced by torch
    torch.testing.assert_close(whole.grad.coalesce().to_dense(), expected_grad.to_dense(),
                               rtol=1e-5, atol=1e-6)

    slots = torch.randperm(40, generator=generator)  # id -> slot in a "cache"
    cache_rows = torch.empty_like(table)
    cache_rows[slots] = table
    cached = bag_forward(cache_rows, slots[ids], ids, offsets, weights, mode == "mean", padding)
    assert torch.equal(cached, out.detach())
    groups = sorted_groups(ids)
    assert torch.equal(groups.unique, rows)
    assert torch.equal(bag_gradient_rows(grad, ids, offsets, weights, mode == "mean", padding,
                                         groups.order, groups.starts), sums)


def test_id_groups_are_torch_unique_and_a_stable_order():
    ids = torch.randint(0, 30, (500,), generator=torch.Generator().manual_seed(1))
    groups = sorted_groups(ids)
    unique, inverse, counts = torch.unique(ids, sorted=True, return_inverse=True,
                                           return_counts=True)
    assert torch.equal(groups.unique, unique) and torch.equal(groups.inverse, inverse)
    assert torch.equal(groups.counts, counts)
    assert torch.equal(groups.order, torch.sort(ids, stable=True).indices)
    assert torch.equal(groups.starts, torch.cumsum(counts, 0) - counts)
    empty = sorted_groups(ids[:0])
    assert empty.unique.numel() == empty.starts.numel() == empty.order.numel() == 0


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_parameter_server_mode_equals_one_process(optimizer):
    program, batches = make_bag(optimizer, 2, NUM_STEPS)
    full, _ = make_bag(optimizer, 1, NUM_STEPS)  # the whole batch
    split_prog = split_program(program, Cluster(2, 2), ParameterServerMode())
    split_prog.lint()
    run = run_threaded(split_prog, NUM_STEPS, all_feeds(batches), recv_timeout_s=30)
    _, expected = full.train_unsplit(NUM_STEPS, all_feeds(batches))
    assert run.state.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(run.state[key], value, rtol=0, atol=TOLERANCE)
    servers = {split_prog.artifacts.owner[t] for t in ("sum_bag.weight", "mean_bag.weight",
                                                       "emb.weight")}
    assert servers == {0, 1}, "the tables are spread over both servers"
    for table in ("sum_bag.weight", "mean_bag.weight", "emb.weight"):
        assert torch.equal(run.state[table][0], program.initial_state[table][0])
        assert not torch.equal(run.state[table], program.initial_state[table])


def test_unsupported_embedding_options_are_refused_naming_the_layer():
    batch = (torch.tensor([[1, 2], [3, 4]]),)
    loss = lambda m, ids: m(ids).sum()  # noqa: E731
    for layer, pattern in (
            (nn.Embedding(10, 3, max_norm=1.0), r"module 'Embedding' \(Embedding\) has "
                                                r"max_norm=1.0: it renormalizes"),
            (nn.EmbeddingBag(10, 3, max_norm=2.0), r"has max_norm=2.0"),
            (nn.EmbeddingBag(10, 3, mode="max", sparse=True), r"\(EmbeddingBag\) has "
                                                              r"mode='max' and a sparse"),
    ):
        with pytest.raises(CaptureError, match=pattern):
            capture(layer, loss, optim.SGD(lr=0.1), batch)
    model = nn.Sequential(nn.Linear(2, 2), nn.EmbeddingBag(10, 3, max_norm=1.0))
    with pytest.raises(CaptureError, match=r"module '1' \(EmbeddingBag\) has max_norm"):
        capture(model, lambda m, x: m[1](x).sum(), optim.SGD(lr=0.1), batch)
    assert bag_batches(1)[0][0].shape == (24, 5)


# -- embedding-cache mode ----------------------------------------------------------

CACHE_STEPS = 20


def _cached_bags(optimizer, num_workers, num_servers, **options):
    program, batches = cache_models.make_bags(optimizer, num_workers, CACHE_STEPS, **options)
    split_prog = split_program(program, Cluster(num_workers, num_servers), EmbeddingCacheMode())
    split_prog.lint()
    return run_threaded(split_prog, CACHE_STEPS, cache_models.feeds(batches), recv_timeout_s=30)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_cached_bags_with_one_worker_equal_whole_tables_in_one_process(optimizer):
    run = _cached_bags(optimizer, 1, 2, cache_rows=40)
    program, batches = cache_models.make_bags(optimizer, 1, CACHE_STEPS, cache_rows=None)
    _, expected = program.train_unsplit(CACHE_STEPS, cache_models.feeds(batches))
    assert run.state.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(run.state[key], value), f"{key} differs"
    for index in range(3):
        table = f"tables.{index}.weight"
        assert torch.equal(run.state[table][0], program.initial_state[table][0])
        assert not torch.equal(run.state[table], program.initial_state[table])
    for table, counters in run.cache_counters[Label.worker(0)].items():
        assert counters["evictions"] > 0, f"{table}: the cache must really evict"


def test_cached_bags_with_two_workers_and_no_staleness_equal_parameter_server_mode():
    run = _cached_bags("adagrad", 2, 2, cache_rows=40, policy="lfu", max_staleness=0)
    program, batches = cache_models.make_bags("adagrad", 2, CACHE_STEPS, cache_rows=None)
    split_prog = split_program(program, Cluster(2, 2), ParameterServerMode())
    expected = run_threaded(split_prog, CACHE_STEPS, cache_models.feeds(batches),
                            recv_timeout_s=30).state
    for key, value in expected.items():
        assert torch.equal(run.state[key], value), f"{key} differs"
