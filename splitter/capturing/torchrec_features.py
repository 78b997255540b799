"""TorchRec's sparse inputs as the captured step takes them: one lookup per
table.

A `KeyedJaggedTensor` holds, per feature key, each sample's ids. A table of an
`EmbeddingBagCollection` pools one or more features (`EmbeddingBagConfig(
feature_names=["item", "item_hist"])`: one table, one set of rows). Here every
table becomes one lookup: the ids of all its features, feature after feature,
and one bag per sample and feature (`offsets`: each bag's start, and the end).
So a table read by several features is looked up once a step, as FBGEMM's
table-batched kernels look it up, its row gradients summed over every
feature's lookups, and every mode trains it like a table of one feature.

Before that the jagged tensor is checked, each problem one `CaptureError` line
naming the key: its lengths against its values, its keys against the tables,
every id against its table's rows, weights where a collection weighs its ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import CaptureError

__all__ = ["TableInput", "CapturedFeatures", "check_jagged", "table_lookups", "samples",
           "num_samples", "check_lengths", "is_jagged", "is_batch", "batch_parts", "make_batch"]


@dataclass(frozen=True)
class TableInput:
    """One table of a converted collection, as its batches feed it."""

    key: str                    # its key in `rec.tables` (TorchRec's table name)
    name: str                   # TorchRec's table name (`EmbeddingBagConfig.name`)
    collection: str             # the collection's module path, for messages
    features: tuple[str, ...]   # the features it pools, in the collection's order
    num_rows: int
    is_weighted: bool           # its collection weighs each id (`is_weighted=True`)


@dataclass(frozen=True)
class CapturedFeatures:
    """A `KeyedJaggedTensor` as the captured step sees it, per table (by its
    key in `rec.tables`): the ids of every feature the table pools, feature
    after feature (flat), each bag's start (one bag per sample and feature,
    in that order) and the end, and, for a weighted collection, each id's
    weight."""

    ids: dict[str, torch.Tensor]
    offsets: dict[str, torch.Tensor]
    weights: dict[str, torch.Tensor] | None = None

    def keys(self) -> list[str]:
        return list(self.ids)


def is_jagged(value) -> bool:
    from torchrec import KeyedJaggedTensor

    return isinstance(value, KeyedJaggedTensor)


def is_batch(value) -> bool:
    """TorchRec's `Batch` (torchrec.datasets.utils): dense_features, a
    KeyedJaggedTensor of sparse_features, labels."""
    from torchrec.datasets.utils import Batch

    return isinstance(value, Batch)


def batch_parts(batch) -> tuple:
    """A TorchRec `Batch` as its three parts (dense, sparse, labels)."""
    return batch.dense_features, batch.sparse_features, batch.labels


def make_batch(dense, sparse, labels):
    """The parts back as a TorchRec `Batch` (its sparse part may be `CapturedFeatures`)."""
    from torchrec.datasets.utils import Batch

    return Batch(dense_features=dense, sparse_features=sparse, labels=labels)


def num_samples(kjt) -> int:
    return int(kjt.stride())


def check_jagged(kjt, tables: Sequence[TableInput], where: str = "KeyedJaggedTensor") -> None:
    """Refuse, in one line naming the key, a jagged tensor the tables cannot
    take: lengths that do not cover its values, keys no table pools or a key
    missing, ids beyond their table, no weights where a collection weighs."""
    keys = list(kjt.keys())
    check_lengths(kjt, where)
    pooled = {feature: table for table in tables for feature in table.features}
    for key in keys:
        if key not in pooled:
            taken = ", ".join(f"{f!r} (table {t.name!r})" for f, t in pooled.items())
            raise CaptureError(f"{where} key {key!r} is pooled by no table; the tables take "
                               f"{taken}")
    for feature, table in pooled.items():
        if feature not in keys:
            raise CaptureError(f"{where} has no key {feature!r}, which table {table.name!r} "
                               f"pools; its keys: {', '.join(map(repr, keys))}")
    _check_weighted(kjt, tables, where)
    jagged = kjt.to_dict()
    for feature, table in pooled.items():
        ids = jagged[feature].values()
        if ids.numel():
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= table.num_rows:
                bad = low if low < 0 else high
                raise CaptureError(
                    f"{where} key {feature!r} looks up id {bad}, but its table "
                    f"{table.name!r} has {table.num_rows} rows (ids 0-{table.num_rows - 1})")


def _check_weighted(kjt, tables: Sequence[TableInput], where: str) -> None:
    weighted = [table for table in tables if table.is_weighted]
    if weighted and kjt.weights_or_none() is None:
        collections = sorted({table.collection for table in weighted})
        raise CaptureError(
            f"EmbeddingBagCollection {', '.join(map(repr, collections))} is weighted "
            f"(is_weighted=True: each id's row is scaled by its weight) but the {where} has "
            f"no weights; build it with weights= (one per id), or the collection with "
            f"is_weighted=False")


def check_lengths(kjt, where: str = "KeyedJaggedTensor") -> None:
    """Refuse lengths that do not cover the values (naming the key), and a
    stride that is not one per key."""
    keys = list(kjt.keys())
    if kjt.variable_stride_per_key():
        raise CaptureError(f"{where} has a different number of samples per key (variable "
                           f"stride per key); TorchRecInput takes the same samples for every "
                           f"key")
    lengths, values = kjt.lengths(), kjt.values()
    stride = num_samples(kjt)
    if lengths.numel() != len(keys) * stride:
        raise CaptureError(f"{where} has {lengths.numel()} lengths for {len(keys)} keys of "
                           f"{stride} samples (expected {len(keys) * stride}: one per key and "
                           f"sample)")
    per_key = lengths.reshape(len(keys), stride).to(torch.int64)
    counts = per_key.sum(1).tolist()
    for key, row in zip(keys, per_key):
        if row.numel() and int(row.min()) < 0:
            raise CaptureError(f"{where} key {key!r} has a negative length "
                               f"({int(row.min())}); a sample holds 0 or more ids")
    total = sum(counts)
    if total != values.numel():
        each = ", ".join(f"{key} {n}" for key, n in zip(keys, counts))
        end, culprit = 0, None
        for key, n in zip(keys, counts):
            if culprit is None and end + n > values.numel():
                culprit = (f"key {key!r} (ids at values[{end}:{end + n}]) runs past its "
                           f"{values.numel()} values")
            end += n
        if culprit is None:
            culprit = (f"{values.numel() - total} values belong to no key (the last, "
                       f"{keys[-1]!r}, ends at {total})")
        raise CaptureError(f"{where}'s lengths sum to {total} but it holds {values.numel()} "
                           f"values: {culprit}; each key's lengths sum: {each}")
    weights = kjt.weights_or_none()
    if weights is not None and weights.numel() != values.numel():
        raise CaptureError(f"{where} holds {values.numel()} values but {weights.numel()} "
                           f"weights; give one weight per id")


def table_lookups(kjt, tables: Sequence[TableInput]) -> CapturedFeatures:
    """Per table, its features' ids one after another and each bag's start
    (and the end): one lookup per table (see the module docstring). A table
    of one feature takes that feature's ids and offsets as they are."""
    _check_weighted(kjt, tables, "KeyedJaggedTensor")
    jagged = kjt.to_dict()
    ids, offsets, weights = {}, {}, {}
    for table in tables:
        parts = [jagged[feature] for feature in table.features]
        if len(parts) == 1:
            ids[table.key] = parts[0].values().to(torch.int64)
            offsets[table.key] = parts[0].offsets().to(torch.int64)
        else:
            ids[table.key] = torch.cat([p.values() for p in parts]).to(torch.int64)
            lengths = torch.cat([p.lengths() for p in parts]).to(torch.int64)
            offsets[table.key] = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])
        if table.is_weighted:
            weights[table.key] = (parts[0].weights() if len(parts) == 1
                                  else torch.cat([p.weights() for p in parts]))
    return CapturedFeatures(ids, offsets, weights or None)


def samples(kjt, start: int, end: int):
    """Samples [start, end) of every key of `kjt`."""
    from torchrec import KeyedJaggedTensor

    jagged = kjt.to_dict()
    values, lengths, weights = [], [], []
    for key in kjt.keys():
        offsets = jagged[key].offsets()
        first, last = int(offsets[start]), int(offsets[end])
        values.append(jagged[key].values()[first:last])
        lengths.append(jagged[key].lengths()[start:end])
        if kjt.weights_or_none() is not None:
            weights.append(jagged[key].weights()[first:last])
    return KeyedJaggedTensor.from_lengths_sync(
        kjt.keys(), torch.cat(values), torch.cat(lengths),
        weights=torch.cat(weights) if weights else None)
