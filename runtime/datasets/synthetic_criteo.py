"""A synthetic click log in the Criteo display-advertising format, for tests
and offline runs (see `criteo.py` for the format).

Each categorical feature t draws popularity ranks from a Zipf law over its
`cardinalities[t]` distinct values; rank r is written as a fixed 8-digit
hexadecimal token (as the real logs' hashed values look). The integer
features are log-normal counts (I2 may be negative, as in the real logs).
Labels come from a hidden logistic model: a random effect per value of the
first `num_informative` categorical features plus a linear effect of the
counts, so there is something to learn. Fields go missing independently with
probability `missing_rate`. The samples follow from `seed`, the hidden model
from `hidden_seed`: two files with one hidden seed and two sample seeds are a
training set and a held-out set of the same problem.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .criteo import NUM_CATEGORICAL, NUM_INTEGER, CriteoFormatError

__all__ = ["SyntheticCriteo", "write_synthetic_criteo", "category_token"]

# Lines are built and written this many at a time.
_CHUNK = 8192
# The hidden model: bias (a click rate near 30 %) and how far the logits spread.
_BIAS = -1.0
_CATEGORY_SCALE = 2.0
_DENSE_SCALE = 1.0


@dataclass(frozen=True)
class SyntheticCriteo:
    """What `write_synthetic_criteo` wrote."""

    path: str
    num_samples: int
    cardinalities: tuple[int, ...]
    click_rate: float
    # The hidden model's logit of each line (with keep_logits=True): what the
    # best possible model would score.
    logits: np.ndarray | None = field(default=None, repr=False, compare=False)


def category_token(feature: int, rank: int | np.ndarray) -> np.ndarray:
    """The 32-bit token (as an integer) written for popularity rank `rank` of
    categorical feature `feature` (0-based)."""
    z = (np.uint64(feature) << np.uint64(32)) | np.asarray(rank, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (z ^ (z >> np.uint64(31))) & np.uint64(0xFFFFFFFF)


def _zipf_ranks(rng: np.random.Generator, cdf: np.ndarray, count: int) -> np.ndarray:
    return np.minimum(np.searchsorted(cdf, rng.random(count)), cdf.size - 1)


def write_synthetic_criteo(path: str | os.PathLike, num_samples: int, *,
                           cardinalities: Sequence[int] | int = 10_000, zipf: float = 1.05,
                           missing_rate: float = 0.02, seed: int = 0, hidden_seed: int = 0,
                           num_informative: int = NUM_CATEGORICAL,
                           keep_logits: bool = False) -> SyntheticCriteo:
    """Write `num_samples` lines to `path` (see the module docstring)."""
    if isinstance(cardinalities, int):
        cardinalities = (cardinalities,) * NUM_CATEGORICAL
    cardinalities = tuple(cardinalities)
    if len(cardinalities) != NUM_CATEGORICAL or min(cardinalities) < 1:
        raise CriteoFormatError(f"cardinalities: one positive count per categorical feature "
                                f"({NUM_CATEGORICAL}), got {cardinalities}")
    if not 0 <= missing_rate < 1:
        raise CriteoFormatError(f"missing_rate must be in [0, 1), got {missing_rate}")
    if not 1 <= num_informative <= NUM_CATEGORICAL:
        raise CriteoFormatError(f"num_informative must be in 1..{NUM_CATEGORICAL}, got "
                                f"{num_informative}")
    rng = np.random.default_rng([seed, 0])
    hidden = np.random.default_rng([hidden_seed, 1])
    effects = [hidden.standard_normal(n) for n in cardinalities[:num_informative]]
    dense_weight = hidden.standard_normal(NUM_INTEGER) / math.sqrt(NUM_INTEGER)
    dense_mean = hidden.uniform(0.0, 3.0, NUM_INTEGER)
    cdfs = []
    for n in cardinalities:
        weights = np.arange(1, n + 1, dtype=np.float64) ** -zipf
        cdfs.append(np.cumsum(weights) / weights.sum())
    tokens = [np.char.mod("%08x", category_token(t, np.arange(n)))
              for t, n in enumerate(cardinalities)]
    clicks = 0
    kept: list[np.ndarray] = []
    path = os.fspath(path)
    with open(path, "w", encoding="ascii", newline="\n") as out:
        for begin in range(0, num_samples, _CHUNK):
            count = min(_CHUNK, num_samples - begin)
            normal = rng.standard_normal((count, NUM_INTEGER))
            counts = np.floor(np.expm1(np.maximum(normal + dense_mean, 0.0))).astype(np.int64)
            counts[:, 1] -= rng.integers(0, 4, count) * (rng.random(count) < 0.1)
            logits = _BIAS + _DENSE_SCALE * (normal @ dense_weight)
            ranks = [_zipf_ranks(rng, cdf, count) for cdf in cdfs]
            logits += _CATEGORY_SCALE * sum(e[r] for e, r in zip(effects, ranks)) / math.sqrt(
                num_informative)
            if keep_logits:
                kept.append(logits)
            labels = (rng.random(count) < 1.0 / (1.0 + np.exp(-logits))).astype(np.int64)
            clicks += int(labels.sum())
            missing = rng.random((count, NUM_INTEGER + NUM_CATEGORICAL)) < missing_rate
            columns = [labels.astype(str)]
            for i in range(NUM_INTEGER):
                columns.append(np.where(missing[:, i], "", counts[:, i].astype(str)))
            for t in range(NUM_CATEGORICAL):
                columns.append(np.where(missing[:, NUM_INTEGER + t], "", tokens[t][ranks[t]]))
            out.write("".join("\t".join(fields) + "\n" for fields in zip(*columns)))
    return SyntheticCriteo(path, num_samples, cardinalities,
                           clicks / num_samples if num_samples else 0.0,
                           np.concatenate(kept) if keep_logits and kept else None)
