"""What a GPU user asks of splitrun, measured on one CUDA device.

- ``transport``: 64 MiB from a CUDA tensor in one process to a CUDA tensor in
  another on the same host, one way, then a one-byte ack back (medians):
  ``ring_cuda``, the shared-memory ring alone (``RingWriter.send_tensors``
  copies the device's bytes straight into the ring, registered as pinned
  memory; ``RingReader.recv_payload_into_tensor`` copies them to the
  receiver's device); ``shm_transport``, the path a job takes
  (``RoutedTransport.send`` of the CUDA tensor, ``recv``, then ``.to(device)`` as
  the executor does; ``shm_transport_unpinned``: the same with the receiver's
  buffers and rings in ordinary memory, as before jobs on CUDA pinned them).
  Baselines in one process: ``memcpy_pinned`` (device ->
  pinned host -> device, two cudaMemcpy) and ``memcpy_pageable`` (the same
  through ordinary host memory).
- ``overlap``: whether copies overlap compute. A chain of matrix products and
  a 64 MiB device -> pinned copy, timed alone, one after the other on one
  stream, and with the copy on a second stream; then splitrun's own send
  (``send_tensors`` of an unrelated tensor issued right after the products):
  ``overlap_fraction`` is the share of the shorter of the two that was hidden.
- ``nccl``: whether NCCL runs an all-reduce between two processes on one GPU
  (parallel mode's ``torch_distributed`` backend on a machine with fewer GPUs
  than group members).
- ``job``: the main job (``examples/ps_train.py``, 2 workers + 1 server)
  launched with ``--device cuda`` and with ``--device cpu``, next to the same
  model, batches and optimizer in one process on the GPU and on the CPU; and
  ``bench/ps_throughput.py``'s larger model (6.7 M parameters) on CUDA next to
  one process on the GPU. Each process's busy time per step (its step less its
  waits in receives) says where a split step's time goes.

    python bench/gpu.py [--parts transport overlap nccl job] [--repeats 3] [--epochs 5]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pathlib
import re
import statistics
import subprocess
import sys
import time
import traceback

import torch

HERE = pathlib.Path(__file__).resolve()
REPO = HERE.parents[1]
MiB = 1 << 20
SIZE = 64 * MiB
SETUP_TIMEOUT_S = 120.0
PAIR_TIMEOUT_S = 300.0
JOB_TIMEOUT_S = 600.0
TOKEN = "bench-token"


def _cuda_time(fn, repeats: int, warmup: int = 2) -> list[float]:
    """Wall seconds of `fn()` to the end of its GPU work, `repeats` times."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return times


def _rate(times: list[float], size: int = SIZE) -> dict:
    median = statistics.median(times)
    return {"median_ms": round(median * 1e3, 3), "gbytes_s": round(size / median / 1e9, 2),
            "repeats": len(times)}


# -- transport: one process's baselines ----------------------------------------------


def memcpy_baselines(repeats: int) -> dict:
    src = torch.randint(0, 255, (SIZE,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    results = {}
    for name, pinned in (("memcpy_pinned", True), ("memcpy_pageable", False)):
        host = torch.empty(SIZE, dtype=torch.uint8, pin_memory=pinned)

        def round_trip(host=host):
            host.copy_(src)
            dst.copy_(host)
        results[name] = _rate(_cuda_time(round_trip, repeats))
        assert torch.equal(dst, src)
    return results


# -- transport: two processes --------------------------------------------------------


class _RingCuda:
    """Both directions over the raw rings; the data ring is as large as a
    job's default, the ack ring small."""

    def __init__(self, role: str, prefix: str) -> None:
        from splitrun.runtime.transport.shm.ring import RingReader, RingSettings, RingWriter
        me, peer = ("a", "b") if role == "a" else ("b", "a")
        capacity = 2 * SIZE if role == "a" else 1 * MiB
        self.writer = RingWriter(prefix, f"{me}-{peer}", owner=me, peer=peer,
                                 settings=RingSettings(capacity_bytes=capacity))
        self.reader = RingReader.attach(prefix, f"{peer}-{me}", owner=me, peer=peer,
                                        timeout_s=SETUP_TIMEOUT_S)
        self.writer.wait_attached(SETUP_TIMEOUT_S)
        self.ack = torch.zeros(1, dtype=torch.uint8, device="cuda")
        self.buffer = torch.empty(SIZE, dtype=torch.uint8, device="cuda")

    def round_trip(self, payload: torch.Tensor) -> None:
        self.writer.send_tensors(b"", [payload], PAIR_TIMEOUT_S)
        self.reader.recv_header(PAIR_TIMEOUT_S)
        self.reader.recv_payload_into_tensor(self.ack, PAIR_TIMEOUT_S)

    def serve_one(self) -> torch.Tensor:
        self.reader.recv_header(PAIR_TIMEOUT_S)
        self.reader.recv_payload_into_tensor(self.buffer, PAIR_TIMEOUT_S)
        self.writer.send_tensors(b"", [self.ack], PAIR_TIMEOUT_S)
        return self.buffer

    def close(self) -> None:
        self.writer.close()
        self.reader.close()


class _ShmTransport:
    """The job's path: a RoutedTransport over shared memory between two labels, the receiver moving
    what arrives to its device as the executor does."""

    def __init__(self, role: str, prefix: str, conn, pinned: bool) -> None:
        from splitrun.runtime.transport import ChannelContract
        from splitrun.runtime.transport.grpc import GrpcSettings, GrpcTransport
        from splitrun.runtime.transport.protocol import MessageKey
        from splitrun.runtime.transport.router import RoutedTransport, TransportChoice
        from splitrun.runtime.transport.shm.transport import ShmSettings
        from splitrun.splitter.labels import Label
        self.MessageKey = MessageKey
        self.me, self.peer = (Label.worker(0), Label.worker(1)) if role == "a" else \
            (Label.worker(1), Label.worker(0))
        expected = ({"ack": ChannelContract(self.peer, ((torch.uint8, (1,)),))} if role == "a"
                    else {"data": ChannelContract(self.peer, ((torch.uint8, (SIZE,)),))})
        # A job on CUDA receives into pinned memory (Job.from_env); `pinned`
        # False shows what that buys.
        grpc = GrpcTransport(self.me, token=TOKEN, incarnation=1, contracts=expected,
                             settings=GrpcSettings(pin_receive_buffers=pinned))
        self.transport = RoutedTransport(grpc, prefix=prefix, choice=TransportChoice.SHM,
                                         settings=ShmSettings(pin_incoming=pinned))
        conn.send(self.transport.start())
        self.transport.set_peers({self.peer: _recv(conn)})
        self.ack = torch.zeros(1, dtype=torch.uint8, device="cuda")
        self.step = 0

    def round_trip(self, payload: torch.Tensor) -> None:
        step, self.step = self.step, self.step + 1
        self.transport.send(self.peer, self.MessageKey(1, step, "data"), [payload])
        ack, = self.transport.recv(self.peer, self.MessageKey(1, step, "ack"), PAIR_TIMEOUT_S)
        ack.to("cuda")

    def serve_one(self) -> torch.Tensor:
        step, self.step = self.step, self.step + 1
        data, = self.transport.recv(self.peer, self.MessageKey(1, step, "data"), PAIR_TIMEOUT_S)
        on_device = data.to("cuda")
        self.transport.send(self.peer, self.MessageKey(1, step, "ack"), [self.ack])
        return on_device

    def close(self) -> None:
        self.transport.close()


def _recv(conn):
    if not conn.poll(SETUP_TIMEOUT_S):
        raise TimeoutError(f"the other side did not answer within {SETUP_TIMEOUT_S} s")
    return conn.recv()


def _side(kind: str, role: str, prefix: str, peer, parent, repeats: int) -> None:
    try:
        torch.cuda.init()
        side = _RingCuda(role, prefix) if kind == "ring_cuda" else \
            _ShmTransport(role, prefix, peer, pinned=kind == "shm_transport")
        peer.send("ready")
        _recv(peer)
        payload = torch.randint(0, 255, (SIZE,), dtype=torch.uint8, device="cuda",
                                generator=torch.Generator("cuda").manual_seed(1))
        times, correct = [], True
        for index in range(2 + repeats):
            if role == "a":
                torch.cuda.synchronize()
                started = time.perf_counter()
                side.round_trip(payload)
                torch.cuda.synchronize()
                if index >= 2:
                    times.append(time.perf_counter() - started)
            else:
                received = side.serve_one()
                correct = correct and bool(torch.equal(received, payload))
        parent.send(("ok", (times, correct)))
        _recv(parent)
        side.close()
    except BaseException:  # noqa: BLE001 - the parent reports it
        parent.send(("error", traceback.format_exc()))


def two_process(kind: str, repeats: int) -> dict:
    from splitrun.runtime.transport.shm.ring import new_job_prefix, remove_job_segments
    ctx = mp.get_context("spawn")
    prefix = new_job_prefix()
    peer_a, peer_b = ctx.Pipe()
    parents, procs = [], []
    for role, peer in (("a", peer_a), ("b", peer_b)):
        here, there = ctx.Pipe()
        parents.append(here)
        procs.append(ctx.Process(target=_side, args=(kind, role, prefix, peer, there, repeats),
                                 daemon=True))
    for proc in procs:
        proc.start()
    try:
        outcomes = []
        for here in parents:
            if not here.poll(PAIR_TIMEOUT_S):
                raise TimeoutError(f"{kind}: a side did not finish in {PAIR_TIMEOUT_S} s")
            status, value = here.recv()
            if status != "ok":
                raise RuntimeError(f"{kind} failed:\n{value}")
            outcomes.append(value)
        for here in parents:
            here.send("close")
        times, _ = outcomes[0]
        return {**_rate(times), "bytes_equal": outcomes[1][1]}
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
        remove_job_segments(prefix)


# -- overlap -------------------------------------------------------------------------


def overlap(repeats: int) -> dict:
    """Copies against compute, on one stream and on two, and splitrun's send."""
    from splitrun.runtime.transport.shm.ring import (
        RingReader,
        RingSettings,
        RingWriter,
        new_job_prefix,
        remove_job_segments,
    )
    a = torch.randn(4096, 4096, device="cuda")
    data = torch.randint(0, 255, (SIZE,), dtype=torch.uint8, device="cuda")
    host = torch.empty(SIZE, dtype=torch.uint8, pin_memory=True)
    side = torch.cuda.Stream()

    def compute():
        out = a
        for _ in range(12):
            out = out @ a
            out = out / out.norm()
        return out

    def copy():
        host.copy_(data, non_blocking=True)

    def serial():
        compute()
        copy()

    def two_streams():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            copy()
        compute()
        torch.cuda.current_stream().wait_stream(side)

    prefix = new_job_prefix()
    try:
        writer = RingWriter(prefix, "a-b", owner="a", peer="b",
                            settings=RingSettings(capacity_bytes=2 * SIZE))
        reader = RingReader.attach(prefix, "a-b", owner="b", peer="a", timeout_s=SETUP_TIMEOUT_S)
        writer.wait_attached(SETUP_TIMEOUT_S)

        def send():  # the sender's part; the receiver only skips the bytes
            writer.send_tensors(b"", [data], PAIR_TIMEOUT_S)
            reader.recv_header(PAIR_TIMEOUT_S)
            reader.discard_payload(PAIR_TIMEOUT_S)

        def compute_then_send():
            compute()
            send()
        measured = {name: statistics.median(_cuda_time(fn, repeats)) for name, fn in (
            ("compute", compute), ("copy", copy), ("serial", serial),
            ("two_streams", two_streams), ("splitrun_send", send),
            ("compute_then_splitrun_send", compute_then_send))}
        writer.close()
        reader.close()
    finally:
        remove_job_segments(prefix)

    def hidden(alone_a, alone_b, together):
        return round((alone_a + alone_b - together) / min(alone_a, alone_b), 3)
    return {
        "ms": {name: round(value * 1e3, 3) for name, value in measured.items()},
        "overlap_fraction": {
            "one_stream": hidden(measured["compute"], measured["copy"], measured["serial"]),
            "two_streams": hidden(measured["compute"], measured["copy"],
                                  measured["two_streams"]),
            "splitrun_send_after_compute": hidden(measured["compute"],
                                                  measured["splitrun_send"],
                                                  measured["compute_then_splitrun_send"]),
        },
    }


# -- NCCL with two ranks on one GPU ---------------------------------------------------


def _nccl_rank(rank: int, path: str, parent) -> None:
    import datetime

    import torch.distributed as dist
    try:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", init_method=f"file://{path}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=60))
        value = torch.ones(4, device="cuda")
        dist.all_reduce(value)
        torch.cuda.synchronize()
        parent.send(("ok", value.tolist()))
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - the parent reports it
        parent.send(("error", f"{type(exc).__name__}: {str(exc)[:600]}"))


def nccl_on_one_gpu() -> dict:
    """Whether NCCL runs an all-reduce between two processes on the same GPU
    (what parallel mode's torch_distributed backend would ask of one GPU)."""
    import tempfile
    ctx = mp.get_context("spawn")
    folder = tempfile.mkdtemp(prefix="splitrun-nccl-")
    pipes, procs = [], []
    for rank in range(2):
        here, there = ctx.Pipe()
        pipes.append(here)
        procs.append(ctx.Process(target=_nccl_rank, args=(rank, f"{folder}/store", there),
                                 daemon=True))
    for proc in procs:
        proc.start()
    outcomes = []
    for here in pipes:
        outcomes.append(here.recv() if here.poll(90) else ("error", "no answer within 90 s"))
    for proc in procs:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    return {"ran": all(status == "ok" for status, _ in outcomes),
            "outcomes": [value for _, value in outcomes]}


# -- job -----------------------------------------------------------------------------


def one_process(device: str, epochs: int) -> float:
    """examples/ps_train.py's model, batches and optimizer, unsplit, on `device`:
    samples/s over the same loop the job times."""
    sys.path.insert(0, str(REPO / "examples"))
    import torch.nn.functional as F
    from ps_train import digits, global_batches, mlp
    torch.manual_seed(0)
    model = mlp(128).to(device)
    train_x, train_y, _, _ = digits()
    batches = global_batches(train_x, train_y, 64, epochs)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=len(batches))
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    started = time.perf_counter()
    for x, y in batches:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        schedule.step()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return len(batches) * 64 / (time.perf_counter() - started)


# Each process's closing line: its steps, their time and the part spent waiting.
PROCESS_LINE = re.compile(r"\[(worker \d+|server \d+)\] (\d+) steps in ([0-9.]+) s;.* waited "
                          r"([0-9.]+) s in receives")


def launched(device: str, script: pathlib.Path, *args: str) -> tuple[str, dict]:
    """The output of `splitrun launch --workers 2 --servers 1 --device DEVICE
    SCRIPT ARGS`, and per process its milliseconds per step busy (not waiting
    in a receive)."""
    argv = [sys.executable, "-m", "splitrun.launcher", "--log-level", "INFO", "launch",
            "--workers", "2", "--servers", "1", "--device", device, str(script), *args]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True,
                          timeout=JOB_TIMEOUT_S)
    output = done.stdout + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited with {done.returncode}:\n{output[-4000:]}")
    busy = {name: round((float(total) - float(waited)) * 1e3 / int(steps), 2)
            for name, steps, total, waited in PROCESS_LINE.findall(output)}
    return output, busy


def main_job(device: str, epochs: int) -> dict:
    output, busy = launched(device, REPO / "examples" / "ps_train.py", "--epochs", str(epochs))
    rate = re.search(r"\(([0-9.]+) samples/s\)", output)
    accuracy = re.search(r"held-out accuracy: ([0-9.]+)", output)
    return {"samples_s": float(rate.group(1)), "accuracy": float(accuracy.group(1)),
            "busy_ms_per_step": busy}


def ps_bench_model(device: str, steps: int) -> dict:
    """bench/ps_throughput.py's job (an MLP of 6.7 M parameters, global batch
    128, SGD with momentum) on 2 workers + 1 server."""
    output, busy = launched(device, HERE.parent / "ps_throughput.py", "--job", "--steps",
                            str(steps))
    line = next(text for text in output.splitlines() if "BENCH " in text)
    return {"steps_s": json.loads(line.split("BENCH ", 1)[1])["steps_per_s"],
            "busy_ms_per_step": busy}


def ps_bench_model_one_process(device: str, steps: int) -> float:
    sys.path.insert(0, str(HERE.parent))
    import ps_throughput
    net = ps_throughput.model(1700).to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    data = [(x.to(device), y.to(device))
            for x, y in ps_throughput.batches(steps + ps_throughput.WARMUP_STEPS, 128)]
    started = None
    for index, (x, y) in enumerate(data):
        if index == ps_throughput.WARMUP_STEPS:
            torch.cuda.synchronize()
            started = time.perf_counter()
        optimizer.zero_grad()
        ps_throughput.loss_fn(net, x, y).backward()
        optimizer.step()
    torch.cuda.synchronize()
    return steps / (time.perf_counter() - started)


def job(repeats: int, epochs: int) -> dict:
    results: dict = {}
    for device in ("cuda", "cpu"):
        runs = [main_job(device, epochs) for _ in range(repeats)]
        single = [one_process(device, epochs) for _ in range(repeats)]
        split = statistics.median(r["samples_s"] for r in runs)
        results[device] = {
            "splitrun_2w_1s_samples_s": round(split, 1),
            "accuracy": [r["accuracy"] for r in runs],
            "busy_ms_per_step": runs[0]["busy_ms_per_step"],
            "one_process_samples_s": round(statistics.median(single), 1),
            "splitrun_vs_one_process": round(split / statistics.median(single), 3),
        }
    return results


def ps_model(repeats: int, steps: int = 40) -> dict:
    runs = [ps_bench_model("cuda", steps) for _ in range(repeats)]
    single = statistics.median(ps_bench_model_one_process("cuda", steps) for _ in range(repeats))
    split = statistics.median(r["steps_s"] for r in runs)
    return {"splitrun_2w_1s_steps_s": round(split, 2),
            "busy_ms_per_step": runs[0]["busy_ms_per_step"],
            "one_process_steps_s": round(single, 2),
            "splitrun_vs_one_process": round(split / single, 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", default=["transport", "overlap", "nccl", "job"],
                        choices=["transport", "overlap", "nccl", "job"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=5, help="of the main job")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"benchmark": "gpu", "error": "no CUDA device"}))
        return 2
    out: dict = {"benchmark": "gpu", "device": torch.cuda.get_device_name(),
                 "torch": torch.__version__, "cuda": torch.version.cuda,
                 "cpus": os.cpu_count()}
    started = time.perf_counter()
    if "transport" in args.parts:
        results = memcpy_baselines(10 * args.repeats)
        for kind in ("ring_cuda", "shm_transport", "shm_transport_unpinned"):
            results[kind] = two_process(kind, 10 * args.repeats)
            results[kind]["vs_memcpy_pinned"] = round(
                results[kind]["gbytes_s"] / results["memcpy_pinned"]["gbytes_s"], 3)
        out["transport_64MiB"] = results
    if "overlap" in args.parts:
        out["overlap"] = overlap(5 * args.repeats)
    if "nccl" in args.parts:
        out["nccl_two_ranks_one_gpu"] = nccl_on_one_gpu()
    if "job" in args.parts:
        out["main_job"] = job(args.repeats, args.epochs)
        out["ps_bench_model_cuda"] = ps_model(args.repeats)
    out["wall_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
