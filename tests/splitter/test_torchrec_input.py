"""TorchRec models and inputs: a model with a `torchrec.EmbeddingBagCollection`
fed `KeyedJaggedTensor`s (jagged: samples have different numbers of ids)
trains in embedding-cache and parameter-server modes after one conversion
(`TorchRecInput`), equal to the unsplit step; its checkpoint loads back into
the TorchRec model; bad keys and ids are refused naming the key and table."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from splitrun.runtime import run_threaded
from splitrun.splitter import (
    CaptureError,
    Cluster,
    EmbeddingCacheMode,
    ParameterServerMode,
    TorchRecInput,
    capture,
    optim,
    place_embedding_cache,
    split_program,
)

torchrec = pytest.importorskip("torchrec")

ROWS = {"users": 300, "items": 200}
DIM = 4
BATCH = 16
NUM_STEPS = 8


class Clicks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sparse = torchrec.EmbeddingBagCollection(tables=[
            torchrec.EmbeddingBagConfig(name=f"{name}_table", embedding_dim=DIM,
                                        num_embeddings=rows, feature_names=[name])
            for name, rows in ROWS.items()], device=torch.device("cpu"))
        self.dense = nn.Linear(3, DIM)
        self.top = nn.Linear(3 * DIM, 1)

    def forward(self, dense, features):
        pooled = self.sparse(features)
        return self.top(torch.cat([self.dense(dense), pooled["users"], pooled["items"]], 1)
                        ).squeeze(1)


def click_loss(model, dense, features, label):
    return F.binary_cross_entropy_with_logits(model(dense, features), label)


def jagged_batches(num_steps, seed=0):
    """Each sample has 0-3 ids per feature (a different count every batch)."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(num_steps):
        lengths = torch.randint(0, 4, (2 * BATCH,), generator=generator)
        counts = lengths.reshape(2, BATCH).sum(1).tolist()
        values = torch.cat([torch.randint(0, rows, (n,), generator=generator)
                            for rows, n in zip(ROWS.values(), counts)])
        features = torchrec.KeyedJaggedTensor.from_lengths_sync(list(ROWS), values, lengths)
        batches.append((torch.randn(BATCH, 3, generator=generator), features,
                        torch.randint(0, 2, (BATCH,), generator=generator).float()))
    return batches


def converted(num_workers, *, cache_rows=None):
    torch.manual_seed(0)
    model = Clicks()
    rec = TorchRecInput(model)
    if cache_rows is not None:
        place_embedding_cache(rec.tables, cache_rows=cache_rows)
    batches = jagged_batches(NUM_STEPS)
    program = capture(model, rec.loss(click_loss), optim.SGD(lr=0.2),
                      next(rec.shard(batches[:1], 0, num_workers)))
    return model, rec, program, batches


def feeds_of(rec, batches):
    flat = list(rec.shard(batches, 0, 1))  # global batches; run_threaded shards them
    return lambda step: {f"batch.{i}": t for i, t in enumerate(flat[step])}


def unsplit_state():
    _, rec, program, batches = converted(1)
    return program.train_unsplit(NUM_STEPS, feeds_of(rec, batches))[1]


@pytest.mark.parametrize("mode", ["cache", "parameter_server"])
def test_a_torchrec_model_trains_as_the_unsplit_step_and_loads_back(mode):
    cache = mode == "cache"
    _, rec, program, batches = converted(1, cache_rows=48 if cache else None)
    chosen = EmbeddingCacheMode(dense="worker") if cache else ParameterServerMode(dense="worker")
    split = split_program(program, Cluster(1, 2), chosen)
    run = run_threaded(split, NUM_STEPS, feeds_of(rec, batches), recv_timeout_s=30)
    expected = unsplit_state()
    assert run.state.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(run.state[key], value), f"{key} differs"
    if cache:
        counters = next(iter(run.cache_counters.values()))
        assert all(c["evictions"] > 0 for c in counters.values())
    # The checkpoint's keys are the TorchRec model's: it loads back, strictly.
    fresh = Clicks()
    fresh.load_state_dict({k: v for k, v in run.state.items() if k in fresh.state_dict()})
    assert set(fresh.state_dict()) <= set(run.state)
    dense, features, label = batches[0]
    reference = Clicks()
    reference.load_state_dict({k: v for k, v in expected.items() if k in fresh.state_dict()})
    assert torch.equal(fresh(dense, features), reference(dense, features))


def test_two_workers_cut_jagged_batches_by_samples():
    _, rec, program, batches = converted(2, cache_rows=48)
    split = split_program(program, Cluster(2, 1), EmbeddingCacheMode(dense="worker"))
    shards = [list(rec.shard(batches, rank, 2)) for rank in range(2)]
    run = run_threaded(split, NUM_STEPS, recv_timeout_s=30, worker_batches=lambda rank, step: {
        f"batch.{i}": t for i, t in enumerate(shards[rank][step])})
    expected = unsplit_state()
    for key, value in expected.items():
        torch.testing.assert_close(run.state[key], value, rtol=0, atol=1e-5)


def test_bad_keys_and_ids_name_the_key_and_table():
    _, rec, _, batches = converted(1)
    dense, features, label = batches[0]
    values, lengths = features.values(), features.lengths()
    renamed = torchrec.KeyedJaggedTensor.from_lengths_sync(["users", "goods"], values, lengths)
    with pytest.raises(CaptureError, match="key 'goods' is pooled by no table.*'items' "
                                           "\\(table 'items_table'\\)"):
        rec.batch(dense, renamed, label)
    only = torchrec.KeyedJaggedTensor.from_lengths_sync(
        ["users"], values[:int(lengths[:BATCH].sum())], lengths[:BATCH])
    with pytest.raises(CaptureError, match="no key 'items', which table 'items_table' pools"):
        rec.batch(dense, only, label)
    too_big = values.clone()
    too_big[-1] = ROWS["items"]
    beyond = torchrec.KeyedJaggedTensor.from_lengths_sync(list(ROWS), too_big, lengths)
    with pytest.raises(CaptureError, match="key 'items' looks up id 200, but its table "
                                           "'items_table' has 200 rows"):
        rec.batch(dense, beyond, label)


def test_bad_jagged_tensors_are_refused_in_one_line_naming_the_culprit():
    _, rec, _, batches = converted(1)
    dense, features, label = batches[0]
    values, lengths = features.values(), features.lengths()
    longer = lengths.clone()
    longer[-1] += 2  # the last key's lengths run past the values
    bad = torchrec.KeyedJaggedTensor(keys=list(ROWS), values=values, lengths=longer)
    with pytest.raises(CaptureError, match=f"lengths sum to {values.numel() + 2} but it holds "
                                           f"{values.numel()} values: key 'items' .*runs past"):
        rec.batch(dense, bad, label)
    with pytest.raises(CaptureError, match="lengths sum to .*: key 'items'"):
        next(rec.shard([(dense, bad, label)], 0, 2))  # refused before it is cut
    with pytest.raises(CaptureError, match="KeyedJaggedTensor \\(part 1\\) holds 16 samples "
                                           "but its tensor part 0 has 14 rows"):
        rec.batch(dense[:14], features, label)
    with pytest.raises(CaptureError, match="a global batch's KeyedJaggedTensor \\(part 1\\) "
                                           "holds 16 samples but its tensor part 2 has 18 rows"):
        next(rec.shard([(dense, features, torch.cat([label, label[:2]]))], 0, 2))


class WeightedClicks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weighted = torchrec.EmbeddingBagCollection(tables=[
            torchrec.EmbeddingBagConfig(name="items_table", embedding_dim=DIM,
                                        num_embeddings=ROWS["items"], feature_names=["items"])],
            is_weighted=True, device=torch.device("cpu"))

    def forward(self, features):
        return self.weighted(features)["items"].sum(1)


def test_a_weighted_collection_without_weights_names_the_collection():
    rec = TorchRecInput(WeightedClicks())
    features = torchrec.KeyedJaggedTensor.from_lengths_sync(
        ["items"], torch.tensor([1, 2, 3]), torch.tensor([2, 1]))
    with pytest.raises(CaptureError, match="EmbeddingBagCollection 'weighted' is weighted "
                                           "\\(is_weighted=True.*has no weights"):
        rec.batch(features, torch.zeros(2))


def test_an_embedding_collection_is_refused_naming_it():
    class Sequences(Clicks):
        def __init__(self) -> None:
            super().__init__()
            self.history = torchrec.EmbeddingCollection(tables=[torchrec.EmbeddingConfig(
                name="g_table", embedding_dim=DIM, num_embeddings=10, feature_names=["g"])],
                device=torch.device("cpu"))

    with pytest.raises(CaptureError, match="module 'history' is a torchrec EmbeddingCollection "
                                           "\\(features 'g'.*not support yet"):
        TorchRecInput(Sequences())


def test_torchrec_batches_train_through_the_trainer_and_tables_go_by_their_names():
    from torchrec.datasets.utils import Batch

    torch.manual_seed(0)
    model = Clicks()
    rec = TorchRecInput(model)
    assert list(rec.tables) == ["users_table", "items_table"]
    place_embedding_cache(rec.tables["items_table"], cache_rows=48)  # one table, by its name
    batches = [Batch(dense_features=d, sparse_features=f, labels=y)
               for d, f, y in jagged_batches(NUM_STEPS)]
    program = capture(model, rec.loss(lambda m, b: click_loss(m, b.dense_features,
                                                              b.sparse_features, b.labels)),
                      optim.SGD(lr=0.2), next(rec.shard(batches[:1], 0, 2)))
    assert list(program.cached_tables) == ["sparse.embedding_bags.items_table.weight"]
    assert program.batch_input is rec
    split = split_program(program, Cluster(2, 1), EmbeddingCacheMode(dense="worker"))
    # The trainer cuts and converts the Batch objects itself (run_threaded's
    # workers call trainer.shard on the global batches).
    run = run_threaded(split, NUM_STEPS, lambda step: batches[step], recv_timeout_s=30)
    expected = unsplit_state()
    for key, value in expected.items():
        torch.testing.assert_close(run.state[key], value, rtol=0, atol=1e-5)


def test_the_converted_model_pools_a_shared_table_as_torchrec_does():
    def build():
        torch.manual_seed(0)
        return torchrec.EmbeddingBagCollection(tables=[torchrec.EmbeddingBagConfig(
            name="t", embedding_dim=DIM, num_embeddings=20, feature_names=["a", "b"])],
            device=torch.device("cpu"))

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.sparse = build()

        def forward(self, features):
            return self.sparse(features)

    holder = Holder()
    rec = TorchRecInput(holder)
    features = torchrec.KeyedJaggedTensor.from_lengths_sync(  # keys in another order
        ["b", "a"], torch.tensor([1, 2, 3, 4, 5, 19]), torch.tensor([2, 0, 1, 3]))
    expected = build()(features)
    for forward in (holder(features), rec.loss(lambda m, f: m(f))(holder,
                                                                    *rec.batch(features))):
        assert forward.keys() == expected.keys() == ["a", "b"]
        assert torch.equal(forward.values(), expected.values())


def test_a_table_name_two_collections_use_is_keyed_by_its_collection():
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = (torchrec.EmbeddingBagCollection(tables=[
                torchrec.EmbeddingBagConfig(name=name, embedding_dim=DIM, num_embeddings=10,
                                            feature_names=[feature])
                for name, feature in tables], device=torch.device("cpu"))
                for tables in ((("t", "a"), ("u", "b")), (("t", "c"),)))

    model = Two()
    rec = TorchRecInput(model)
    assert list(rec.tables) == ["first__t", "u", "second__t"]
    assert rec.tables["second__t"] is model.second.embedding_bags["t"]
