"""The Criteo-format reader and its synthetic generator: fields, missing
values, hashing that every process agrees on, and workers that together read
each row exactly once."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from splitrun.runtime.datasets import (
    NUM_CATEGORICAL,
    NUM_FIELDS,
    NUM_INTEGER,
    CriteoFile,
    CriteoFormatError,
    CriteoSchema,
    hash_categories,
    parse_lines,
    write_synthetic_criteo,
)
from splitrun.runtime.job.data import ShardedSource, shard_batch, shard_batches

# Bounds a subprocess that hashes a few values (it imports torch).
SUBPROCESS_TIMEOUT_S = 120
ROWS = 1000
SCHEMA = CriteoSchema((ROWS,) * NUM_CATEGORICAL)


def line(label="1", integers=None, categories=None) -> bytes:
    integers = [str(i) for i in range(NUM_INTEGER)] if integers is None else integers
    categories = ([f"{0xabc000 + t:08x}" for t in range(NUM_CATEGORICAL)]
                  if categories is None else categories)
    return ("\t".join([label, *integers, *categories]) + "\n").encode()


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    path = tmp_path_factory.mktemp("criteo") / "train.tsv"
    # 1000 lines: 15 global batches of 64 and a partial one of 40.
    return write_synthetic_criteo(path, 1000, cardinalities=ROWS, missing_rate=0.05, seed=7)


def test_fields_and_missing_values_parse_as_documented():
    integers = ["5", "", "-2", *["0"] * (NUM_INTEGER - 3)]
    categories = ["", "ff", *[f"{t:x}" for t in range(NUM_CATEGORICAL - 2)]]
    dense, *ids, label = parse_lines([line("0", integers, categories), line()], SCHEMA)
    assert dense.shape == (2, NUM_INTEGER) and dense.dtype == torch.float32
    assert len(ids) == NUM_CATEGORICAL and all(i.shape == (2, 1) for i in ids)
    assert label.tolist() == [0.0, 1.0]
    # log(1 + max(x, 0)); missing and negative counts are 0.
    assert dense[0, 0].item() == pytest.approx(np.log(6))
    assert dense[0, 1].item() == 0.0 and dense[0, 2].item() == 0.0
    assert ids[0][0].item() == 0, "a missing category is row 0"
    assert ids[1][0].item() == hash_categories([0xff], 1, ROWS)[0] != 0
    present = torch.cat(ids[1:]).reshape(-1)
    assert bool(((present >= 1) & (present < ROWS)).all())


def test_bad_lines_are_refused_naming_the_line_and_field():
    short = b"\t".join(line().split(b"\t")[:-1]) + b"\n"
    with pytest.raises(CriteoFormatError, match=r"day_0 line 2 has 39 tab-separated fields; "
                                                r"the Criteo format has 40"):
        parse_lines([line(), short], SCHEMA, where="day_0")
    categories = ["zz!", *["1"] * (NUM_CATEGORICAL - 1)]
    with pytest.raises(CriteoFormatError, match=r"line 1: field 15 \(C1\) is b'zz!'; expected "
                                                r"a hexadecimal value"):
        parse_lines([line(categories=categories)], SCHEMA)
    with pytest.raises(CriteoFormatError, match=r"field 1 \(label\) is b''; expected 0 or 1"):
        parse_lines([line(label="")], SCHEMA)
    with pytest.raises(CriteoFormatError, match=r"table 3 has 1 rows"):
        CriteoSchema((10, 10, 10, 1))


def test_hashing_is_the_same_in_every_process():
    tokens = [0, 1, 0xffffffff, 0x12345678, -1, 42]
    script = ("import sys; from splitrun.runtime.datasets import hash_categories; "
              "print([hash_categories([0, 1, 0xffffffff, 0x12345678, -1, 42], t, 1000 + t, "
              "seed=3).tolist() for t in range(26)])")
    outputs = []
    for hash_seed in ("1", "2"):  # Python's own str hash differs between these
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                                text=True, timeout=SUBPROCESS_TIMEOUT_S, check=True)
        outputs.append(result.stdout.strip())
    here = str([hash_categories(tokens, t, 1000 + t, seed=3).tolist() for t in range(26)])
    assert outputs[0] == outputs[1] == here
    # Tables and seeds hash differently; values spread over the rows.
    assert not np.array_equal(hash_categories(tokens, 0, 1000), hash_categories(tokens, 1, 1000))
    assert not np.array_equal(hash_categories(tokens, 0, 1000, seed=1),
                              hash_categories(tokens, 0, 1000))
    spread = hash_categories(np.arange(20000), 0, 100)
    assert set(np.unique(spread).tolist()) == set(range(1, 100))


def test_generated_file_has_the_format_and_missing_values(generated):
    with open(generated.path, "rb") as source:
        lines = source.read().splitlines()
    assert len(lines) == 1000
    fields = [ln.split(b"\t") for ln in lines]
    assert {len(f) for f in fields} == {NUM_FIELDS}
    assert {f[0] for f in fields} == {b"0", b"1"}
    missing_int = sum(f[i] == b"" for f in fields for i in range(1, 1 + NUM_INTEGER))
    missing_cat = sum(f[i] == b"" for f in fields for i in range(1 + NUM_INTEGER, NUM_FIELDS))
    assert missing_int > 0 and missing_cat > 0
    assert all(len(f[i]) in (0, 8) for f in fields for i in range(1 + NUM_INTEGER, NUM_FIELDS))
    assert 0.1 < generated.click_rate < 0.9
    # Zipf categories: the hottest value of C1 recurs far more than uniform would.
    counts = np.unique([f[1 + NUM_INTEGER] for f in fields], return_counts=True)[1]
    assert counts.max() > 20 * 1000 / ROWS


def _read_all(source):
    return [tuple(t.clone() for t in batch) for batch in source]


@pytest.mark.parametrize("drop_last", [True, False])
def test_two_workers_together_read_each_row_once_per_epoch(generated, drop_last):
    whole = CriteoFile(generated.path, SCHEMA, 64, drop_last=drop_last)
    everything = _read_all(whole)
    assert len(everything) == (15 if drop_last else 16)
    assert sum(b[0].shape[0] for b in everything) == (960 if drop_last else 1000)
    shards = [_read_all(whole.worker_shard(rank, 2)) for rank in range(2)]
    assert [len(s) for s in shards] == [len(everything)] * 2
    for index, batch in enumerate(everything):
        first, second = shards[0][index], shards[1][index]
        if index < 15:
            # Each worker holds only its half: the rows shard_batch gives it.
            assert first[0].shape[0] == second[0].shape[0] == 32
            for rank, part in enumerate((first, second)):
                for got, expected in zip(part, shard_batch(batch, rank, 2)):
                    assert torch.equal(got, expected)
        for got_a, got_b, expected in zip(first, second, batch):
            assert torch.equal(torch.cat([got_a, got_b]), expected)


def test_epochs_and_loader_processes_read_the_same_rows(generated):
    one = _read_all(CriteoFile(generated.path, SCHEMA, 100))
    two_epochs = _read_all(CriteoFile(generated.path, SCHEMA, 100, epochs=2))
    assert len(two_epochs) == 2 * len(one)
    for a, b in zip(two_epochs, one + one):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    loaded = _read_all(CriteoFile(generated.path, SCHEMA, 100, loader_workers=2)
                       .worker_shard(1, 2))
    assert len(loaded) == len(one)
    for got, batch in zip(loaded, one):
        assert all(torch.equal(x, y) for x, y in zip(got, shard_batch(batch, 1, 2)))


def test_shard_batches_asks_a_sharded_source_and_slices_in_memory_batches(generated):
    source = CriteoFile(generated.path, CriteoSchema((50, 60)), 64)
    assert isinstance(source, ShardedSource)
    got = next(iter(shard_batches(source, 1, 2)))
    assert len(got) == 4 and got[0].shape == (32, NUM_INTEGER)
    assert int(got[2].max()) < 60, "only the first two categorical features, hashed into 60"
    batches = [(torch.arange(8).reshape(4, 2),)]
    assert torch.equal(next(iter(shard_batches(batches, 1, 2)))[0], batches[0][0][2:])


def test_samples_follow_the_seed_and_labels_the_hidden_seed(tmp_path):
    """So a training and a held-out file (two seeds, one hidden seed) are two
    samples of one problem."""
    common = {"cardinalities": 50, "num_informative": 2, "keep_logits": True}
    base = write_synthetic_criteo(tmp_path / "a.tsv", 300, seed=1, hidden_seed=5, **common)
    other_model = write_synthetic_criteo(tmp_path / "b.tsv", 300, seed=1, hidden_seed=6,
                                         **common)
    other_samples = write_synthetic_criteo(tmp_path / "c.tsv", 300, seed=2, hidden_seed=5,
                                           **common)
    assert base.logits.shape == (300,)
    features = [[ln.split(b"\t")[1 + NUM_INTEGER:]
                 for ln in (tmp_path / name).read_bytes().splitlines()]
                for name in ("a.tsv", "b.tsv", "c.tsv")]
    assert features[0] == features[1], "the hidden model does not change the categories"
    assert not np.allclose(base.logits, other_model.logits)
    assert features[0] != features[2]
    assert not np.allclose(base.logits, other_samples.logits)
    # Only C1 and C2 are informative: their values and the counts fix the logit.
    again = write_synthetic_criteo(tmp_path / "d.tsv", 300, seed=1, hidden_seed=5,
                                   **{**common, "missing_rate": 0.5})
    assert np.allclose(again.logits, base.logits), "missing fields hide values, not effects"
