"""TorchRec's own DLRM through `TorchRecInput`, split in threads (the
splitter's loopback; tests/e2e/test_torchrec_e2e.py launches it): a table pooled
by two features is one table, looked up once per step, trained in every mode
and worker count equal to the unsplit step (one worker bit for bit), which
equals plain single-process TorchRec; per-table optimizers and TorchRec's
and FBGEMM's spellings of them train as eager PyTorch does; row-wise Adagrad
and FBGEMM's ADAM are refused in one line."""

import pytest
import torch

torchrec = pytest.importorskip("torchrec")

from fbgemm_gpu.split_embedding_configs import EmbOptimType  # noqa: E402
from torchrec.optim import RowWiseAdagrad, apply_optimizer_in_backward  # noqa: E402
from torchrec.optim.keyed import KeyedOptimizerWrapper  # noqa: E402
from torchrec.optim.optimizers import in_backward_optimizer_filter  # noqa: E402
from torchrec_models import (  # noqa: E402
    CACHE_ROWS,
    converted,
    dlrm_loss,
    global_batches,
    make_dlrm,
    torchrec_reference,
)

from splitrun.runtime import run_threaded  # noqa: E402
from splitrun.splitter import (  # noqa: E402
    CaptureError,
    Cluster,
    EmbeddingCacheMode,
    ParameterServerMode,
    TorchRecInput,
    capture,
    from_fused_params,
    optim,
    place_embedding_cache,
    split_program,
)

STEPS = 8
TABLES = ("sparse_arch.embedding_bag_collection.embedding_bags.t_item.weight",
          "sparse_arch.embedding_bag_collection.embedding_bags.t_user.weight")


def unsplit(rec, program, batches):
    flat = list(rec.shard(batches, 0, 1))
    return program.train_unsplit(STEPS, lambda s: {f"batch.{i}": t
                                                   for i, t in enumerate(flat[s])})[1]


def split_run(rec, program, batches, mode, num_workers):
    split = split_program(program, Cluster(num_workers, 2), mode)
    shards = [list(rec.shard(batches, rank, num_workers)) for rank in range(num_workers)]
    return run_threaded(split, STEPS, recv_timeout_s=30, worker_batches=lambda rank, step: {
        f"batch.{i}": t for i, t in enumerate(shards[rank][step])})


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_the_converted_dlrm_equals_plain_torchrec(optimizer):
    _, rec, program, batches = converted(optimizer, 1, cache=False)
    state = unsplit(rec, program, batches)
    expected = torchrec_reference(optimizer, STEPS)
    assert set(expected) <= set(state)
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=1e-6, msg=key)
    # The shared table is one table, looked up once a step: one bag node.
    bags = [n for n in program.graph.nodes
            if n.target is torch.ops.splitrun.sparse_bag.default]
    assert len(bags) == 2


@pytest.mark.parametrize("mode, optimizer, dense, num_workers", [
    *[("cache", o, d, w) for o in ("sgd", "adagrad") for d in ("worker", "server")
      for w in (1, 2)],
    ("parameter_server", "sgd", "worker", 2),       # was: sparse gradients all-reduced
    ("parameter_server", "adagrad", "server", 2),   # was: sparse gradients sent
    ("parameter_server", "sgd", "server", 1),
    ("parameter_server", "adagrad", "worker", 1),
])
def test_a_table_pooled_by_two_features_trains_in_every_mode(mode, optimizer, dense,
                                                             num_workers):
    cache = mode == "cache"
    _, rec, program, batches = converted(optimizer, num_workers, cache=cache, dense=dense)
    chosen = EmbeddingCacheMode(dense=dense) if cache else ParameterServerMode(dense=dense)
    run = split_run(rec, program, batches, chosen, num_workers)
    _, rec1, program1, _ = converted(optimizer, 1, cache=False, dense=dense)
    expected = unsplit(rec1, program1, batches)
    assert run.state.keys() == expected.keys()
    for key, value in expected.items():
        if num_workers == 1:
            assert torch.equal(run.state[key], value), key
        else:
            torch.testing.assert_close(run.state[key], value, rtol=0, atol=1e-5, msg=key)
    if cache:
        counters = next(iter(run.cache_counters.values()))
        assert counters[TABLES[0]]["evictions"] > 0


def per_table_reference(make_optimizers):
    """Eager PyTorch: the unconverted DLRM, each optimizer of
    `make_optimizers(model)` stepped after every backward."""
    model = make_dlrm()
    optimizers = make_optimizers(model)
    for dense, features, label in global_batches(STEPS):
        for o in optimizers:
            o.zero_grad()
        dlrm_loss(model, dense, features, label).backward()
        for o in optimizers:
            o.step()
    return model.state_dict()


def table(model, name):
    return model.sparse_arch.embedding_bag_collection.embedding_bags[name].weight


def dense_parameters(model):
    return [p for n, p in model.named_parameters() if "embedding_bags" not in n]


def train_split(model, rec, optimizer, mode=None):
    """One worker, two servers: the tables cached (or, `mode`, served)."""
    if mode is None:
        place_embedding_cache(rec.tables, cache_rows=CACHE_ROWS)
    batches = global_batches(STEPS)
    program = capture(model, rec.loss(dlrm_loss), optimizer, next(rec.shard(batches[:1], 0, 1)))
    run = split_run(rec, program, batches, mode or EmbeddingCacheMode(dense="worker"), 1)
    return program, run.state


def assert_close_to(state, expected):
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=1e-6, msg=key)


def test_per_table_and_dense_optimizers_train_as_eager_pytorch():
    model = make_dlrm()
    rec = TorchRecInput(model)
    optimizer = optim.PerParameter(
        (optim.Adagrad(lr=0.1), rec.tables["t_item"]),
        (optim.SGD(lr=0.3), rec.tables["t_user"]),
        torch.optim.Adam(dense_parameters(model), lr=0.01, foreach=False))
    program, state = train_split(model, rec, optimizer)
    assert [g.optimizer for g in program.param_groups] == ["Adagrad", "SGD", "Adam"]
    expected = per_table_reference(lambda m: [
        torch.optim.Adagrad([table(m, "t_item")], lr=0.1, foreach=False),
        torch.optim.SGD([table(m, "t_user")], lr=0.3),
        torch.optim.Adam(dense_parameters(m), lr=0.01, foreach=False)])
    assert_close_to(state, expected)


def test_torchrec_in_backward_optimizers_and_fused_params_train_as_eager_pytorch():
    def mark(m):
        apply_optimizer_in_backward(torch.optim.SGD, [table(m, "t_user")], {"lr": 0.3})
        apply_optimizer_in_backward(torch.optim.Adagrad, [table(m, "t_item")],
                                    {"lr": 0.1, "eps": 1e-8})
        return m

    model = mark(make_dlrm())
    rec = TorchRecInput(model)
    dense = torch.optim.Adagrad([p for _, p in in_backward_optimizer_filter(
        model.named_parameters())], lr=0.05, foreach=False)
    _, state = train_split(model, rec, dense, ParameterServerMode(dense="worker"))
    # Eager: the hooks step each table in its backward; the dense optimizer the rest.
    expected = per_table_reference(lambda m: [torch.optim.Adagrad(
        [p for _, p in in_backward_optimizer_filter(mark(m).named_parameters())], lr=0.05,
        foreach=False)])
    assert_close_to(state, expected)
    # FBGEMM's spelling of the same optimizers, through PerParameter.
    fused = from_fused_params({"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": 0.1})
    assert fused == optim.Adagrad(lr=0.1, eps=1e-8)
    model = make_dlrm()
    rec = TorchRecInput(model)
    _, fused_state = train_split(model, rec, optim.PerParameter(
        (fused, rec.tables["t_item"]),
        (from_fused_params({"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.3}),
         rec.tables["t_user"]),
        torch.optim.Adagrad(dense_parameters(model), lr=0.05, foreach=False)))
    assert_close_to(fused_state, expected)


def test_row_wise_adagrad_fbgemm_adam_and_bad_optimizers_are_refused_in_one_line():
    model = make_dlrm()
    rec = TorchRecInput(model)
    batch = next(rec.shard(global_batches(1), 0, 1))
    row_wise = "row-wise Adagrad \\(one accumulator per row.*not available in splitrun yet"
    with pytest.raises(CaptureError, match="torchrec.optim.RowWiseAdagrad: " + row_wise):
        capture(model, rec.loss(dlrm_loss), RowWiseAdagrad(rec.tables.parameters(), lr=0.1), batch)
    with pytest.raises(CaptureError, match="EmbOptimType.EXACT_ROWWISE_ADAGRAD: " + row_wise):
        from_fused_params({"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD})
    with pytest.raises(CaptureError, match="FBGEMM's ADAM adds eps after the bias correction"):
        from_fused_params({"optimizer": EmbOptimType.ADAM, "learning_rate": 0.1})
    with pytest.raises(CaptureError, match="fused_params key 'cache_load_factor' is not one"):
        from_fused_params({"optimizer": EmbOptimType.EXACT_SGD, "cache_load_factor": 0.2})
    wrapped = KeyedOptimizerWrapper(dict(model.named_parameters()),
                                    lambda params: torch.optim.SGD(params, lr=0.1))
    with pytest.raises(CaptureError, match="KeyedOptimizerWrapper is refused: pass the "
                                           "torch.optim optimizers it wraps"):
        capture(model, rec.loss(dlrm_loss), wrapped, batch)
    both = optim.PerParameter((optim.SGD(lr=0.1), rec.tables),
                              (optim.Adagrad(lr=0.1), rec.tables["t_user"]))
    with pytest.raises(CaptureError, match="parameter '.*t_user.weight' is in two optimizers "
                                           "\\(optim.PerParameter part 0 and .*part 1\\)"):
        capture(model, rec.loss(dlrm_loss), both, batch)
    apply_optimizer_in_backward(RowWiseAdagrad, [table(model, "t_item")], {"lr": 0.1})
    with pytest.raises(CaptureError, match="'.*t_item.weight''s in-backward optimizer "
                                           "RowWiseAdagrad: " + row_wise):
        capture(model, rec.loss(dlrm_loss), optim.SGD(lr=0.1), batch)
