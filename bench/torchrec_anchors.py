"""What a recommendation engineer would run instead of splitrun's embedding
cache, on the model and batches of `bench/embedding_cache.py --part
throughput` (examples/recsys_cache.py's DLRM, the same starting weights, the
same global batches, plain SGD at the same rate):

- `plain`: plain torch in one process: `nn.EmbeddingBag(sparse=True)` and
  `torch.optim.SGD` (sparse gradients for the tables);
- `fused`: TorchRec's `FusedEmbeddingBagCollection` in one process (FBGEMM's
  table-batched kernel, SGD fused into its backward; the MLPs on
  `torch.optim.SGD`), fed `KeyedJaggedTensor`s;
- `dmp`: TorchRec's `DistributedModelParallel` on 2 processes (gloo, CPU):
  the tables sharded table-wise (FBGEMM's fused SGD), the MLPs data-parallel
  (DDP), each process half of every global batch.

Each run prints one line `BENCH {"stamps": [...]}`: when each step ended (on
rank 0), as splitrun's jobs in the benchmark do. Every process uses
`--threads` intra-op threads (1, as splitrun's processes).

    python bench/torchrec_anchors.py plain|fused -- [job options of recsys_cache.py]
    python bench/torchrec_anchors.py dmp --rank R --world-size 2 --store HOST:PORT -- [...]

`--memory-report` adds the process's peak resident memory to the line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import resource
import sys
import time

import torch
import torch.nn.functional as F

HERE = pathlib.Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1] / "examples"))

import recsys_cache  # noqa: E402

BENCH_PREFIX = "BENCH "
# Bounds forming the gloo group and each of its collectives.
GROUP_TIMEOUT_S = 300


def _batches(job_args, rank: int = 0, world_size: int = 1):
    """The global batches (dense, ids per table, label), this rank's rows."""
    spec = recsys_cache.DataSpec(recsys_cache.table_rows(job_args), job_args.ids_per_table,
                                 job_args.zipf)
    hidden = recsys_cache.HiddenModel.build(spec)
    shard = job_args.batch_size // world_size
    rows = slice(rank * shard, (rank + 1) * shard)
    return spec, [tuple(t[rows] for t in batch) for batch in recsys_cache.global_batches(
        spec, hidden, job_args.batch_size, job_args.steps)]


def _dlrm(job_args, spec, *, sparse: bool) -> recsys_cache.DLRM:
    torch.manual_seed(recsys_cache.MODEL_SEED)
    model = recsys_cache.DLRM(spec.rows, job_args.dim, job_args.bottom, job_args.top)
    for table in model.tables:
        table.sparse = sparse
    return model


def _report(stamps: list[float], memory: bool) -> None:
    result = {"stamps": stamps}
    if memory:
        result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(BENCH_PREFIX + json.dumps(result), flush=True)


def run_plain(job_args, memory: bool) -> None:
    spec, batches = _batches(job_args)
    model = _dlrm(job_args, spec, sparse=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=job_args.lr)
    stamps = [time.perf_counter()]
    for dense, *ids, label in batches:
        optimizer.zero_grad(set_to_none=True)
        F.binary_cross_entropy_with_logits(model(dense, *ids), label).backward()
        optimizer.step()
        stamps.append(time.perf_counter())
    _report(stamps, memory)


def run_fused(job_args, memory: bool) -> None:
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection

    spec, batches = _batches(job_args)
    tables = FusedEmbeddingBagCollection(
        recsys_cache.torchrec_tables(spec.rows, job_args.dim), optimizer_type=torch.optim.SGD,
        optimizer_kwargs={"lr": job_args.lr}, device=torch.device("cpu"))
    model = recsys_cache.TorchRecDLRM(spec.rows, job_args.dim, job_args.bottom, job_args.top,
                                      tables=tables).load_dlrm(_dlrm(job_args, spec,
                                                                     sparse=False))
    dense_params = [p for name, p in model.named_parameters() if not name.startswith("tables.")]
    optimizer = torch.optim.SGD(dense_params, lr=job_args.lr)
    inputs = [(dense, recsys_cache.features_of(ids), label) for dense, *ids, label in batches]
    stamps = [time.perf_counter()]
    for dense, features, label in inputs:
        optimizer.zero_grad(set_to_none=True)
        F.binary_cross_entropy_with_logits(model(dense, features), label).backward()
        optimizer.step()
        stamps.append(time.perf_counter())
    _report(stamps, memory)


def run_dmp(job_args, rank: int, world_size: int, store_address: str, memory: bool) -> None:
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import ShardingEnv, ShardingType
    from torchrec.optim.keyed import KeyedOptimizerWrapper

    host, port = store_address.rsplit(":", 1)
    timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
    store = dist.TCPStore(host, int(port), world_size, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=timeout)
    try:
        spec, batches = _batches(job_args, rank, world_size)
        model = recsys_cache.TorchRecDLRM(spec.rows, job_args.dim, job_args.bottom,
                                          job_args.top).load_dlrm(_dlrm(job_args, spec,
                                                                        sparse=False))
        sharder = EmbeddingBagCollectionSharder(fused_params={
            "optimizer": EmbOptimType.EXACT_SGD, "learning_rate": job_args.lr})
        constraints = {f"table_{i}": ParameterConstraints(
            sharding_types=[ShardingType.TABLE_WISE.value]) for i in range(spec.num_tables)}
        planner = EmbeddingShardingPlanner(
            topology=Topology(world_size=world_size, compute_device="cpu"),
            constraints=constraints)
        plan = planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)
        dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(
            dist.GroupMember.WORLD), device=torch.device("cpu"), plan=plan, sharders=[sharder])
        dense_params = {name: p for name, p in dmp.named_parameters()
                        if "embedding_bags" not in name}
        optimizer = KeyedOptimizerWrapper(dense_params,
                                          lambda params: torch.optim.SGD(params, lr=job_args.lr))
        inputs = [(dense, recsys_cache.features_of(ids), label) for dense, *ids, label in batches]
        dist.barrier()
        stamps = [time.perf_counter()]
        for dense, features, label in inputs:
            optimizer.zero_grad()
            F.binary_cross_entropy_with_logits(dmp(dense, features), label).backward()
            optimizer.step()
            stamps.append(time.perf_counter())
        dist.barrier()
        if rank == 0:
            _report(stamps, memory)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("anchor", choices=["plain", "fused", "dmp"])
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--store", help="dmp: the TCPStore rank 0 meets the others at")
    parser.add_argument("--memory-report", action="store_true")
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    job_args = recsys_cache.parser().parse_args(argv[split + 1:])
    torch.set_num_threads(job_args.threads)
    if args.anchor == "plain":
        run_plain(job_args, args.memory_report)
    elif args.anchor == "fused":
        run_fused(job_args, args.memory_report)
    else:
        run_dmp(job_args, args.rank, args.world_size, args.store, args.memory_report)


if __name__ == "__main__":
    main()
