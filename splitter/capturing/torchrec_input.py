"""TorchRec models and inputs, in one conversion step.

A model built with `torchrec.EmbeddingBagCollection` and fed
`KeyedJaggedTensor`s cannot be captured as it is: the collection's lookup
runs FBGEMM's jagged operators, whose output shapes depend on the data.
`TorchRecInput(model)` converts it once, in place:

- every `EmbeddingBagCollection` in the model becomes a
  `CapturedEmbeddingBagCollection` holding the collection's own
  `nn.EmbeddingBag`s (the same parameters, so the same `state_dict` keys:
  a checkpoint loads back into the TorchRec model); each table is looked up
  once (all the features it pools at once: `torchrec_features`), and the
  result is TorchRec's `KeyedTensor`, as the collection returns it. The bags
  are sparse (parameter-server mode serves them) and can be cached
  (`place_embedding_cache(rec.tables, ...)`, or one table by its TorchRec
  name, `rec.tables["t_item"]`);
- `rec.batch(dense, kjt, label)` (or `rec.batch(torchrec_batch)`, TorchRec's
  `Batch`) turns each `KeyedJaggedTensor` of a batch into tensors, per table
  its ids and offsets (checked, each problem named by key and table:
  `torchrec_features.check_jagged`), and `rec.loss(loss_fn)` is the loss
  the step is captured with: it puts the features back together, as
  `CapturedFeatures` (inside a `Batch` where the batch was one), and calls
  `loss_fn(model, dense, features, label)` (or `loss_fn(model, batch)`);
- `rec.shard(global_batches, rank, num_workers)` gives worker `rank` its
  samples of every global batch (a jagged batch is cut by samples, not by
  ids), converted. A program captured with `rec.loss` knows `rec`, so
  `trainer.shard(global_batches)` and `trainer.step(batch)` take the
  TorchRec batches too.

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
from enum import Enum

import torch
from torch import nn

from ..errors import CaptureError
from .torchrec_features import (
    CapturedFeatures,
    TableInput,
    batch_parts,
    check_jagged,
    check_lengths,
    is_batch,
    is_jagged,
    make_batch,
    num_samples,
    samples,
    table_lookups,
)

__all__ = ["TorchRecInput", "CapturedEmbeddingBagCollection", "CapturedFeatures"]


class CapturedEmbeddingBagCollection(nn.Module):
    """An `EmbeddingBagCollection`'s tables as splitrun captures them: its own
    `nn.EmbeddingBag`s (`embedding_bags`, the same parameters), each table
    looked up once for all the features it pools, returned as TorchRec's
    `KeyedTensor`. `tables`: each table's `TableInput` (its key in
    `rec.tables`), in the collection's order."""

    def __init__(self, collection: nn.Module, tables: list[TableInput]) -> None:
        super().__init__()
        self.embedding_bags = collection.embedding_bags
        self.configs = list(collection.embedding_bag_configs())
        self.is_weighted = bool(collection.is_weighted())
        self.tables = tables
        # The collection's output order: each config's features in turn.
        self.feature_names = [f for config in self.configs for f in config.feature_names]
        for bag in self.embedding_bags.values():
            bag.sparse = True  # row-wise gradients: servers and caches take them

    def forward(self, features) -> object:
        from torchrec import KeyedTensor

        if not isinstance(features, CapturedFeatures):
            features = table_lookups(features, self.tables)  # a KeyedJaggedTensor
        pooled: dict[str, torch.Tensor] = {}
        for table in self.tables:
            bag = self.embedding_bags[table.name]
            weights = features.weights[table.key] if table.is_weighted else None
            offsets = features.offsets[table.key]  # each bag's start, and the end
            bags = bag(features.ids[table.key],
                       offsets if bag.include_last_offset else offsets[:-1],
                       per_sample_weights=weights)
            # One bag per sample and feature, feature after feature.
            rows = bags.shape[0] // len(table.features)
            for index, feature in enumerate(table.features):
                pooled[feature] = (bags if len(table.features) == 1
                                   else bags[index * rows:(index + 1) * rows])
        return KeyedTensor(keys=self.feature_names,
                           length_per_key=[pooled[f].shape[1] for f in self.feature_names],
                           values=torch.cat([pooled[f] for f in self.feature_names], 1))


class _Arg(Enum):
    """What one argument of a batch is."""

    TENSOR = "tensor"
    FEATURES = "KeyedJaggedTensor"
    BATCH = "Batch"


class TorchRecInput:
    """One TorchRec model, converted for capture (see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        from torchrec import EmbeddingBagCollection, EmbeddingCollection

        self.model = model
        found = [(name, module) for name, module in model.named_modules()
                 if isinstance(module, (EmbeddingBagCollection, EmbeddingCollection))]
        for name, module in found:
            if isinstance(module, EmbeddingCollection):
                features = [f for c in module.embedding_configs() for f in c.feature_names]
                raise CaptureError(
                    f"module {name or type(model).__name__!r} is a torchrec "
                    f"EmbeddingCollection (features {', '.join(map(repr, features))}: one "
                    f"embedding per id, not pooled), which TorchRecInput does not support "
                    f"yet; it converts EmbeddingBagCollections only: pool those features "
                    f"with an EmbeddingBagConfig, or train the sequence model without "
                    f"splitrun")
        if not found:
            raise CaptureError(f"{type(model).__name__} holds no torchrec "
                               f"EmbeddingBagCollection to convert")
        keys = _table_keys(found)
        self.collections: list[CapturedEmbeddingBagCollection] = []
        for name, module in found:
            tables = [TableInput(keys[name, config.name], config.name,
                                 name or type(model).__name__, tuple(config.feature_names),
                                 config.num_embeddings, bool(module.is_weighted()))
                      for config in module.embedding_bag_configs()]
            captured = CapturedEmbeddingBagCollection(module, tables)
            _replace(model, name, captured)
            self.collections.append(captured)
        self.table_inputs: list[TableInput] = [t for c in self.collections for t in c.tables]
        self._layout: tuple[_Arg, ...] | None = None  # what each batch argument is

    @property
    def tables(self) -> nn.ModuleDict:
        """Every table's `nn.EmbeddingBag`, by TorchRec's table name (for
        `place_embedding_cache(rec.tables, ...)` or, one table,
        `rec.tables["t_item"]`). A name two collections use is prefixed by
        the collection's module path: `"sparse_arch__t_item"`."""
        bags = {t.key: c.embedding_bags[t.name] for c in self.collections for t in c.tables}
        return nn.ModuleDict(bags)

    @property
    def is_weighted(self) -> bool:
        return any(t.is_weighted for t in self.table_inputs)

    # -- batches --

    def batch(self, *args) -> tuple[torch.Tensor, ...]:
        """A batch as capture and the trainer take it: each
        `KeyedJaggedTensor` argument (or TorchRec `Batch`'s sparse features)
        becomes, per table (in the tables' order), its ids and offsets (and
        weights, for a weighted collection)."""
        layout = tuple(_Arg.BATCH if is_batch(a) else _Arg.FEATURES if is_jagged(a)
                       else _Arg.TENSOR for a in args)
        if all(kind is _Arg.TENSOR for kind in layout):
            raise CaptureError("TorchRecInput.batch: no KeyedJaggedTensor (nor TorchRec Batch) "
                               f"among the batch's {len(args)} arguments")
        # A `Batch` is its three parts: either form feeds the same step (the
        # loss gets the form of the batch converted last before capture).
        if self._layout is not None and _flat(layout) != _flat(self._layout):
            raise CaptureError(f"TorchRecInput.batch: this batch's arguments are laid out "
                               f"{_describe(layout)}, the captured step's "
                               f"{_describe(self._layout)}")
        parts = _parts(args)
        _check_samples(parts)
        self._layout = layout
        flat: list[torch.Tensor] = []
        for part in parts:
            if not is_jagged(part):
                flat.append(part)
                continue
            check_jagged(part, self.table_inputs)
            features = table_lookups(part, self.table_inputs)
            for table in self.table_inputs:
                flat += [features.ids[table.key], features.offsets[table.key]]
                if table.is_weighted:
                    flat.append(features.weights[table.key])
        return tuple(flat)

    def convert(self, batch) -> tuple[torch.Tensor, ...]:
        """One batch as the step's tensors: a TorchRec `Batch`, or a
        sequence of arguments (`rec.batch(*batch)`)."""
        return self.batch(*_arguments(batch))

    def shard(self, batches: Iterable, rank: int, num_workers: int
              ) -> Iterator[tuple[torch.Tensor, ...]]:
        """Worker `rank`'s samples [rB/W, (r+1)B/W) of every global batch (a
        sequence of arguments, or a TorchRec `Batch`), converted (`batch`):
        tensors cut by rows, `KeyedJaggedTensor`s by samples."""
        for batch in batches:
            args = _arguments(batch)
            parts = _parts(args)
            for part in parts:  # before cutting by samples
                if is_jagged(part):
                    check_lengths(part)
            _check_samples(parts, "global ")
            yield self.batch(*(_shard_of(arg, rank, num_workers) for arg in args))

    # -- the loss --

    def loss(self, loss_fn: Callable) -> Callable:
        """The loss to capture: `loss_fn(model, *batch)` with each
        `KeyedJaggedTensor` argument given back as `CapturedFeatures` (a
        TorchRec `Batch` as a `Batch` holding them). A program captured with
        it converts TorchRec batches itself (`Program.batch_input`)."""
        def captured_loss(model, *flat):
            if self._layout is None:
                raise CaptureError("TorchRecInput.loss: convert a batch (rec.batch or "
                                   "rec.shard) before capture")
            position = 0

            def take_features() -> CapturedFeatures:
                nonlocal position
                ids, offsets, weights = {}, {}, {}
                for table in self.table_inputs:
                    ids[table.key], offsets[table.key] = flat[position], flat[position + 1]
                    position += 2
                    if table.is_weighted:
                        weights[table.key] = flat[position]
                        position += 1
                return CapturedFeatures(ids, offsets, weights or None)

            def take_tensor() -> torch.Tensor:
                nonlocal position
                position += 1
                return flat[position - 1]

            args = []
            for kind in self._layout:
                if kind is _Arg.TENSOR:
                    args.append(take_tensor())
                elif kind is _Arg.FEATURES:
                    args.append(take_features())
                else:
                    args.append(make_batch(take_tensor(), take_features(), take_tensor()))
            return loss_fn(model, *args)
        captured_loss.batch_input = self
        return captured_loss


def _arguments(batch) -> tuple:
    """A batch's arguments: a TorchRec `Batch` is one argument."""
    if is_batch(batch) or is_jagged(batch) or isinstance(batch, torch.Tensor):
        return (batch,)
    try:
        return tuple(batch)
    except TypeError:
        raise CaptureError(f"a TorchRec batch is a torchrec.datasets.utils.Batch or a "
                           f"sequence of tensors and KeyedJaggedTensors, got "
                           f"{type(batch).__name__}") from None


def _check_samples(parts: list, scope: str = "") -> None:
    """Every argument of a batch holds the same samples: the jagged tensors'
    samples and the tensors' rows."""
    jagged = [(i, num_samples(p)) for i, p in enumerate(parts) if is_jagged(p)]
    rows = [(i, p.shape[0]) for i, p in enumerate(parts)
            if isinstance(p, torch.Tensor) and p.dim() > 0]
    if not jagged:
        return
    index, expected = jagged[0]
    for other, count in jagged[1:] + rows:
        if count != expected:
            what = "KeyedJaggedTensor" if is_jagged(parts[other]) else "tensor"
            raise CaptureError(
                f"a {scope}batch's KeyedJaggedTensor (part {index}) holds {expected} samples "
                f"but its {what} part {other} has {count} rows; every part of a batch holds "
                f"the same samples (the dense input, the sparse features and the labels)")


def _parts(args) -> list:
    """A batch's arguments with each TorchRec `Batch` opened into its three parts."""
    return [part for arg in args for part in (batch_parts(arg) if is_batch(arg) else (arg,))]


def _shard_of(arg, rank: int, num_workers: int):
    """Worker `rank`'s share of one argument of a global batch."""
    if is_batch(arg):
        return make_batch(*(_rows_of(part, rank, num_workers) for part in batch_parts(arg)))
    return _rows_of(arg, rank, num_workers)


def _rows_of(arg, rank: int, num_workers: int):
    """Worker `rank`'s share of one argument: samples of a jagged tensor, rows of a tensor."""
    if is_jagged(arg):
        return samples(arg, *_rows(num_samples(arg), rank, num_workers))
    start, end = _rows(arg.shape[0], rank, num_workers)
    return arg[start:end]


def _rows(size: int, rank: int, num_workers: int) -> tuple[int, int]:
    if size % num_workers:
        raise CaptureError(f"a global batch of {size} samples does not divide among "
                           f"{num_workers} workers")
    shard = size // num_workers
    return rank * shard, (rank + 1) * shard


def _table_keys(found: list[tuple[str, nn.Module]]) -> dict[tuple[str, str], str]:
    """(collection path, table name) -> the table's key in `rec.tables`: its
    name, or, where two collections use it, the path's parts and the name
    joined by "__" (a ModuleDict key holds no dots)."""
    names = [config.name for _, module in found for config in module.embedding_bag_configs()]
    keys = {}
    for path, module in found:
        for config in module.embedding_bag_configs():
            shared = names.count(config.name) > 1
            keys[path, config.name] = (f"{path.replace('.', '__')}__{config.name}" if shared
                                       else config.name)
    return keys


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    if not name:
        raise CaptureError("TorchRecInput converts a model holding an EmbeddingBagCollection, "
                           "not a collection itself; wrap it in a module")
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def _flat(layout: tuple[_Arg, ...]) -> tuple[_Arg, ...]:
    return tuple(kind for arg in layout for kind in (
        (_Arg.TENSOR, _Arg.FEATURES, _Arg.TENSOR) if arg is _Arg.BATCH else (arg,)))


def _describe(layout: tuple[_Arg, ...]) -> str:
    return "(" + ", ".join(kind.value for kind in layout) + ")"
