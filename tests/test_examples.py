"""The examples the README points at, run through the real launcher with small
settings: each trains and reports what it promises."""

import json
import re

import pytest
from cluster import REPO

pytestmark = pytest.mark.slow

EXAMPLES = REPO / "examples"


def test_ps_train_reaches_its_accuracy(local_cluster):
    # 3 epochs reach 0.9389 held-out (6 reached 0.9583, 2 only 0.9028); the run
    # is seeded, and repeated runs gave the same accuracy.
    proc = local_cluster.run(EXAMPLES / "ps_train.py", "--epochs", 3, "--min-accuracy", 0.9,
                             workers=2, servers=2)
    accuracy = float(re.search(r"held-out accuracy: ([0-9.]+)", proc.output()).group(1))
    assert accuracy >= 0.9
    # scikit-learn, which the script imports first, imported once for every process
    assert re.search(r"template \(pid \d+\) imported .*sklearn\.datasets", proc.output())


def test_pipeline_split_equals_the_unsplit_step(local_cluster):
    proc = local_cluster.run(EXAMPLES / "pipeline_split.py", "--steps", 15, workers=3)
    assert "final parameters identical to the unsplit run: True" in proc.output()


def test_recsys_cache_learns_and_caches(local_cluster, tmp_path):
    proc = local_cluster.run(EXAMPLES / "recsys_cache.py", "--data-dir", tmp_path / "data",
                             "--tables", 3, "--rows", 20000,
                             "--steps", 60, "--batch-size", 512, "--cache-fraction", 0.1,
                             "--policy", "lfu", "--eval-samples", 20000, "--json",
                             workers=2, servers=2)
    line = next(text for text in proc.lines if "RESULT " in text)
    result = json.loads(line.split("RESULT ", 1)[1])
    # Better than predicting the click rate, short of the labels' own model.
    assert result["log_loss"] < result["base_rate_entropy"]
    assert 0.6 < result["auc"] < result["hidden_model_auc"]
    for table in result["cache"].values():
        assert table["evictions"] > 0 and 0.1 < table["hit_rate"] < 1


def test_recsys_cache_in_torchrec_form_learns_and_loads_back(local_cluster, tmp_path):
    """The TorchRec form (an EmbeddingBagCollection fed KeyedJaggedTensors)
    through `TorchRecInput`, 2 workers (MLPs all-reduced between them); the
    held-out scores come from an unconverted TorchRec model loaded with the
    final state."""
    proc = local_cluster.run(EXAMPLES / "recsys_cache.py", "--data-dir", tmp_path / "data",
                             "--model", "torchrec", "--tables", 3, "--rows", 20000,
                             "--steps", 60, "--batch-size", 512, "--cache-fraction", 0.1,
                             "--eval-samples", 20000, "--json", workers=2, servers=2)
    line = next(text for text in proc.lines if "RESULT " in text)
    result = json.loads(line.split("RESULT ", 1)[1])
    assert result["log_loss"] < result["base_rate_entropy"]
    assert 0.6 < result["auc"] < result["hidden_model_auc"]
    assert set(result["cache"]) == {f"tables.embedding_bags.table_{i}.weight" for i in range(3)}
