"""Parallel mode: bytes and collectives per step under the three propagation
policies, next to PyTorch DTensor running the same model, and step times.

Models (the layers each marks):
- mlp: a column-parallel then a row-parallel linear, MSE loss;
- vocab: a vocabulary-parallel embedding, a column-parallel head, parallel
  cross-entropy (DTensor: RowwiseParallel embedding, ColwiseParallel head with
  sharded output, `loss_parallel`);
- norm: only the first linear of a linear-gelu-linear-residual-LayerNorm-linear
  block pinned (DTensor: Colwise then Rowwise, the rest plain);
- dp: data parallelism inside a group (the batch and activations pinned S(0);
  baseline: DDP, whose gradient all-reduce is counted with the ring model).

Bytes, stated precisely:
- splitrun `bytes_total`: bytes that leave all processes of the group per step,
  as the executors' send counters count them (equal to the plan's prediction,
  checked here); `bytes_per_rank` = total / N.
- DTensor: the functional collectives each rank issues in one training step
  (forward, backward, optimizer), caught with a TorchDispatchMode; their input
  sizes and counts are reported as they are, and `bytes_per_rank` is what a
  ring implementation sends for them (all-reduce 2(N-1)/N·|v|, all-gather and
  reduce-scatter (N-1)/N of the full value). gloo's own algorithms differ; no
  counter of gloo's wire bytes is exposed.

Step times: splitrun runs every member as a thread over loopback
(`run_threaded`), DTensor as N processes over gloo, the unsharded step in one
process; all on the same 2 shared cores, so no speed-up is expected.

Collective backends (`backends` row per model and group size): the `global`
layout run with its collectives as splitrun channels and on a gloo process
group (`backend="torch_distributed"`), alternately, in the same run: the
median step time of each (steps after the first, which forms the gloo group;
the slowest member per step), and their ratio. Threads of one process by
default (channels then ride the in-process loopback, gloo real sockets on
127.0.0.1); with `--launched`, real processes started by `splitrun launch`
(channels over shared memory/gRPC).

`global` chooses with a fixed cost per collective (`collective_latency_bytes`,
8 KiB per rank by default); `global_bytes_only` is the same search on bytes
alone, for comparison.

    python bench/parallel.py [--ranks 2 4] [--steps 6] [--no-dtensor]
                             [--backend-steps 12] [--backend-repeats 3] [--launched]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch
import torch.multiprocessing as mp
from torch import nn
from torch.nn import functional as F

from splitrun.runtime import LoopbackHub, ProcessRuntime, receive_contracts, run_threaded
from splitrun.runtime.cluster.rendezvous import InProcessRendezvous
from splitrun.splitter import (
    Cluster,
    ParallelCrossEntropyLoss,
    ParallelEmbedding,
    ParallelLinear,
    ParallelMode,
    capture,
    constrain,
    optim,
    split_program,
)

BATCH, IN, HIDDEN, OUT = 32, 64, 128, 64
VOCAB, DIM, TOKENS = 256, 32, 16
LR = 0.01
POLICIES = ("first", "greedy", "global")
DTENSOR_TIMEOUT_S = 300


# -- the models, once as splitrun marks them and once plain (for DTensor) ----------

class MLP(nn.Module):
    def __init__(self, parallel: bool = True) -> None:
        super().__init__()
        make = ParallelLinear if parallel else (lambda i, o, dim=None: nn.Linear(i, o))
        self.l1 = make(IN, HIDDEN, dim=-1)
        self.l2 = make(HIDDEN, OUT, dim=0)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x)))


class Vocab(nn.Module):
    def __init__(self, parallel: bool = True) -> None:
        super().__init__()
        self.emb = ParallelEmbedding(VOCAB, DIM, dim=0) if parallel else nn.Embedding(VOCAB, DIM)
        self.head = ParallelLinear(DIM, VOCAB, dim=-1) if parallel else nn.Linear(DIM, VOCAB)
        self.parallel = parallel

    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids)))


class Norm(nn.Module):
    def __init__(self, parallel: bool = True) -> None:
        super().__init__()
        self.up = ParallelLinear(IN, HIDDEN, dim=-1) if parallel else nn.Linear(IN, HIDDEN)
        self.down = nn.Linear(HIDDEN, IN)
        self.norm = nn.LayerNorm(IN)
        self.out = nn.Linear(IN, OUT)

    def forward(self, x):
        return self.out(self.norm(self.down(F.gelu(self.up(x))) + x))


class DataParallel(nn.Module):
    """The batch and every activation pinned S(0): each member computes its
    rows (left free, propagation would rather gather the small batch)."""

    def __init__(self, parallel: bool = True) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(IN, HIDDEN), nn.Linear(HIDDEN, OUT)
        self.parallel = parallel

    def forward(self, x):
        if not self.parallel:
            return self.l2(torch.relu(self.l1(x)))
        hidden = constrain(torch.relu(self.l1(constrain(x, "S(0)"))), "S(0)")
        return constrain(self.l2(hidden), "S(0)")


def mse(model, x, y):
    return F.mse_loss(model(x), y)


def vocab_loss(model, ids, targets):
    logits = model(ids).reshape(-1, VOCAB)
    if getattr(model, "parallel", False):
        return ParallelCrossEntropyLoss()(logits, targets.reshape(-1))
    return F.cross_entropy(logits, targets.reshape(-1))


MODELS = {"mlp": (MLP, mse), "vocab": (Vocab, vocab_loss), "norm": (Norm, mse),
          "dp": (DataParallel, mse)}


def batches(name: str, steps: int):
    gen = torch.Generator().manual_seed(1)
    if name == "vocab":
        return [(torch.randint(0, VOCAB, (BATCH // 4, TOKENS), generator=gen),
                 torch.randint(0, VOCAB, (BATCH // 4, TOKENS), generator=gen))
                for _ in range(steps)]
    return [(torch.randn(BATCH, IN, generator=gen), torch.randn(BATCH, OUT, generator=gen))
            for _ in range(steps)]


# -- splitrun --------------------------------------------------------------------------

def build(name: str, steps: int):
    cls, loss_fn = MODELS[name]
    data = batches(name, steps)
    torch.manual_seed(0)
    program = capture(cls(), loss_fn, optim.Adam(lr=LR), data[0])
    feeds = lambda s: {"batch.0": data[s][0], "batch.1": data[s][1]}  # noqa: E731
    return program, feeds


def splitrun_side(name: str, n: int, steps: int) -> dict:
    program, feeds = build(name, steps)
    result = {}
    for policy in (*POLICIES, "global_bytes_only"):
        started = time.perf_counter()
        mode = ParallelMode(policy="global", collective_latency_bytes=0) \
            if policy == "global_bytes_only" else ParallelMode(policy=policy)
        split = split_program(program, Cluster(num_workers=n), mode)
        plan_s = time.perf_counter() - started
        layout = split.artifacts
        entry = {"bytes_total": layout.bytes_per_step,
                 "bytes_per_rank": layout.bytes_per_step / n,
                 "collectives": len(layout.collectives),
                 "kinds": sorted({c.kind.value for c in layout.collectives}),
                 "plan_s": round(plan_s, 3)}
        if policy == "global":
            run = run_threaded(split, steps, feeds)
            sent = sum(s.bytes_sent for s in run.stats.values()) / steps
            assert sent == layout.bytes_per_step, (sent, layout.bytes_per_step)
            entry["counted_bytes_total"] = sent
            times = [s.step_s / max(1, s.steps) for s in run.stats.values()]
            entry["step_s_threads"] = round(max(times), 5)
        result[policy] = entry
    started = time.perf_counter()
    program.train_unsplit(steps, feeds)
    result["unsharded_step_s"] = round((time.perf_counter() - started) / steps, 5)
    return result


# -- the two collective backends ------------------------------------------------------

BACKENDS = ("channels", "torch_distributed")
# Bounds one receive or collective of a benchmarked step.
STEP_TIMEOUT_S = 120.0
# Bounds one launched job (start, steps, teardown) on a loaded machine.
LAUNCH_TIMEOUT_S = 600.0


def _threaded_step_times(split, steps: int, feeds) -> list[float]:
    """Every member a thread (as `run_threaded`), timing each step: per step
    the slowest member's time."""
    plan = split.plan
    hub = LoopbackHub(plan.labels)
    rendezvous = InProcessRendezvous(STEP_TIMEOUT_S)
    processes = {label: ProcessRuntime(split, label, hub.transport(label),
                                       recv_timeout_s=STEP_TIMEOUT_S, rendezvous=rendezvous)
                 for label in plan.labels}
    for label in plan.labels:
        hub.transport(label).expect(receive_contracts(plan, split.program, label))
    times = {label: [] for label in plan.labels}
    failures = []

    def work(label, process):
        try:
            for step in range(steps):
                started = time.perf_counter()
                process.run_step(step, feeds(step))
                times[label].append(time.perf_counter() - started)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            failures.append(exc)
            hub.abort(exc)

    threads = [threading.Thread(target=work, args=item, daemon=True)
               for item in processes.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(steps * STEP_TIMEOUT_S)
    for process in processes.values():
        process.close()
    if failures or any(t.is_alive() for t in threads):
        raise RuntimeError(f"benchmark run failed: {failures or 'a member hangs'}")
    return [max(per[step] for per in times.values()) for step in range(steps)]


def _launched_step_times(name: str, n: int, steps: int, backend: str) -> list[float]:
    """A real job: `splitrun launch --workers n` of this file's `--job` mode."""
    with tempfile.TemporaryDirectory() as workdir:
        out = pathlib.Path(workdir) / "times.json"
        launcher = pathlib.Path(sys.executable).with_name("splitrun")
        proc = subprocess.run(
            [str(launcher), "launch", "--workers", str(n), __file__, "--job", name,
             "--backend", backend, "--backend-steps", str(steps), "--out", str(out)],
            capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
        if proc.returncode != 0:
            raise RuntimeError(f"launched {backend} job failed:\n{proc.stdout[-3000:]}"
                               f"{proc.stderr[-3000:]}")
        return json.loads(out.read_text())["step_s"]


def backends_side(name: str, n: int, steps: int, repeats: int, launched: bool) -> dict:
    """Median step time (steps after the first) per backend, runs alternating."""
    program, feeds = build(name, steps)
    medians: dict[str, list[float]] = {b: [] for b in BACKENDS}
    for _ in range(repeats):
        for backend in BACKENDS:
            if launched:
                times = _launched_step_times(name, n, steps, backend)
            else:
                split = split_program(program, Cluster(num_workers=n),
                                      ParallelMode(backend=backend))
                times = _threaded_step_times(split, steps, feeds)
            medians[backend].append(statistics.median(times[1:]))
    result = {"where": "processes (splitrun launch)" if launched else "threads",
              "steps": steps, "repeats": repeats}
    for backend in BACKENDS:
        result[f"{backend}_step_s"] = round(statistics.median(medians[backend]), 5)
    result["torch_distributed_vs_channels"] = round(
        result["torch_distributed_step_s"] / result["channels_step_s"], 3)
    return result


def run_job(args) -> int:
    """`--job NAME` under `splitrun launch`: train, worker 0 writes step times."""
    from splitrun.runtime import Job

    job = Job.from_env()
    program, feeds = build(args.job, args.backend_steps)
    trainer = job.start(program, ParallelMode(backend=args.backend))
    times = []
    for step in range(args.backend_steps):
        started = time.perf_counter()
        trainer.step(feeds(step))
        times.append(time.perf_counter() - started)
    trainer.finish()
    if job.is_driver:
        pathlib.Path(args.out).write_text(json.dumps({"step_s": times}))
    return 0


# -- DTensor ---------------------------------------------------------------------------

_COLLECTIVE_NAMES = ("all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter",
                     "all_to_all", "broadcast")


def _ring_bytes(op: str, nbytes: int, n: int) -> float:
    if "all_reduce" in op or "allreduce" in op:
        return 2 * (n - 1) / n * nbytes
    if "all_gather" in op or "allgather" in op:
        return (n - 1) * nbytes             # input is the local shard
    if "reduce_scatter" in op:
        return (n - 1) / n * nbytes          # input is the full value
    if "all_to_all" in op:
        return (n - 1) / n * nbytes
    return 0.0


def _dtensor_worker(rank: int, n: int, name: str, steps: int, port: int, queue) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        loss_parallel,
        parallelize_module,
    )
    from torch.utils._python_dispatch import TorchDispatchMode

    class Collectives(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[tuple[str, int]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            # As CommDebugMode does: let DTensor desugar its ops first, so the
            # collectives it issues come back through this mode.
            if any(t is DTensor for t in types):
                return NotImplemented
            if isinstance(func, torch._ops.HigherOrderOperator):
                return func(*args, **(kwargs or {}))
            namespace = getattr(func, "namespace", "")
            if namespace in ("_c10d_functional", "c10d_functional", "c10d"):
                tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
                if isinstance(tensor, (list, tuple)):
                    tensor = tensor[0]
                size = tensor.numel() * tensor.element_size() if tensor is not None else 0
                if any(k in func.__name__ for k in _COLLECTIVE_NAMES):
                    self.calls.append((func.__name__, size))
            return func(*args, **(kwargs or {}))

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=n)
    try:
        mesh = init_device_mesh("cpu", (n,))
        cls, _ = MODELS[name]
        torch.manual_seed(0)
        model = cls(parallel=False)
        if name == "mlp":
            parallelize_module(model, mesh, {"l1": ColwiseParallel(), "l2": RowwiseParallel()})
        elif name == "norm":
            parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        elif name == "vocab":
            parallelize_module(model, mesh, {
                "emb": RowwiseParallel(input_layouts=Replicate()),
                "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})
        elif name == "dp":
            model = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.Adam(model.parameters(), lr=LR)
        data = batches(name, steps)
        times, counted = [], None
        for step, (x, y) in enumerate(data):
            if name == "dp":
                x, y = x.chunk(n)[rank], y.chunk(n)[rank]
            mode = Collectives() if step == 1 else None
            started = time.perf_counter()
            if mode is not None:
                mode.__enter__()
            try:
                if name == "vocab":
                    with loss_parallel():
                        logits = model(x).reshape(-1, VOCAB)
                        loss = F.cross_entropy(logits, y.reshape(-1))
                        loss.backward()
                else:
                    F.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
            finally:
                if mode is not None:
                    mode.__exit__(None, None, None)
                    counted = mode.calls
            times.append(time.perf_counter() - started)
        if name == "dp":  # DDP's reducer calls gloo directly: the ring model of its buckets
            params = sum(p.numel() * p.element_size() for p in model.parameters())
            counted = [("ddp_gradient_allreduce", params)]
        if rank == 0:
            queue.put({"calls": counted, "step_s": statistics.median(times[1:])})
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dtensor_side(name: str, n: int, steps: int) -> dict:
    context = mp.get_context("spawn")
    queue = context.Queue()
    port = _free_port()
    procs = [context.Process(target=_dtensor_worker, args=(r, n, name, steps, port, queue))
             for r in range(n)]
    for proc in procs:
        proc.start()
    try:
        report = queue.get(timeout=DTENSOR_TIMEOUT_S)
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    calls = report["calls"]
    per_rank = sum(_ring_bytes(op, size, n) for op, size in calls)
    return {"bytes_per_rank_ring": per_rank, "bytes_total_ring": per_rank * n,
            "collectives": len(calls), "calls": [[op, size] for op, size in calls],
            "step_s": round(report["step_s"], 5)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--no-dtensor", action="store_true")
    parser.add_argument("--backend-steps", type=int, default=12,
                        help="steps per run of the backends row")
    parser.add_argument("--backend-repeats", type=int, default=3)
    parser.add_argument("--launched", action="store_true",
                        help="the backends row from real processes (splitrun launch)")
    parser.add_argument("--no-backends", action="store_true")
    parser.add_argument("--job", choices=list(MODELS), help=argparse.SUPPRESS)
    parser.add_argument("--backend", default="channels", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.job:
        return run_job(args)
    results = []
    for name in args.models:
        for n in args.ranks:
            entry = {"model": name, "ranks": n, "splitrun": splitrun_side(name, n, args.steps)}
            if not args.no_backends:
                entry["backends"] = backends_side(name, n, args.backend_steps,
                                                  args.backend_repeats, args.launched)
            if not args.no_dtensor:
                entry["dtensor"] = dtensor_side(name, n, args.steps)
                ours = entry["splitrun"]["global"]
                entry["global_vs_dtensor_bytes_per_rank"] = round(
                    ours["bytes_per_rank"] / max(entry["dtensor"]["bytes_per_rank_ring"], 1), 3)
            results.append(entry)
            print(json.dumps(entry), file=sys.stderr, flush=True)
    print(json.dumps({"bench": "parallel", "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
