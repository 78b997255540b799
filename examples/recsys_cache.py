"""A DLRM-style click model whose embedding tables live on the servers, each
worker caching the hot rows (embedding-cache mode), trained on click logs in
the Criteo display-advertising format.

    splitrun launch --workers 1 --servers 2 examples/recsys_cache.py
    splitrun launch --workers 2 --servers 2 examples/recsys_cache.py --policy lfu
    splitrun launch --workers 1 --servers 2 examples/recsys_cache.py --rows 1000000 \\
        --steps 400 --save ckpt.pt
    splitrun launch --workers 1 --servers 2 examples/recsys_cache.py --resume ckpt.pt
    splitrun launch --workers 2 --servers 2 examples/recsys_cache.py --tables 26 \\
        --data day_0.tsv --eval-data day_1.tsv
    splitrun launch --workers 1 --servers 2 examples/recsys_cache.py --model torchrec

The data: `--data FILE` (and `--eval-data FILE` for the held-out scores) is a
Criteo-format TSV file (label, 13 integer and 26 hexadecimal categorical
features, missing values allowed); the first `--tables` categorical features
are hashed into their tables (`splitrun.runtime.datasets`). Each worker reads
only its own shard of every global batch. Without `--data`, a synthetic file
of that format is generated (`write_synthetic_criteo`: Zipf categories, clicks
from a hidden logistic model over the features used) into `--data-dir` (by
default a directory under the system's temporary directory named after the
settings, reused by later runs with the same settings), with a held-out file
and the hidden model's logits for it, so the report can say how close the
model gets to the labels' own model.

The model: dense features through a bottom MLP; one `nn.EmbeddingBag` (mode sum) per
categorical feature (sum-pooled over its ids); DLRM's interaction (the pairwise
dot products of the embedding vectors and the bottom MLP's output); a top MLP
to a click logit. The tables live on the servers, hash-sliced, with
`cache_rows` rows of each cached on every worker; the dense parameters on
every worker (`--dense worker`, the default: gradients all-reduced between
workers) or on the servers (`--dense server`). `--model torchrec` trains the
same model in TorchRec's form (`TorchRecDLRM`: its tables in one
`torchrec.EmbeddingBagCollection`, fed `KeyedJaggedTensor`s), converted once
by `TorchRecInput`; the final state is loaded back into an unconverted
TorchRec model for the held-out scores.

The in-memory synthetic stream below (`HiddenModel`, `global_batches`), which
bench/embedding_cache.py drives: each table's ids are drawn from a Zipf law
(`--zipf`) over its rows, hot ranks mapped to ids by a fixed random
permutation (hot ids are not the small ones); labels come from a hidden
logistic model (fixed random embeddings and dense weights). Everything is
generated from fixed seeds: every process builds the same model and batches.
This script's own runs read files (above).

Worker 0 reports the held-out log-loss and AUC of the final state (against the
base rate's entropy and, for generated data, the hidden model's own AUC), the
cache hit rate per table, samples/s and the time taken. `--json` adds one line
`RESULT {...}`.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import itertools
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.metrics import log_loss, roc_auc_score
from torch import nn

from splitrun.runtime.datasets import (
    NUM_CATEGORICAL,
    CriteoFile,
    CriteoSchema,
    write_synthetic_criteo,
)
from splitrun.runtime.job import Job
from splitrun.splitter import (
    EmbeddingCacheMode,
    RowInit,
    TorchRecInput,
    capture,
    optim,
    place,
    place_embedding_cache,
)

# Criteo's click logs have 13 dense features; the synthetic data keeps that.
NUM_DENSE = 13
# Hidden label model: embedding width, how far its logits spread (their
# standard deviation is about this, so the labels are learnable but noisy), and
# the bias that sets the click rate (about 40 %).
HIDDEN_DIM = 4
HIDDEN_LOGIT_SCALE = 2.5
HIDDEN_BIAS = -1.0
# Tables start small (as DLRM's do): the interaction starts near zero and
# rows grow only where the data moves them. nn.Embedding's N(0, 1) rows gave
# a noisy start (held-out AUC 0.63 instead of 0.68 at the same settings).
EMBEDDING_INIT_STD = 0.01
# Seeds: the model, the hidden label model, each table's rank -> id
# permutation (this seed and the table's index), the training stream (this seed
# and the step: a run of N steps sees the first N batches of a longer run, so a
# resumed run continues the same stream).
MODEL_SEED = 0
HIDDEN_SEED = 1
PERMUTATION_SEED = 2
TRAIN_SEED = 3
TABLE_SEED = 4  # each table's starting rows (this seed and the table's index)
# The held-out set is scored in chunks of this many samples.
EVAL_CHUNK = 16384
# Intra-op threads per process. The launcher starts W + S processes on one
# machine; on the 2-core machine this was written on, a second OpenMP thread
# made every parallel region stall ~8 ms (index_add_ ~80 ms against 0.02 ms
# with one thread), which dominated the step.
DEFAULT_THREADS = 1
# The optimizers a cached table can take (their row state travels with the row).
OPTIMIZERS = {"adagrad": optim.Adagrad, "sgd": optim.SGD}
# Prefix of the machine-readable result line (`--json`).
RESULT_PREFIX = "RESULT "
# Generated Criteo-format data: distinct values of the categorical features no
# table reads (they are written, as the format has them, and skipped), the
# sample seeds of the training and held-out files (one hidden model: seed 0),
# and the share of missing fields.
UNUSED_FEATURE_VALUES = 1000
TRAIN_FILE_SEED = 1
HELD_OUT_FILE_SEED = 2
MISSING_RATE = 0.02


@dataclass(frozen=True)
class DataSpec:
    """What the synthetic click stream looks like."""

    rows: tuple[int, ...]     # rows of each table
    ids_per_table: int        # ids per sample and table (sum-pooled)
    zipf: float               # exponent of the id popularity law

    @property
    def num_tables(self) -> int:
        return len(self.rows)


# -- the model ---------------------------------------------------------------

def mlp(widths: list[int], *, last_relu: bool) -> nn.Sequential:
    """Linear layers with ReLUs between them (and after the last, when the
    output feeds the interaction: DLRM's bottom MLP ends in a ReLU)."""
    layers: list[nn.Module] = []
    for index, (fan_in, fan_out) in enumerate(zip(widths, widths[1:])):
        layers.append(nn.Linear(fan_in, fan_out))
        if last_relu or index < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """Bottom MLP, embedding tables, pairwise-dot interaction, top MLP."""

    def __init__(self, rows: tuple[int, ...], dim: int, bottom: list[int],
                 top: list[int], *, init_tables: bool = True) -> None:
        super().__init__()
        self.bottom = mlp([NUM_DENSE, *bottom, dim], last_relu=True)
        # Multi-hot features pooled by sum bags, as DLRM's. skip_init:
        # initialize million-row tables once, not twice; not at all with
        # init_tables=False (their memory is then never written, so never
        # paged in: a worker whose tables live on the servers).
        self.tables = nn.ModuleList(nn.utils.skip_init(nn.EmbeddingBag, n, dim, mode="sum")
                                    for n in rows)
        for index, table in enumerate(self.tables if init_tables else ()):
            # A generator of its own: a worker skipping this draws the MLPs alike.
            generator = torch.Generator().manual_seed(_seed(TABLE_SEED, index))
            nn.init.normal_(table.weight, std=EMBEDDING_INIT_STD, generator=generator)
        self.num_features = len(rows) + 1
        num_pairs = self.num_features * (self.num_features - 1) // 2
        self.top = mlp([dim + num_pairs, *top, 1], last_relu=False)

    def forward(self, dense: torch.Tensor, *ids: torch.Tensor) -> torch.Tensor:
        bottom = self.bottom(dense)
        return interact(self.top, bottom, [table(i) for table, i in zip(self.tables, ids)])


def interact(top: nn.Module, bottom: torch.Tensor, pooled: list[torch.Tensor]) -> torch.Tensor:
    """DLRM's interaction: the pairwise dot products of the bottom MLP's output
    and the pooled embeddings, with the bottom output, through the top MLP."""
    vectors = [bottom, *pooled]
    stacked = torch.stack(vectors, 1)                       # [B, F, D]
    gram = torch.bmm(stacked, stacked.transpose(1, 2))      # [B, F, F]
    # The strictly lower triangle, row by row: every pair once, static slices.
    pairs = torch.cat([gram[:, i, :i] for i in range(1, len(vectors))], 1)
    return top(torch.cat([bottom, pairs], 1)).squeeze(1)


# -- the same model in TorchRec's form -------------------------------------------

def feature_name(table: int) -> str:
    return f"feature_{table}"


class TorchRecDLRM(nn.Module):
    """`DLRM` with its tables in one `torchrec.EmbeddingBagCollection` (table
    `table_<i>` pools feature `feature_<i>`, sum), fed a `KeyedJaggedTensor`:
    the model a TorchRec user writes. `tables=` passes another collection
    (TorchRec's `FusedEmbeddingBagCollection`) of the same tables."""

    def __init__(self, rows: tuple[int, ...], dim: int, bottom: list[int], top: list[int], *,
                 tables: nn.Module | None = None, device: torch.device | str = "cpu") -> None:
        super().__init__()
        from torchrec import EmbeddingBagCollection

        self.bottom = mlp([NUM_DENSE, *bottom, dim], last_relu=True)
        self.tables = tables if tables is not None else EmbeddingBagCollection(
            tables=torchrec_tables(rows, dim), device=torch.device(device))
        self.num_tables = len(rows)
        num_pairs = (self.num_tables + 1) * self.num_tables // 2
        self.top = mlp([dim + num_pairs, *top, 1], last_relu=False)

    def forward(self, dense: torch.Tensor, features) -> torch.Tensor:
        pooled = self.tables(features)  # a KeyedTensor
        return interact(self.top, self.bottom(dense),
                        [pooled[feature_name(i)] for i in range(self.num_tables)])

    def load_dlrm(self, dlrm: DLRM) -> TorchRecDLRM:
        """Take `dlrm`'s parameters (the same model: the same starting point)."""
        state = {k: v for k, v in dlrm.state_dict().items() if not k.startswith("tables.")}
        for index, table in enumerate(dlrm.tables):
            state[f"tables.embedding_bags.table_{index}.weight"] = table.weight.detach()
        self.load_state_dict(state)  # the fused collection names its weights alike
        return self


def torchrec_tables(rows: tuple[int, ...], dim: int) -> list:
    from torchrec import EmbeddingBagConfig, PoolingType

    return [EmbeddingBagConfig(name=f"table_{i}", embedding_dim=dim, num_embeddings=n,
                               feature_names=[feature_name(i)], pooling=PoolingType.SUM,
                               init_fn=functools.partial(nn.init.normal_,
                                                         std=EMBEDDING_INIT_STD))
            for i, n in enumerate(rows)]


def features_of(ids: list[torch.Tensor]):
    """One batch's ids ([samples, ids per sample] per table) as the
    `KeyedJaggedTensor` TorchRec models read."""
    from torchrec import KeyedJaggedTensor

    lengths = torch.cat([torch.full((t.shape[0],), t.shape[1], dtype=torch.int64) for t in ids])
    return KeyedJaggedTensor.from_lengths_sync(
        [feature_name(i) for i in range(len(ids))], torch.cat([t.reshape(-1) for t in ids]),
        lengths)


def click_loss(model: nn.Module, dense: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
    """Batch layout: dense, one id tensor per table, label (so each table's
    lookup reads its own batch input, which lets the cache prefetch it)."""
    *ids, label = rest
    return F.binary_cross_entropy_with_logits(model(dense, *ids), label)


# -- the synthetic clicks ----------------------------------------------------

@lru_cache(maxsize=None)
def _zipf_cdf(num_rows: int, exponent: float) -> torch.Tensor:
    """Cumulative probabilities of ranks 0..num_rows-1 (rank r ~ 1/(r+1)^s)."""
    weights = torch.arange(1, num_rows + 1, dtype=torch.float64).pow_(-exponent)
    cdf = torch.cumsum(weights, 0)
    return cdf / cdf[-1]


def zipf_ranks(num_rows: int, exponent: float, count: int,
               generator: torch.Generator) -> torch.Tensor:
    """`count` independent popularity ranks (0 = hottest) by inverse CDF."""
    cdf = _zipf_cdf(num_rows, exponent)
    uniform = torch.rand(count, dtype=torch.float64, generator=generator)
    return torch.searchsorted(cdf, uniform).clamp_(max=num_rows - 1)


def _seed(stream: int, index: int) -> int:
    """A seed of its own for item `index` of a stream of random draws."""
    return (stream << 32) | index


@lru_cache(maxsize=None)
def hot_order(num_rows: int, table: int) -> torch.Tensor:
    """The id of each popularity rank for one table: a fixed permutation."""
    generator = torch.Generator().manual_seed(_seed(PERMUTATION_SEED, table))
    return torch.randperm(num_rows, generator=generator)


@dataclass(frozen=True)
class HiddenModel:
    """The logistic model the labels come from."""

    embeddings: tuple[torch.Tensor, ...]   # per table [rows, HIDDEN_DIM]
    offsets: torch.Tensor                   # [tables, HIDDEN_DIM]: ids' own effects
    dense_map: torch.Tensor                 # [NUM_DENSE, HIDDEN_DIM]: dense x id interaction
    dense_weight: torch.Tensor              # [NUM_DENSE]

    @classmethod
    def build(cls, spec: DataSpec) -> HiddenModel:
        generator = torch.Generator().manual_seed(HIDDEN_SEED)
        embeddings = tuple(torch.randn(n, HIDDEN_DIM, generator=generator) for n in spec.rows)
        return cls(embeddings, torch.randn(spec.num_tables, HIDDEN_DIM, generator=generator),
                   torch.randn(NUM_DENSE, HIDDEN_DIM, generator=generator) / math.sqrt(NUM_DENSE),
                   torch.randn(NUM_DENSE, generator=generator) / math.sqrt(NUM_DENSE))

    def logits(self, dense: torch.Tensor, ids: list[torch.Tensor]) -> torch.Tensor:
        """Bias + dense effect + each table's pooled hidden embedding against
        (its offset + a projection of the dense features), scaled so the
        logits' spread is about HIDDEN_LOGIT_SCALE."""
        projected = dense @ self.dense_map
        total = dense @ self.dense_weight
        for table, table_ids in enumerate(ids):
            pooled = self.embeddings[table][table_ids].sum(1) / math.sqrt(table_ids.shape[1])
            total = total + (pooled * (self.offsets[table] + projected)).sum(1) / math.sqrt(
                2 * HIDDEN_DIM)
        return HIDDEN_BIAS + HIDDEN_LOGIT_SCALE * total / math.sqrt(len(ids) + 1)


def click_samples(spec: DataSpec, hidden: HiddenModel, count: int, seed: int
                  ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """(dense [count, NUM_DENSE], ids per table [count, L], labels, hidden logits)."""
    generator = torch.Generator().manual_seed(seed)
    dense = torch.randn(count, NUM_DENSE, generator=generator)
    ids = [hot_order(n, t)[zipf_ranks(n, spec.zipf, count * spec.ids_per_table, generator)]
           .reshape(count, spec.ids_per_table) for t, n in enumerate(spec.rows)]
    logits = hidden.logits(dense, ids)
    labels = torch.bernoulli(torch.sigmoid(logits), generator=generator)
    return dense, ids, labels, logits


def global_batches(spec: DataSpec, hidden: HiddenModel, batch_size: int, num_steps: int
                   ) -> list[tuple[torch.Tensor, ...]]:
    """The training stream as global batches (dense, ids..., label), each
    drawn from its own seed."""
    batches = []
    for step in range(num_steps):
        dense, ids, labels, _ = click_samples(spec, hidden, batch_size,
                                              _seed(TRAIN_SEED, step))
        batches.append((dense, *ids, labels))
    return batches


def example_batch(spec: DataSpec, batch_size: int) -> tuple[torch.Tensor, ...]:
    """A batch of the right shapes and dtypes for capture (values unused)."""
    ids = [torch.zeros(batch_size, spec.ids_per_table, dtype=torch.int64)
           for _ in spec.rows]
    return (torch.zeros(batch_size, NUM_DENSE), *ids, torch.zeros(batch_size))


# -- Criteo-format files ---------------------------------------------------------

@dataclass(frozen=True)
class DataFiles:
    train: str
    held_out: str | None
    held_out_logits: str | None  # the hidden model's logits of the held-out lines


def generated_files(args: argparse.Namespace, spec: DataSpec) -> DataFiles:
    """Synthetic Criteo-format training and held-out files for these settings,
    generated once into a directory named after them (every worker may do it
    at once: each writes the same bytes to its own temporary file and renames
    it into place, so a reader never sees half a file)."""
    samples = args.steps * args.batch_size
    cardinalities = spec.rows + (UNUSED_FEATURE_VALUES,) * (NUM_CATEGORICAL - spec.num_tables)
    settings = repr((samples, args.eval_samples, cardinalities, args.zipf, MISSING_RATE))
    key = hashlib.sha1(settings.encode()).hexdigest()[:12]
    directory = args.data_dir or os.path.join(tempfile.gettempdir(), f"splitrun-recsys-{key}")
    os.makedirs(directory, exist_ok=True)
    files = DataFiles(os.path.join(directory, "train.tsv"),
                      os.path.join(directory, "held_out.tsv"),
                      os.path.join(directory, "held_out_logits.npy"))
    if os.path.exists(files.train):  # written last: the others are there
        return files
    common = {"cardinalities": cardinalities, "zipf": args.zipf, "missing_rate": MISSING_RATE,
              "num_informative": spec.num_tables}
    partial = f".{os.getpid()}.partial"
    held_out = write_synthetic_criteo(files.held_out + partial, args.eval_samples,
                                      seed=HELD_OUT_FILE_SEED, keep_logits=True, **common)
    with open(files.held_out_logits + partial, "wb") as out:
        np.save(out, held_out.logits)
    write_synthetic_criteo(files.train + partial, samples, seed=TRAIN_FILE_SEED, **common)
    for path in (files.held_out_logits, files.held_out, files.train):
        os.replace(path + partial, path)
    return files


def data_files(args: argparse.Namespace, spec: DataSpec) -> DataFiles:
    if args.data:
        return DataFiles(args.data, args.eval_data, None)
    return generated_files(args, spec)


def criteo_source(path: str, spec: DataSpec, batch_size: int, *,
                  drop_last: bool = True) -> CriteoFile:
    return CriteoFile(path, CriteoSchema(spec.rows), batch_size, drop_last=drop_last)


# -- building the job ----------------------------------------------------------

def table_rows(args: argparse.Namespace) -> tuple[int, ...]:
    """`--rows` holds one size for every table or one per table."""
    if len(args.rows) == 1:
        return tuple(args.rows) * args.tables
    if len(args.rows) != args.tables:
        raise SystemExit(f"--rows takes one size or {args.tables} (one per table), "
                         f"got {len(args.rows)}")
    return tuple(args.rows)


def cache_rows_for(num_rows: int, shard: int, args: argparse.Namespace) -> int:
    """Rows each worker caches of one table: --cache-rows or --cache-fraction of
    the table, but at least one batch's ids (a batch's rows stay cached while
    it runs), at most the table. Policy none caches nothing: one batch's buffer."""
    batch_ids = shard * args.ids_per_table
    if args.policy == "none":
        wanted = batch_ids
    elif args.cache_rows is not None:
        wanted = args.cache_rows
    else:
        wanted = round(args.cache_fraction * num_rows)
    return min(num_rows, max(wanted, batch_ids))


def build(args: argparse.Namespace, num_workers: int, *, tables_here: bool = True):
    """(model, program for one worker's shard of a global batch, data spec,
    cache rows per table, what turns a batch (dense, ids..., label) into the
    step's). The same on every process. `--model torchrec`: the TorchRec form
    (`TorchRecDLRM`, fed KeyedJaggedTensors), converted for capture by
    `TorchRecInput`. `tables_here=False` (workers): the tables' starting
    values are the servers' alone, so a worker leaves them unwritten and they
    take no memory there (its caches pull rows from the servers). With
    `--row-init` no process writes them: each server makes its rows from the
    row initializer as they are first used."""
    spec = DataSpec(table_rows(args), args.ids_per_table, args.zipf)
    if args.batch_size % num_workers:
        raise SystemExit(f"--batch-size {args.batch_size} must divide among "
                         f"{num_workers} workers")
    shard = args.batch_size // num_workers
    if args.row_init and args.model == "torchrec":
        raise SystemExit("--row-init goes with --model dlrm (the TorchRec form copies its "
                         "tables from the plain model's)")
    init = RowInit.normal(std=EMBEDDING_INIT_STD, seed=TABLE_SEED) if args.row_init else None
    torch.manual_seed(MODEL_SEED)
    model = DLRM(spec.rows, args.dim, args.bottom, args.top,
                 init_tables=tables_here and init is None)
    loss, convert, tables = click_loss, _as_it_is, list(model.tables)
    if args.model == "torchrec":
        model = TorchRecDLRM(spec.rows, args.dim, args.bottom, args.top).load_dlrm(model)
        rec = TorchRecInput(model)  # the one conversion step
        loss, tables = rec.loss(torchrec_click_loss), list(rec.tables.values())

        def convert(batch):
            dense, *ids, label = batch
            return rec.batch(dense, features_of(ids), label)
    if args.dense == "server":
        place(model, role="server")  # dense parameters on the servers too
    cache_rows = [cache_rows_for(n, shard, args) for n in spec.rows]
    for table, rows in zip(tables, cache_rows):
        place_embedding_cache(table, cache_rows=rows, policy=args.policy,
                              max_staleness=args.max_staleness, init=init)
    # One optimizer for everything: cached tables take SGD or Adagrad (element-wise
    # on the rows looked up: one accumulator per element, not per row).
    optimizer = OPTIMIZERS[args.optimizer](lr=args.lr)
    program = capture(model, loss, optimizer, convert(example_batch(spec, shard)))
    return model, program, spec, cache_rows, convert


def _as_it_is(batch):
    return batch


def torchrec_click_loss(model: nn.Module, dense: torch.Tensor, features,
                        label: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(model(dense, features), label)


def table_keys(args: argparse.Namespace) -> list[str]:
    """The cached tables' state keys, in table order."""
    if args.model == "torchrec":
        return [f"tables.embedding_bags.table_{i}.weight" for i in range(args.tables)]
    return [f"tables.{i}.weight" for i in range(args.tables)]


def cache_mode(args: argparse.Namespace) -> EmbeddingCacheMode:
    """The tables' rows on the servers; the dense MLPs on every worker
    (`--dense worker`, gradients all-reduced between workers) or on the
    servers too (`--dense server`)."""
    return EmbeddingCacheMode(dense=args.dense)


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", type=int, default=8, help="categorical features")
    parser.add_argument("--rows", type=int, nargs="+", default=[100_000],
                        help="rows per table: one size for all, or one per table")
    parser.add_argument("--dim", type=int, default=16, help="embedding width")
    parser.add_argument("--ids-per-table", type=int, default=1,
                        help="ids per sample and table (multi-hot, sum-pooled)")
    parser.add_argument("--bottom", type=int, nargs="*", default=[64],
                        help="hidden widths of the bottom MLP")
    parser.add_argument("--top", type=int, nargs="*", default=[64, 32],
                        help="hidden widths of the top MLP")
    parser.add_argument("--batch-size", type=int, default=1024, help="global batch size")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adagrad",
                        help="for every parameter (Adagrad's sums travel with cached rows)")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate")
    parser.add_argument("--zipf", type=float, default=1.05,
                        help="exponent of the ids' popularity law")
    parser.add_argument("--cache-fraction", type=float, default=0.05,
                        help="rows cached per table, as a fraction of the table")
    parser.add_argument("--cache-rows", type=int, help="rows cached per table (overrides "
                                                       "--cache-fraction)")
    parser.add_argument("--policy", choices=["lru", "lfu", "none"], default="lru",
                        help="eviction policy; none: no caching, every lookup to the servers")
    parser.add_argument("--model", choices=["dlrm", "torchrec"], default="dlrm",
                        help="the model's form: plain torch bags, or TorchRec's "
                             "EmbeddingBagCollection fed KeyedJaggedTensors")
    parser.add_argument("--row-init", action="store_true",
                        help="the tables' rows start from a row initializer (normal, the "
                             "same scale) that each server applies to its own rows when "
                             "first used: no process writes a whole table, servers neither")
    parser.add_argument("--dense", choices=["worker", "server"], default="worker",
                        help="where the MLPs live: replicated on the workers (all-reduced) "
                             "or on the servers")
    parser.add_argument("--max-staleness", type=int, default=2,
                        help="several workers: re-read a cached row older than this many steps")
    parser.add_argument("--data", help="training data: a Criteo-format TSV file (without "
                                       "it, a synthetic one is generated)")
    parser.add_argument("--eval-data", help="held-out data in the same format (with --data)")
    parser.add_argument("--data-dir", help="where generated data goes (default: a directory "
                                           "under the temporary directory, reused)")
    parser.add_argument("--eval-samples", type=int, default=100_000,
                        help="held-out samples generated (without --data)")
    parser.add_argument("--save", help="write a checkpoint here at the end")
    parser.add_argument("--resume", help="start from this checkpoint")
    parser.add_argument("--min-auc", type=float, default=0.0,
                        help="exit 1 when the held-out AUC is below this")
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS,
                        help="torch intra-op threads per process")
    parser.add_argument("--json", action="store_true",
                        help=f"also print one line '{RESULT_PREFIX}{{...}}'")
    return parser


# -- evaluation and the report ---------------------------------------------------

def evaluate(model: nn.Module, spec: DataSpec, files: DataFiles) -> dict:
    """Held-out log-loss and AUC of `model`, next to the base rate's entropy
    (what predicting the click rate alone scores) and, for generated data,
    the hidden model's AUC (the best any model can do on these labels).
    Empty without held-out data."""
    if files.held_out is None:
        return {}
    scores, labels = [], []
    with torch.no_grad():
        for dense, *ids, label in criteo_source(files.held_out, spec, EVAL_CHUNK,
                                                drop_last=False):
            scores.append(model(dense, features_of(ids)) if isinstance(model, TorchRecDLRM)
                          else model(dense, *ids))
            labels.append(label)
    probability = torch.sigmoid(torch.cat(scores)).double().numpy()
    truth = torch.cat(labels).numpy()
    rate = float(truth.mean())
    metrics = {"log_loss": log_loss(truth, probability, labels=[0, 1]),
               "auc": roc_auc_score(truth, probability),
               "base_rate": rate,
               "base_rate_entropy": -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))}
    if files.held_out_logits is not None:
        metrics["hidden_model_auc"] = roc_auc_score(truth, np.load(files.held_out_logits))
    return metrics


def report(args, job: Job, trainer, spec: DataSpec, cache_rows: list[int], metrics: dict,
           steps: int, train_s: float, total_s: float) -> dict:
    """The numbers worker 0 prints (and `--json` emits)."""
    counters = trainer.cache_counters
    tables = {}
    for key, rows, num_rows in zip(table_keys(args), cache_rows, spec.rows):
        counter = counters[key]
        tables[key] = {"rows": num_rows, "cache_rows": rows, "hit_rate": counter["hit_rate"],
                       "lookups": counter["lookups"], "unique_ids": counter["unique_ids"],
                       "hits": counter["hits"], "evictions": counter["evictions"],
                       "bytes_pulled": counter["bytes_pulled"],
                       "bytes_pushed": counter["bytes_pushed"]}
    samples = steps * args.batch_size
    return {"workers": job.cluster.num_workers, "servers": job.cluster.num_servers,
            "tables": spec.num_tables, "dim": args.dim, "batch_size": args.batch_size,
            "policy": args.policy, "zipf": args.zipf, "max_staleness": args.max_staleness,
            "steps": steps, "samples": samples, "train_s": round(train_s, 3),
            "total_s": round(total_s, 3),
            "samples_per_s": round(samples / train_s, 1) if train_s > 0 else 0.0,
            **{k: round(v, 5) for k, v in metrics.items()}, "cache": tables}


def print_report(result: dict) -> None:
    workers, servers = result["workers"], result["servers"]
    print(f"trained {result['steps']} steps ({result['samples']} samples) on {workers} "
          f"worker{'' if workers == 1 else 's'} and {servers} "
          f"server{'' if servers == 1 else 's'} in "
          f"{result['train_s']:.1f} s ({result['samples_per_s']:.0f} samples/s; "
          f"{result['total_s']:.1f} s with the final write-back and table dump)")
    if "auc" not in result:
        print("no held-out data (--eval-data): no held-out scores")
    else:
        hidden = ("" if "hidden_model_auc" not in result
                  else f" (the hidden model's own AUC: {result['hidden_model_auc']:.4f})")
        print(f"held-out log-loss {result['log_loss']:.4f} (base rate "
              f"{result['base_rate']:.3f}: entropy {result['base_rate_entropy']:.4f}), AUC "
              f"{result['auc']:.4f}{hidden}")
    print(f"cache hit rate (unique ids of a worker-0 batch served without a pull), "
          f"policy {result['policy']}:")
    for key, table in result["cache"].items():
        print(f"  {key}: {table['hit_rate']:.3f} ({table['cache_rows']} of {table['rows']} "
              f"rows cached, {table['evictions']} evictions, "
              f"{table['bytes_pulled'] / 1e6:.1f} MB pulled, "
              f"{table['bytes_pushed'] / 1e6:.1f} MB pushed)")


def main() -> int:
    args = parser().parse_args()
    torch.set_num_threads(args.threads)
    if args.tables > NUM_CATEGORICAL:
        raise SystemExit(f"--tables {args.tables}: Criteo-format data has {NUM_CATEGORICAL} "
                         f"categorical features")
    if args.ids_per_table != 1:
        raise SystemExit("--ids-per-table: Criteo-format data has one id per feature and sample")
    if args.eval_data and not args.data:
        raise SystemExit("--eval-data goes with --data (generated data has its own)")
    job = Job.from_env()
    model, program, spec, cache_rows, convert = build(args, job.cluster.num_workers,
                                                      tables_here=not job.is_worker)
    # Servers train on no batch: only workers read (or generate) the data.
    files = data_files(args, spec) if job.is_worker else None
    source = criteo_source(files.train, spec, args.batch_size) if job.is_worker else []
    trainer = job.start(program, cache_mode(args), num_steps=args.steps,
                        resume=args.resume)

    started = time.perf_counter()
    first = trainer.steps_done
    # Each worker reads its own shard of every global batch from the file.
    for _ in trainer.run(map(convert, itertools.islice(trainer.shard(source), first,
                                                        args.steps))):
        pass
    train_s = time.perf_counter() - started
    if args.save and job.is_worker:
        trainer.save(args.save)
    final_state = trainer.finish()
    if not job.is_driver:
        return 0

    total_s = time.perf_counter() - started
    if args.model == "torchrec":  # the trained state back in an unconverted TorchRec model
        model = TorchRecDLRM(spec.rows, args.dim, args.bottom, args.top)
    model.load_state_dict({k: v for k, v in final_state.items() if k in model.state_dict()})
    metrics = evaluate(model, spec, files)
    result = report(args, job, trainer, spec, cache_rows, metrics, trainer.steps_done - first,
                    train_s, total_s)
    print_report(result)
    if args.save:
        print(f"checkpoint written to {args.save}")
    if args.json:
        print(RESULT_PREFIX + json.dumps(result), flush=True)
    if result.get("auc", 0.0) < args.min_auc:
        print(f"AUC {result.get('auc', 'unknown (no held-out data)')} is below --min-auc "
              f"{args.min_auc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
