"""Throughput and round-trip latency of splitrun's GrpcTransport between two
processes, against baselines measured in the same run.

For each payload size one round trip is: the payload from process A to
process B, then a one-byte reply from B to A. The median round trip gives the
latency and size / latency the throughput. Baselines, same pattern:

- ``tcp``: a raw TCP socket over loopback (``sendall`` / ``recv_into`` into a
  reused buffer, a one-byte ack);
- ``grpc_unary``: a bare grpcio unary call carrying the payload (raw bytes, no
  protobuf), whose empty reply is the ack;
- ``grpc_stream``: a bare grpcio stream-unary call carrying the payload in
  1 MiB requests (raw bytes, cut before timing): grpcio's own ceiling for a
  chunked bulk transfer, with no copy or check of splitrun's;
- ``gloo``: torch.distributed send/recv, world size 2, FileStore rendezvous;
- ``splitrun``: ``GrpcTransport.send`` of a uint8 tensor, ``recv`` on the
  other side, a one-element tensor back;
- ``splitrun_tcp``: the same through splitrun's TCP data plane
  (``RoutedTransport``, SPLITRUN_TRANSPORT=tcp), what a job uses between hosts,
  with gRPC as its control plane;
- ``splitrun_tcp1``: the same with one connection per peer
  (``TcpSettings(stripes=1)``): what striping a large message over several
  connections gains;
- ``splitrun_shm``: the same through ``RoutedTransport`` over shared memory (the
  pair is on one host), as a job started by ``splitrun launch`` uses it.

Every process sets ``torch.set_num_threads(1)``: on a 2-core machine torch's
intra-op threads only compete with the transports' own threads. The
transports take turns in rounds (each round starts a fresh pair of processes
per transport), so a machine that slows down mid-run does not bias one
transport against another; medians are over all rounds.

    python bench/transport.py [--quick] [--rounds N] [--sizes 4096 65536 ...]
                              [--kinds ...] [--chunk-bytes N]
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import time
import traceback

KiB, MiB = 1 << 10, 1 << 20
SIZES = [4 * KiB, 64 * KiB, MiB, 16 * MiB, 64 * MiB, 256 * MiB]
KINDS = ["tcp", "grpc_unary", "grpc_stream", "gloo", "splitrun", "splitrun_tcp", "splitrun_shm"]
# Also measurable, not run by default: the tcp data plane on one connection per peer.
EXTRA_KINDS = ["splitrun_tcp1"]
# splitrun between processes that share no memory (issue 28): 64 MiB at >= 1.0x
# gloo and >= 0.8x raw TCP; a 4 KiB round trip in <= 2x gloo's.
GOAL_64MIB_VS_GLOO = 1.0
GOAL_64MIB_VS_TCP = 0.8
GOAL_4KIB_VS_GLOO = 2.0
# splitrun over shared memory (issue 12): 64 MiB at >= 2x gloo and >= 1.5x raw
# TCP; a 4 KiB round trip in <= 0.5x a bare grpcio unary call's.
GOAL_SHM_64MIB_VS_GLOO = 2.0
GOAL_SHM_64MIB_VS_TCP = 1.5
GOAL_SHM_4KIB_VS_GRPC = 0.5
# Bounds one pair of processes (start-up plus all sizes); a full run takes far less.
PAIR_TIMEOUT_S = 600.0
# Bounds the start-up handshake between the two processes of a pair.
SETUP_TIMEOUT_S = 120.0
TOKEN = "bench-token"


def _repeats(size: int, quick: bool) -> int:
    """Timed round trips per size and round: many for small payloads (noisy),
    fewer for large ones."""
    full = 200 if size <= 64 * KiB else 60 if size <= MiB else 15 if size <= 16 * MiB else 6
    return max(3, full // 4) if quick else full


def _warmup(size: int) -> int:
    return 20 if size <= MiB else 2


# -- one side of each transport ------------------------------------------------------


class _Hosts:
    """Where each side of a pair listens: loopback, or (--two-hosts) the
    addresses of the two simulated hosts, set in each child process."""

    a = "127.0.0.1"
    b = "127.0.0.1"
    mine = "127.0.0.1"


def _enter_namespace(namespace: str) -> None:
    """Move this process into a network namespace made by bench/hosts.py."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            raise OSError(ctypes.get_errno(), f"setns into {namespace} failed")
    finally:
        os.close(fd)


class _Tcp:
    def __init__(self, role: str, conn, sizes: list[int]) -> None:
        if role == "a":
            server = socket.create_server((_Hosts.a, 0))
            conn.send(server.getsockname()[1])
            server.settimeout(SETUP_TIMEOUT_S)
            self.sock, _ = server.accept()
            server.close()
        else:
            port = conn.recv()
            self.sock = socket.create_connection((_Hosts.a, port), timeout=SETUP_TIMEOUT_S)
        self.sock.settimeout(PAIR_TIMEOUT_S)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buffer = memoryview(bytearray(max(sizes)))
        self.ack = bytearray(1)

    def round_trip(self, payload: memoryview) -> None:
        self.sock.sendall(payload)
        self.sock.recv_into(self.ack, 1)

    def serve_one(self, size: int) -> None:
        got = 0
        while got < size:
            count = self.sock.recv_into(self.buffer[got:size], size - got)
            if count == 0:
                raise ConnectionError("peer closed")
            got += count
        self.sock.sendall(b"k")

    def close(self) -> None:
        self.sock.close()


class _GrpcUnary:
    def __init__(self, role: str, conn, sizes: list[int]) -> None:
        from concurrent import futures

        import grpc
        options = [("grpc.max_receive_message_length", max(sizes) + MiB),
                   ("grpc.max_send_message_length", max(sizes) + MiB)]
        self.server = None
        if role == "b":
            handler = grpc.method_handlers_generic_handler(
                "bench.Echo", {"Call": grpc.unary_unary_rpc_method_handler(lambda r, c: b"")})
            self.server = grpc.server(futures.ThreadPoolExecutor(4), options=options)
            self.server.add_generic_rpc_handlers((handler,))
            conn.send(self.server.add_insecure_port(f"{_Hosts.b}:0"))
            self.server.start()
        else:
            port = conn.recv()
            self.channel = grpc.insecure_channel(f"{_Hosts.b}:{port}", options=options)
            grpc.channel_ready_future(self.channel).result(timeout=SETUP_TIMEOUT_S)
            self.call = self.channel.unary_unary("/bench.Echo/Call")
            self.metadata = (("splitrun-token", TOKEN),)

    def round_trip(self, payload: bytes) -> None:
        self.call(payload, timeout=PAIR_TIMEOUT_S, metadata=self.metadata)

    def serve_one(self, size: int) -> None:
        pass  # the server's threads answer; nothing to do per call

    def close(self) -> None:
        if self.server is not None:
            self.server.stop(1).wait(5)
        else:
            self.channel.close()


class _GrpcStream(_GrpcUnary):
    """A bare stream-unary call per payload, in 1 MiB requests cut beforehand."""

    def __init__(self, role: str, conn, sizes: list[int]) -> None:
        from concurrent import futures

        import grpc
        options = [("grpc.max_receive_message_length", 16 * MiB),
                   ("grpc.max_send_message_length", 16 * MiB)]
        self.server = None
        if role == "b":
            def drain(requests, context):
                for _ in requests:
                    pass
                return b""
            handler = grpc.method_handlers_generic_handler(
                "bench.Echo", {"Stream": grpc.stream_unary_rpc_method_handler(drain)})
            self.server = grpc.server(futures.ThreadPoolExecutor(4), options=options)
            self.server.add_generic_rpc_handlers((handler,))
            conn.send(self.server.add_insecure_port(f"{_Hosts.b}:0"))
            self.server.start()
        else:
            port = conn.recv()
            self.channel = grpc.insecure_channel(f"{_Hosts.b}:{port}", options=options)
            grpc.channel_ready_future(self.channel).result(timeout=SETUP_TIMEOUT_S)
            self.call = self.channel.stream_unary("/bench.Echo/Stream")
            self.metadata = (("splitrun-token", TOKEN),)
            self.chunks: dict[int, list[bytes]] = {}

    def round_trip(self, payload: bytes) -> None:
        chunks = self.chunks.get(len(payload))
        if chunks is None:
            chunks = self.chunks[len(payload)] = [payload[i:i + MiB]
                                                  for i in range(0, len(payload), MiB)]
        self.call(iter(chunks), timeout=PAIR_TIMEOUT_S, metadata=self.metadata)


class _Gloo:
    def __init__(self, role: str, conn, sizes: list[int]) -> None:
        import torch
        import torch.distributed as dist
        self.workdir = tempfile.mkdtemp(prefix="splitrun-bench-gloo-") if role == "a" else None
        path = os.path.join(self.workdir, "store") if role == "a" else conn.recv()
        if role == "a":
            conn.send(path)
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0 if role == "a" else 1,
                                world_size=2, timeout=datetime.timedelta(seconds=SETUP_TIMEOUT_S))
        self.dist = dist
        self.buffer = torch.empty(max(sizes), dtype=torch.uint8)
        self.ack = torch.zeros(1, dtype=torch.uint8)

    def round_trip(self, payload) -> None:
        self.dist.send(payload, dst=1)
        self.dist.recv(self.ack, src=1)

    def serve_one(self, size: int) -> None:
        self.dist.recv(self.buffer[:size], src=0)
        self.dist.send(self.ack, dst=0)

    def close(self) -> None:
        self.dist.destroy_process_group()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)


class _Splitrun:
    chunk_bytes: int | None = None  # --chunk-bytes, set in the child process
    shm_prefix: str | None = None   # the pair's shared-memory prefix (splitrun_shm)
    over_tcp = False                # splitrun_tcp, splitrun_tcp1
    tcp_stripes: int | None = None  # splitrun_tcp1: 1

    def __init__(self, role: str, conn, sizes: list[int]) -> None:
        import torch

        from splitrun.runtime.transport import ChannelContract
        from splitrun.runtime.transport.grpc import GrpcSettings, GrpcTransport
        from splitrun.runtime.transport.protocol import MessageKey
        from splitrun.splitter.labels import Label
        self.torch, self.MessageKey = torch, MessageKey
        self.me, self.peer = (Label.worker(0), Label.worker(1)) if role == "a" else \
            (Label.worker(1), Label.worker(0))
        if role == "a":
            expected = {"ack": ChannelContract(self.peer, ((torch.uint8, (1,)),))}
        else:
            expected = {f"data{size}": ChannelContract(self.peer, ((torch.uint8, (size,)),))
                        for size in sizes}
        settings = GrpcSettings() if self.chunk_bytes is None else \
            GrpcSettings(chunk_bytes=self.chunk_bytes)
        self.transport = GrpcTransport(self.me, token=TOKEN, incarnation=1, contracts=expected,
                                       settings=settings, host=_Hosts.mine)
        if self.shm_prefix is not None:
            from splitrun.runtime.transport.router import RoutedTransport, TransportChoice
            self.transport = RoutedTransport(self.transport, prefix=self.shm_prefix,
                                             choice=TransportChoice.SHM)
        if self.over_tcp:
            from splitrun.runtime.transport.router import RoutedTransport, TransportChoice
            from splitrun.runtime.transport.tcp import TcpSettings
            self.transport = RoutedTransport(
                self.transport, prefix=None, choice=TransportChoice.TCP,
                tcp_settings=None if self.tcp_stripes is None else
                TcpSettings(stripes=self.tcp_stripes))
        conn.send(self.transport.start())
        self.transport.set_peers({self.peer: conn.recv()})
        self.ack = torch.zeros(1, dtype=torch.uint8)
        self.step = 0

    def round_trip(self, payload) -> None:
        step, self.step = self.step, self.step + 1
        self.transport.send(self.peer, self.MessageKey(1, step, f"data{payload.numel()}"),
                            [payload])
        self.transport.recv(self.peer, self.MessageKey(1, step, "ack"), PAIR_TIMEOUT_S)

    def serve_one(self, size: int) -> None:
        step, self.step = self.step, self.step + 1
        self.transport.recv(self.peer, self.MessageKey(1, step, f"data{size}"), PAIR_TIMEOUT_S)
        self.transport.send(self.peer, self.MessageKey(1, step, "ack"), [self.ack])

    def close(self) -> None:
        self.transport.close()


_SIDES = {"tcp": _Tcp, "grpc_unary": _GrpcUnary, "grpc_stream": _GrpcStream, "gloo": _Gloo,
          "splitrun": _Splitrun, "splitrun_tcp": _Splitrun, "splitrun_tcp1": _Splitrun,
          "splitrun_shm": _Splitrun}


def _payload(kind: str, size: int):
    import torch
    data = torch.randint(0, 256, (size,), dtype=torch.uint8)
    if kind == "tcp":
        return memoryview(data.numpy())
    if kind in ("grpc_unary", "grpc_stream"):
        return data.numpy().tobytes()
    return data


def _side(kind: str, role: str, peer, parent, sizes: list[int], quick: bool,
          chunk_bytes: int | None, shm_prefix: str | None = None,
          place: dict | None = None) -> None:
    """One process of a pair: A times round trips, B answers them. `peer` is a
    pipe to the other side (set-up only), `parent` one to the parent. `place`:
    each role's (namespace, address, device) on two simulated hosts."""
    try:
        if place is not None:
            namespace, _Hosts.mine, device = place[role]
            _Hosts.a, _Hosts.b = place["a"][1], place["b"][1]
            _enter_namespace(namespace)
            os.environ["GLOO_SOCKET_IFNAME"] = device
        import torch
        torch.set_num_threads(1)
        _Splitrun.chunk_bytes = chunk_bytes
        _Splitrun.shm_prefix = shm_prefix
        _Splitrun.over_tcp = kind in ("splitrun_tcp", "splitrun_tcp1")
        _Splitrun.tcp_stripes = 1 if kind == "splitrun_tcp1" else None
        side = _SIDES[kind](role, _Link(peer), sizes)
        _Link(peer).send("ready")  # both sides set up before A starts timing
        _Link(peer).recv()
        results = {}
        profile = None
        if os.environ.get("SPLITRUN_BENCH_PROFILE"):  # --profile DIR
            import cProfile
            profile = cProfile.Profile()
            profile.enable()
        cpu = {}  # per size: this process's CPU seconds (all threads) per round trip
        for size in sizes:
            count = _warmup(size) + _repeats(size, quick)
            if role == "a":
                payload = _payload(kind, size)
                times = []
                for index in range(count):
                    if index == _warmup(size):
                        cpu_started = time.process_time()
                    started = time.perf_counter()
                    side.round_trip(payload)
                    times.append(time.perf_counter() - started)
                results[size] = times[_warmup(size):]
            else:
                for index in range(count):
                    if index == _warmup(size):
                        cpu_started = time.process_time()
                    side.serve_one(size)
            cpu[size] = (time.process_time() - cpu_started) / _repeats(size, quick)
        if profile is not None:
            profile.disable()
            profile.dump_stats(os.path.join(os.environ["SPLITRUN_BENCH_PROFILE"],
                                            f"{kind}-{role}-{os.getpid()}.prof"))
        parent.send(("ok", (results, cpu)))
        # Close only when the parent says so: both sides are done by then.
        if parent.poll(SETUP_TIMEOUT_S):
            parent.recv()
        side.close()
    except BaseException:  # noqa: BLE001 - the parent reports it
        parent.send(("error", traceback.format_exc()))
        raise


class _Link:
    """A pipe end whose every wait is bounded."""

    def __init__(self, conn) -> None:
        self.conn = conn

    def send(self, value) -> None:
        self.conn.send(value)

    def recv(self):
        if not self.conn.poll(SETUP_TIMEOUT_S):
            raise TimeoutError(f"the other side did not answer within {SETUP_TIMEOUT_S} s")
        return self.conn.recv()


def _measure(kind: str, sizes: list[int], quick: bool,
             chunk_bytes: int | None, place: dict | None = None
             ) -> tuple[dict[int, list[float]], dict[int, float], dict[int, float]]:
    """Run one pair of processes; the round-trip times A measured, and each
    side's CPU seconds per round trip, per size."""
    ctx = mp.get_context("spawn")
    shm_prefix = None
    if kind == "splitrun_shm":
        from splitrun.runtime.transport.shm.ring import new_job_prefix
        shm_prefix = new_job_prefix()
    peer_a, peer_b = ctx.Pipe()
    parents, procs = {}, []
    for role, peer in (("a", peer_a), ("b", peer_b)):
        here, there = ctx.Pipe()
        parents[role] = here
        procs.append(ctx.Process(target=_side,
                                 args=(kind, role, peer, there, sizes, quick, chunk_bytes,
                                       shm_prefix, place),
                                 daemon=True))
    for proc in procs:
        proc.start()
    try:
        outcome = {}
        for role, here in parents.items():
            if not here.poll(PAIR_TIMEOUT_S):
                raise TimeoutError(f"{kind}: side {role} did not finish in {PAIR_TIMEOUT_S} s")
            status, value = here.recv()
            if status != "ok":
                raise RuntimeError(f"{kind}: side {role} failed:\n{value}")
            outcome[role] = value
        for here in parents.values():
            here.send("close")
        return outcome["a"][0], outcome["a"][1], outcome["b"][1]
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
        if shm_prefix is not None:
            from splitrun.runtime.transport.shm.ring import remove_job_segments
            remove_job_segments(shm_prefix)


def _summary(times: list[float], size: int) -> dict:
    median = statistics.median(times)
    return {"rtt_us": round(median * 1e6, 1), "gbps": round(size / median / 1e9, 3),
            "min_rtt_us": round(min(times) * 1e6, 1), "repeats": len(times)}


def _rounds(kinds: list[str], sizes: list[int], rounds: int, quick: bool,
            chunk_bytes: int | None, place: dict | None) -> tuple[dict, dict]:
    """Round-trip times per transport and size, and per round the CPU seconds
    per round trip of sender (A) and receiver (B)."""
    raw: dict[str, dict[int, list[float]]] = {kind: {size: [] for size in sizes}
                                               for kind in kinds}
    cpu: dict[str, dict[int, list[tuple[float, float]]]] = {
        kind: {size: [] for size in sizes} for kind in kinds}
    for _ in range(rounds):
        for kind in kinds:
            times, cpu_a, cpu_b = _measure(kind, sizes, quick, chunk_bytes, place)
            for size in sizes:
                raw[kind][size] += times[size]
                cpu[kind][size].append((cpu_a[size], cpu_b[size]))
    return raw, cpu


def _goal(goals: dict, name: str, ratio: float | None, goal: float, at_least: bool) -> None:
    if ratio is not None:
        goals[name] = {"goal": f"{'>=' if at_least else '<='} {goal}", "measured": ratio,
                       "met": ratio >= goal if at_least else ratio <= goal}


def _report(measured: tuple[dict, dict], sizes: list[int]) -> dict:
    """Medians per transport and size, ratios against the baselines, goals."""
    raw, cpu = measured
    table = {kind: {str(size): _summary(times[size], size) for size in sizes}
             for kind, times in raw.items()}
    for kind, per_size in cpu.items():
        for size, pairs in per_size.items():
            row = table[kind][str(size)]
            row["cpu_us_sender"] = round(statistics.median(a for a, _ in pairs) * 1e6, 1)
            row["cpu_us_receiver"] = round(statistics.median(b for _, b in pairs) * 1e6, 1)
    for kind in ("splitrun", "splitrun_tcp", "splitrun_tcp1", "splitrun_shm"):
        for size in map(str, sizes):
            row = table.get(kind, {}).get(size)
            if row is None:
                continue
            for base in ("tcp", "gloo", "grpc_unary", "grpc_stream", "splitrun",
                         "splitrun_tcp1"):
                if base in table and base != kind:
                    row[f"throughput_vs_{base}"] = round(
                        row["gbps"] / table[base][size]["gbps"], 3)
                    row[f"rtt_vs_{base}"] = round(row["rtt_us"] / table[base][size]["rtt_us"], 3)
    goals: dict = {}
    big, small = str(64 * MiB), str(4 * KiB)
    # Between processes that share no memory a job's messages take the tcp
    # data plane (gRPC where a peer has none): the goals are on that path.
    split = table.get("splitrun_tcp", {})
    _goal(goals, "throughput_64MiB_vs_gloo", split.get(big, {}).get("throughput_vs_gloo"),
          GOAL_64MIB_VS_GLOO, True)
    _goal(goals, "throughput_64MiB_vs_tcp", split.get(big, {}).get("throughput_vs_tcp"),
          GOAL_64MIB_VS_TCP, True)
    _goal(goals, "rtt_4KiB_vs_gloo", split.get(small, {}).get("rtt_vs_gloo"),
          GOAL_4KIB_VS_GLOO, False)
    shm = table.get("splitrun_shm", {})
    _goal(goals, "shm_throughput_64MiB_vs_gloo", shm.get(big, {}).get("throughput_vs_gloo"),
          GOAL_SHM_64MIB_VS_GLOO, True)
    _goal(goals, "shm_throughput_64MiB_vs_tcp", shm.get(big, {}).get("throughput_vs_tcp"),
          GOAL_SHM_64MIB_VS_TCP, True)
    _goal(goals, "shm_rtt_4KiB_vs_grpc_unary", shm.get(small, {}).get("rtt_vs_grpc_unary"),
          GOAL_SHM_4KIB_VS_GRPC, False)
    return {"results": table, "goals": goals}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="fewer repetitions and no 256 MiB payload")
    parser.add_argument("--sizes", type=int, nargs="+")
    parser.add_argument("--kinds", nargs="+", choices=KINDS + EXTRA_KINDS, default=KINDS)
    parser.add_argument("--rounds", type=int,
                        help="rounds of all transports (default 3, 1 with --quick)")
    parser.add_argument("--chunk-bytes", type=int, help="splitrun's GrpcSettings.chunk_bytes")
    parser.add_argument("--two-hosts", nargs="*", metavar="RATE", default=None,
                        help="also between two simulated hosts (bench/hosts.py, needs root): "
                             "'unshaped' or a rate in Mbit/s per run, e.g. unshaped 10000")
    parser.add_argument("--profile", metavar="DIR",
                        help="cProfile each side's timed loop into DIR/<kind>-<a|b>-<pid>.prof "
                             "(python -m pstats to read; timings are then slower)")
    parser.add_argument("--no-loopback", action="store_true",
                        help="with --two-hosts: skip the loopback runs")
    args = parser.parse_args()
    sizes = args.sizes or ([s for s in SIZES if s <= 64 * MiB] if args.quick else SIZES)
    rounds = args.rounds or (1 if args.quick else 3)
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
        os.environ["SPLITRUN_BENCH_PROFILE"] = os.path.abspath(args.profile)
    started = time.perf_counter()
    out: dict = {}
    if not args.no_loopback:
        out.update(_report(_rounds(args.kinds, sizes, rounds, args.quick, args.chunk_bytes,
                                   None), sizes))
    if args.two_hosts is not None:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from hosts import two_hosts
        kinds = [kind for kind in args.kinds if kind != "splitrun_shm"]  # not across hosts
        out["two_hosts"] = {}
        for rate in args.two_hosts or ["unshaped"]:
            rate_mbit = None if rate == "unshaped" else float(rate)
            with two_hosts(rate_mbit) as hosts:
                place = {role: (host.namespace, host.address, host.device)
                         for role, host in (("a", hosts.a), ("b", hosts.b))}
                report = _report(_rounds(kinds, sizes, rounds, args.quick, args.chunk_bytes,
                                         place), sizes)
            name = "unshaped" if rate_mbit is None else f"{rate_mbit:g}mbit"
            out["two_hosts"][name] = report
    import grpc
    import torch
    print(json.dumps({
        "benchmark": "transport",
        "round_trip": "payload A->B, then a 1-byte reply B->A; medians",
        "quick": args.quick,
        "rounds": rounds,
        "splitrun_chunk_bytes": args.chunk_bytes or 1 * MiB,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__, "grpcio": grpc.__version__,
                    "torch_threads": 1},
        **out,
        "wall_s": round(time.perf_counter() - started, 1),
    }, indent=2))


if __name__ == "__main__":
    sys.exit(main())
