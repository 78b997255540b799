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
    Label,
    ParameterServerMode,
    capture,
    optim,
    split_program,
)
from splitrun.splitter.cache_mode import EmbeddingCacheMode

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
    _, full, batches = make_bag(optimizer, 1, NUM_STEPS)
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


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_parameter_server_mode_equals_one_process(optimizer):
    program, full, batches = make_bag(optimizer, 2, NUM_STEPS)
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
