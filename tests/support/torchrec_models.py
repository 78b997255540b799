"""TorchRec's own DLRM (`torchrec.models.dlrm.DLRM`) for the tests of TorchRec
models, threaded and launched: a table pooled by two features (`t_item` reads
`item` and `item_hist`) beside a table of one (`t_user`), jagged batches from
one seeded generator (0-3 ids per sample and feature, empty bags included),
and plain single-process TorchRec training, the reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torchrec
from torchrec.models.dlrm import DLRM

from splitrun.splitter import TorchRecInput, capture, optim, place, place_embedding_cache

ROWS = {"t_item": 120, "t_user": 90}
FEATURES = {"item": "t_item", "item_hist": "t_item", "user": "t_user"}
DIM = 4
DENSE = 3
GLOBAL_BATCH = 16
CACHE_ROWS = 56  # fewer than a table's rows: evictions every few steps
LR = 0.1

# name -> (the functional optimizer the split step takes, the torch one the reference takes)
OPTIMIZERS = {
    "sgd": (lambda: optim.SGD(lr=LR), lambda params: torch.optim.SGD(params, lr=LR)),
    "adagrad": (lambda: optim.Adagrad(lr=LR),
                lambda params: torch.optim.Adagrad(params, lr=LR, foreach=False)),
}


def make_dlrm() -> DLRM:
    torch.manual_seed(0)
    tables = [torchrec.EmbeddingBagConfig(
        name=name, embedding_dim=DIM, num_embeddings=rows,
        feature_names=[f for f, t in FEATURES.items() if t == name])
        for name, rows in ROWS.items()]
    collection = torchrec.EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    return DLRM(collection, dense_in_features=DENSE, dense_arch_layer_sizes=[8, DIM],
                over_arch_layer_sizes=[8, 1])


def global_batches(num_steps: int, seed: int = 1) -> list[tuple]:
    """(dense, KeyedJaggedTensor, label) per step; keys in the KJT's own order."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(num_steps):
        lengths = torch.randint(0, 4, (len(FEATURES) * GLOBAL_BATCH,), generator=generator)
        counts = lengths.reshape(len(FEATURES), GLOBAL_BATCH).sum(1).tolist()
        values = torch.cat([torch.randint(0, ROWS[t], (n,), generator=generator)
                            for t, n in zip(FEATURES.values(), counts)])
        features = torchrec.KeyedJaggedTensor.from_lengths_sync(list(FEATURES), values, lengths)
        batches.append((torch.randn(GLOBAL_BATCH, DENSE, generator=generator), features,
                        torch.randint(0, 2, (GLOBAL_BATCH,), generator=generator).float()))
    return batches


def dlrm_loss(model, dense, features, label):
    return F.binary_cross_entropy_with_logits(model(dense, features).squeeze(1), label)


def converted(optimizer: str, num_workers: int, *, cache: bool, dense: str = "worker",
              num_steps: int = 8):
    """(model, rec, program of one worker's shard, global batches): the DLRM
    converted by `TorchRecInput`, its tables cached (`cache`), its dense
    layers placed on the servers where `dense="server"`."""
    model = make_dlrm()
    rec = TorchRecInput(model)
    if cache:
        place_embedding_cache(rec.tables, cache_rows=CACHE_ROWS)
    if dense == "server":
        place(model, role="server")
    batches = global_batches(num_steps)
    program = capture(model, rec.loss(dlrm_loss), OPTIMIZERS[optimizer][0](),
                      next(rec.shard(batches[:1], 0, num_workers)))
    return model, rec, program, batches


def torchrec_reference(optimizer, num_steps: int) -> dict[str, torch.Tensor]:
    """Plain TorchRec in one process: the unconverted DLRM (dense gradients)
    trained by a torch optimizer (`optimizer(model)`, or the name of one) on
    the global batches; its state_dict."""
    model = make_dlrm()
    make = (lambda m: OPTIMIZERS[optimizer][1](m.parameters())) if isinstance(
        optimizer, str) else optimizer
    torch_optimizer = make(model)
    for dense, features, label in global_batches(num_steps):
        torch_optimizer.zero_grad()
        dlrm_loss(model, dense, features, label).backward()
        torch_optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
