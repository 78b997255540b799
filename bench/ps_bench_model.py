"""The parameter-server benchmark's model, data and measuring helpers, shared
by bench/ps_throughput.py (the driver and the splitrun job it launches) and
bench/ps_rpc_baselines.py (the torch.distributed.rpc servers it measures
against)."""

from __future__ import annotations

import json
import pathlib
import resource
import socket
import time

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["RUN_TIMEOUT_S", "WARMUP_STEPS", "batches", "bench_line", "cpu_ms", "free_port",
           "join_or_kill", "loss_fn", "model", "page_faults"]

# Bounds one whole measured run (start, warm-up, steps, shutdown) on 2 cores.
RUN_TIMEOUT_S = 900
WARMUP_STEPS = 3


def model(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


def batches(steps: int, batch_size: int):
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(batch_size, 512, generator=generator),
             torch.randint(0, 10, (batch_size,), generator=generator)) for _ in range(steps)]


def loss_fn(m, x, y):
    return F.cross_entropy(m(x), y)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_ms(cpu_started: float, steps: int) -> float:
    """CPU time of this process (all its threads) per step since `cpu_started`."""
    return (time.process_time() - cpu_started) * 1000 / steps


def page_faults() -> int:
    """This process's minor page faults so far: each first touch of a page
    (memory newly allocated from the system) costs one, in kernel time."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def bench_line(path: pathlib.Path) -> float:
    for line in path.read_text(errors="replace").splitlines():
        if "BENCH " in line:
            return json.loads(line.split("BENCH ", 1)[1])["steps_per_s"]
    raise RuntimeError(f"no BENCH line in {path}:\n{path.read_text(errors='replace')[-4000:]}")


def join_or_kill(processes) -> None:
    """Wait for the run's processes to end; kill one still running after a minute."""
    for process in processes:
        process.join(timeout=60)
        if process.is_alive():
            process.kill()
            process.join(timeout=10)
