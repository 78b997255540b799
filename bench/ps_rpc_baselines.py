"""The torch.distributed.rpc parameter servers bench/ps_throughput.py measures
splitrun against: PyTorch's parameter-server tutorial (the server runs the
forward, trainers backpropagate through distributed autograd) and a
synchronous batch-update server (trainers send gradients, the server averages,
steps and returns the parameters). One server and two trainers, as processes
on this host (`run_rpc`) or across two simulated hosts (`rpc_two_hosts`,
which starts this file as a command once per rank).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import threading
import time

import torch
import torch.nn.functional as F
from ps_bench_model import (
    RUN_TIMEOUT_S,
    WARMUP_STEPS,
    batches,
    bench_line,
    free_port,
    join_or_kill,
    loss_fn,
    model,
)
from torch import nn

__all__ = ["rpc_two_hosts", "run_rpc"]

HERE = pathlib.Path(__file__).resolve()
# The RPC rendezvous port on host a: its namespace is fresh and private to
# this run, so no other program can hold the port.
RPC_RENDEZVOUS_PORT = 29500


class _BatchUpdateServer:
    """Holds the model; `update_and_fetch` waits for every trainer's gradients,
    averages them, steps the optimizer and returns the new parameters."""

    def __init__(self, width: int, num_trainers: int) -> None:
        self.net = model(width)
        self.optimizer = torch.optim.SGD(self.net.parameters(), lr=0.01, momentum=0.9)
        self.num_trainers = num_trainers
        self.lock = threading.Lock()
        self.pending = 0
        self.future = torch.futures.Future()
        for p in self.net.parameters():
            p.grad = torch.zeros_like(p)

    def params(self):
        return [p.detach() for p in self.net.parameters()]

    @staticmethod
    @torch.distributed.rpc.functions.async_execution
    def update_and_fetch(server_rref, grads):
        self = server_rref.local_value()
        with self.lock:
            for p, g in zip(self.net.parameters(), grads):
                p.grad += g
            self.pending += 1
            future = self.future
            if self.pending == self.num_trainers:
                for p in self.net.parameters():
                    p.grad /= self.num_trainers
                self.optimizer.step()
                for p in self.net.parameters():
                    p.grad.zero_()
                self.pending = 0
                self.future = torch.futures.Future()
                future.set_result(self.params())
        return future


_SERVER: _BatchUpdateServer | None = None
_SERVER_LOCK = threading.Lock()


def _the_server(width: int, num_trainers: int) -> _BatchUpdateServer:
    """Runs on the PS process: every trainer's RRef points at one server object."""
    global _SERVER
    with _SERVER_LOCK:
        if _SERVER is None:
            _SERVER = _BatchUpdateServer(width, num_trainers)
        return _SERVER


class _TutorialServer(nn.Module):
    """PyTorch's parameter-server tutorial: the server holds the model and runs
    its forward for every trainer; trainers backpropagate through distributed
    autograd and a DistributedOptimizer steps the server's parameters
    (asynchronously: each trainer's step updates them)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = model(width)

    def forward(self, x):
        # Each trainer's DistributedOptimizer steps these parameters in place
        # while another trainer's backward may still need them (the tutorial's
        # asynchronous updates): autograd then refuses the modified saved
        # tensors. Running the forward on copies keeps the tutorial's design
        # (gradients still reach the parameters through the copies) and costs
        # one copy of the parameters per forward.
        copies = {name: p.clone() for name, p in self.net.named_parameters()}
        return torch.func.functional_call(self.net, copies, (x,))

    def param_rrefs(self):
        from torch.distributed import rpc
        return [rpc.RRef(p) for p in self.net.parameters()]


_TUTORIAL: _TutorialServer | None = None


def _the_tutorial_server(width: int) -> _TutorialServer:
    global _TUTORIAL
    with _SERVER_LOCK:
        if _TUTORIAL is None:
            _TUTORIAL = _TutorialServer(width)
        return _TUTORIAL


def _report(results, steps_per_s: float) -> None:
    """Hand trainer 1's speed to the parent: its queue, or stdout when it was
    started as a command (on a simulated host)."""
    if results is None:
        print("BENCH " + json.dumps({"steps_per_s": steps_per_s}), flush=True)
    else:
        results.put(steps_per_s)


def _call(method, rref, *args):
    return method(rref.local_value(), *args)


def _tutorial_trainer(rank: int, world: int, args, results) -> None:
    import torch.distributed.autograd as dist_autograd
    from torch.distributed import rpc
    from torch.distributed.optim import DistributedOptimizer

    server = rpc.remote("ps", _the_tutorial_server, args=(args.width,))
    param_rrefs = rpc.rpc_sync("ps", _call, args=(_TutorialServer.param_rrefs, server))
    optimizer = DistributedOptimizer(torch.optim.SGD, param_rrefs, lr=0.01, momentum=0.9)
    shard = args.batch_size // (world - 1)
    lo = (rank - 1) * shard
    started = None
    for index, (x, y) in enumerate(batches(args.steps + WARMUP_STEPS, args.batch_size)):
        if index == WARMUP_STEPS:
            started = time.perf_counter()
        with dist_autograd.context() as context:
            out = rpc.rpc_sync("ps", _call, args=(_TutorialServer.forward, server,
                                                   x[lo:lo + shard]))
            loss = F.cross_entropy(out, y[lo:lo + shard])
            dist_autograd.backward(context, [loss])
            optimizer.step(context)
    if rank == 1:
        _report(results, args.steps / (time.perf_counter() - started))


def rpc_process(rank: int, world: int, init_method: str, args, results, tutorial: bool,
                 tcp_only: bool = False) -> None:
    from torch.distributed import rpc
    torch.set_num_threads(1)
    # Across the simulated hosts TensorPipe must use TCP ("uv", "basic"): its
    # shared-memory and cross-memory-attach channels see one machine through
    # the namespaces and would carry the tensors around the shaped link.
    extra = {"_transports": ["uv"], "_channels": ["basic"]} if tcp_only else {}
    options = rpc.TensorPipeRpcBackendOptions(init_method=init_method,
                                              rpc_timeout=RUN_TIMEOUT_S, **extra)
    name = "ps" if rank == 0 else f"trainer{rank}"
    rpc.init_rpc(name, rank=rank, world_size=world, rpc_backend_options=options)
    if rank != 0 and tutorial:
        _tutorial_trainer(rank, world, args, results)
    elif rank != 0:
        server = rpc.remote("ps", _the_server, args=(args.width, world - 1))
        net = model(args.width)
        shard = args.batch_size // (world - 1)
        data = batches(args.steps + WARMUP_STEPS, args.batch_size)
        started = None
        for index, (x, y) in enumerate(data):
            if index == WARMUP_STEPS:
                started = time.perf_counter()
            lo = (rank - 1) * shard
            net.zero_grad()
            loss_fn(net, x[lo:lo + shard], y[lo:lo + shard]).backward()
            new = rpc.rpc_sync("ps", _BatchUpdateServer.update_and_fetch,
                               args=(server, [p.grad for p in net.parameters()]))
            with torch.no_grad():
                for p, value in zip(net.parameters(), new):
                    p.copy_(value)
        if rank == 1:
            _report(results, args.steps / (time.perf_counter() - started))
    rpc.shutdown()


def run_rpc(args, tutorial: bool) -> float:
    import torch.multiprocessing as mp
    context = mp.get_context("spawn")
    results = context.Queue()
    world = 3  # one server, two trainers
    port = free_port()
    processes = [context.Process(target=rpc_process,
                                 args=(rank, world, f"tcp://127.0.0.1:{port}", args, results,
                                       tutorial))
                 for rank in range(world)]
    for process in processes:
        process.start()
    try:
        steps_per_s = results.get(timeout=RUN_TIMEOUT_S)
    finally:
        join_or_kill(processes)
    return steps_per_s


def rpc_two_hosts(args, hosts, workdir: pathlib.Path, tutorial: bool) -> float:
    """The RPC server (rank 0, the rendezvous) on host a, trainers 1 and 2 on b."""
    from joined_job import wait_all
    processes, logs = [], []
    for host, rank in ((hosts.a, 0), (hosts.b, 1), (hosts.b, 2)):
        env = dict(os.environ, TP_SOCKET_IFNAME=host.device, GLOO_SOCKET_IFNAME=host.device,
                   OMP_NUM_THREADS="1")
        log = workdir / f"rpc{rank}.log"
        with open(log, "w") as out:
            processes.append(host.popen(
                [sys.executable, str(HERE), "--rank", str(rank),
                 "--init", f"tcp://{hosts.a.address}:{RPC_RENDEZVOUS_PORT}",
                 *(["--tutorial"] if tutorial else []), "--steps", str(args.steps),
                 "--width", str(args.width), "--batch-size", str(args.batch_size)],
                stdout=out, stderr=subprocess.STDOUT, env=env))
        logs.append(log)
    wait_all(processes, logs, f"torch.rpc ({'tutorial' if tutorial else 'batch update'}) "
                              f"across two hosts", RUN_TIMEOUT_S)
    return bench_line(logs[1])


def main() -> None:
    """One process of an RPC run on a simulated host (rpc_two_hosts)."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--init", required=True, help="the rendezvous, tcp://ADDRESS:PORT")
    parser.add_argument("--tutorial", action="store_true")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--width", type=int, required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    args = parser.parse_args()
    rpc_process(args.rank, 3, args.init, args, None, args.tutorial, tcp_only=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
