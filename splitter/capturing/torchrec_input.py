"""TorchRec models and inputs, in one conversion step.

A model built with `torchrec.EmbeddingBagCollection` and fed
`KeyedJaggedTensor`s cannot be captured as it is: the collection's lookup
runs FBGEMM's jagged operators, whose output shapes depend on the data.
`TorchRecInput(model)` converts it once, in place:

- every `EmbeddingBagCollection` in the model becomes a
  `CapturedEmbeddingBagCollection` holding the collection's own
  `nn.EmbeddingBag`s (the same parameters, so the same `state_dict` keys:
  a checkpoint loads back into the TorchRec model); each feature is pooled
  by its table's bag, and the result is TorchRec's `KeyedTensor`, as the
  collection returns it. The bags are sparse (parameter-server mode serves
  them) and can be cached (`place_embedding_cache(rec.tables, ...)`);
- `rec.batch(dense, kjt, label)` turns each `KeyedJaggedTensor` of a batch
  into tensors, per feature its ids and offsets (checked: every feature of
  the tables is there and no other, every id is a row of its table; an error
  names the key and the table), and `rec.loss(loss_fn)` is the loss the step
  is captured with: it puts the features back together, as
  `CapturedFeatures`, and calls `loss_fn(model, dense, features, label)`;
- `rec.shard(global_batches, rank, num_workers)` gives worker `rank` its
  samples of every global batch (a jagged batch is cut by samples, not by
  ids), converted.

    rec = TorchRecInput(model)
    place_embedding_cache(rec.tables, cache_rows=...)
    program = capture(model, rec.loss(loss_fn), optimizer,
                      next(rec.shard(batches[:1], 0, num_workers)))
    trainer = job.start(program, EmbeddingCacheMode(dense="worker"))
    for outputs in trainer.run(rec.shard(batches, job.rank, num_workers) if job.is_worker
                               else []): ...
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import CaptureError

__all__ = ["TorchRecInput", "CapturedEmbeddingBagCollection", "CapturedFeatures"]


@dataclass(frozen=True)
class CapturedFeatures:
    """A `KeyedJaggedTensor` as the captured step sees it: per feature key,
    its ids (flat) and offsets (each sample's first id, and the end)."""

    ids: dict[str, torch.Tensor]
    offsets: dict[str, torch.Tensor]
    weights: dict[str, torch.Tensor] | None = None

    def keys(self) -> list[str]:
        return list(self.ids)


class CapturedEmbeddingBagCollection(nn.Module):
    """An `EmbeddingBagCollection`'s tables as splitrun captures them: its own
    `nn.EmbeddingBag`s (`embedding_bags`, the same parameters), each feature
    pooled by its table, returned as TorchRec's `KeyedTensor`."""

    def __init__(self, collection: nn.Module) -> None:
        super().__init__()
        self.embedding_bags = collection.embedding_bags
        self.configs = list(collection.embedding_bag_configs())
        self.is_weighted = bool(collection.is_weighted())
        # feature -> its table's name, in the collection's output order.
        self.feature_tables = {feature: config.name for config in self.configs
                               for feature in config.feature_names}
        for bag in self.embedding_bags.values():
            bag.sparse = True  # row-wise gradients: servers and caches take them

    def forward(self, features) -> object:
        from torchrec import KeyedTensor

        if not isinstance(features, CapturedFeatures):
            features = features_of(features)
        pooled, dims = [], []
        for feature, table in self.feature_tables.items():
            bag = self.embedding_bags[table]
            weights = None if features.weights is None else features.weights[feature]
            offsets = features.offsets[feature]  # each sample's first id, and the end
            pooled.append(bag(features.ids[feature],
                              offsets if bag.include_last_offset else offsets[:-1],
                              per_sample_weights=weights))
            dims.append(bag.embedding_dim)
        return KeyedTensor(keys=list(self.feature_tables), length_per_key=dims,
                           values=torch.cat(pooled, 1))


def features_of(kjt) -> CapturedFeatures:
    """A `KeyedJaggedTensor` as `CapturedFeatures` (per key: ids, offsets)."""
    jagged = kjt.to_dict()
    weights = None
    if kjt.weights_or_none() is not None:
        weights = {key: value.weights() for key, value in jagged.items()}
    return CapturedFeatures({key: value.values().to(torch.int64) for key, value in jagged.items()},
                            {key: value.offsets().to(torch.int64) for key, value in jagged.items()},
                            weights)


class TorchRecInput:
    """One TorchRec model, converted for capture (see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        from torchrec import EmbeddingBagCollection

        self.model = model
        self.collections: list[CapturedEmbeddingBagCollection] = []
        for name, module in list(model.named_modules()):
            if isinstance(module, EmbeddingBagCollection):
                captured = CapturedEmbeddingBagCollection(module)
                _replace(model, name, captured)
                self.collections.append(captured)
        if not self.collections:
            raise CaptureError(f"{type(model).__name__} holds no torchrec "
                               f"EmbeddingBagCollection to convert")
        self.feature_tables: dict[str, tuple[str, int]] = {}  # feature -> (table, rows)
        for collection in self.collections:
            rows = {c.name: c.num_embeddings for c in collection.configs}
            for feature, table in collection.feature_tables.items():
                self.feature_tables[feature] = (table, rows[table])
        self.is_weighted = any(c.is_weighted for c in self.collections)
        self._layout: tuple[bool, ...] | None = None  # which batch arguments are features

    @property
    def tables(self) -> nn.ModuleList:
        """Every table's `nn.EmbeddingBag` (for `place_embedding_cache`)."""
        return nn.ModuleList(bag for c in self.collections for bag in c.embedding_bags.values())

    # -- batches --

    def batch(self, *args) -> tuple[torch.Tensor, ...]:
        """A batch as capture and the trainer take it: each
        `KeyedJaggedTensor` argument becomes, per feature (in the tables'
        order), its ids and offsets (and weights, for a weighted collection)."""
        from torchrec import KeyedJaggedTensor

        layout = tuple(isinstance(a, KeyedJaggedTensor) for a in args)
        if not any(layout):
            raise CaptureError("TorchRecInput.batch: no KeyedJaggedTensor among the batch's "
                               f"{len(args)} arguments")
        if self._layout is not None and layout != self._layout:
            raise CaptureError(f"TorchRecInput.batch: this batch's arguments are laid out "
                               f"{_describe(layout)}, the captured step's "
                               f"{_describe(self._layout)}")
        self._layout = layout
        flat: list[torch.Tensor] = []
        for arg, is_features in zip(args, layout):
            if not is_features:
                flat.append(arg)
                continue
            features = self._checked(arg)
            for feature in self.feature_tables:
                flat += [features.ids[feature], features.offsets[feature]]
                if self.is_weighted:
                    flat.append(features.weights[feature])
        return tuple(flat)

    def _checked(self, kjt) -> CapturedFeatures:
        keys = list(kjt.keys())
        for key in keys:
            if key not in self.feature_tables:
                taken = ", ".join(f"{f!r} (table {t!r})"
                                  for f, (t, _) in self.feature_tables.items())
                raise CaptureError(f"KeyedJaggedTensor key {key!r} is pooled by no table; the "
                                   f"tables take {taken}")
        for feature, (table, _) in self.feature_tables.items():
            if feature not in keys:
                raise CaptureError(f"KeyedJaggedTensor has no key {feature!r}, which table "
                                   f"{table!r} pools; its keys: {', '.join(map(repr, keys))}")
        features = features_of(kjt)
        if self.is_weighted and features.weights is None:
            raise CaptureError("the collection is weighted but the KeyedJaggedTensor has no "
                               "weights")
        for feature, (table, rows) in self.feature_tables.items():
            ids = features.ids[feature]
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= rows):
                bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
                raise CaptureError(f"KeyedJaggedTensor key {feature!r} looks up id {bad}, but "
                                   f"its table {table!r} has {rows} rows (ids 0-{rows - 1})")
        return features

    def shard(self, batches: Iterable[tuple], rank: int, num_workers: int
              ) -> Iterator[tuple[torch.Tensor, ...]]:
        """Worker `rank`'s samples [rB/W, (r+1)B/W) of every global batch,
        converted (`batch`): tensors cut by rows, `KeyedJaggedTensor`s by
        samples."""
        from torchrec import KeyedJaggedTensor

        for batch in batches:
            parts = []
            for arg in batch:
                if isinstance(arg, KeyedJaggedTensor):
                    size = arg.stride()
                    parts.append(_samples(arg, *_rows(size, rank, num_workers)))
                else:
                    start, end = _rows(arg.shape[0], rank, num_workers)
                    parts.append(arg[start:end])
            yield self.batch(*parts)

    # -- the loss --

    def loss(self, loss_fn: Callable) -> Callable:
        """The loss to capture: `loss_fn(model, *batch)` with each
        `KeyedJaggedTensor` argument given back as `CapturedFeatures`."""
        def captured_loss(model, *flat):
            if self._layout is None:
                raise CaptureError("TorchRecInput.loss: convert a batch (rec.batch or "
                                   "rec.shard) before capture")
            per_feature = 3 if self.is_weighted else 2
            args, position = [], 0
            for is_features in self._layout:
                if not is_features:
                    args.append(flat[position])
                    position += 1
                    continue
                ids, offsets, weights = {}, {}, {} if self.is_weighted else None
                for feature in self.feature_tables:
                    ids[feature], offsets[feature] = flat[position], flat[position + 1]
                    if weights is not None:
                        weights[feature] = flat[position + 2]
                    position += per_feature
                args.append(CapturedFeatures(ids, offsets, weights))
            return loss_fn(model, *args)
        return captured_loss


def _rows(size: int, rank: int, num_workers: int) -> tuple[int, int]:
    if size % num_workers:
        raise CaptureError(f"a global batch of {size} samples does not divide among "
                           f"{num_workers} workers")
    shard = size // num_workers
    return rank * shard, (rank + 1) * shard


def _samples(kjt, start: int, end: int):
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


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    if not name:
        raise CaptureError("TorchRecInput converts a model holding an EmbeddingBagCollection, "
                           "not a collection itself; wrap it in a module")
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def _describe(layout: tuple[bool, ...]) -> str:
    return "(" + ", ".join("KeyedJaggedTensor" if f else "tensor" for f in layout) + ")"
