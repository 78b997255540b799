"""Throughput and round trip of the shared-memory ring (runtime/transport/shm/ring.py)
between two processes, against a raw TCP socket pair on loopback measured in
the same run.

One round trip: the payload from process A to process B (B copies it into a
reused buffer), then a one-byte ack back. The median round trip gives the
latency and size / latency the throughput.

- ``tcp``: ``sendall`` / ``recv_into`` a reused buffer over 127.0.0.1 (TCP_NODELAY),
  a one-byte ack;
- ``shm_ring``: ``RingWriter.send`` of the payload's bytes (one copy in),
  ``recv_header`` + ``recv_payload_into`` a reused buffer (one copy out), the ack
  through a second ring the other way.

The kinds take turns in rounds, each round with a fresh pair of processes, so
a machine that slows down mid-run does not bias one against the other.

    python bench/shm_ring.py [--rounds N] [--sizes 4096 1048576 67108864]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import sys
import time

KiB, MiB = 1 << 10, 1 << 20
SIZES = [4 * KiB, MiB, 64 * MiB]
KINDS = ["tcp", "shm_ring"]
# Bounds one pair of processes (start-up plus all sizes).
PAIR_TIMEOUT_S = 300.0
# Bounds the start-up handshake between the two processes of a pair.
SETUP_TIMEOUT_S = 60.0
RING_BYTES = 64 * MiB


def _repeats(size: int) -> int:
    return 200 if size <= 64 * KiB else 40 if size <= MiB else 8


def _warmup(size: int) -> int:
    return 20 if size <= MiB else 2


class _Tcp:
    def __init__(self, role: str, conn, sizes: list[int]) -> None:
        if role == "a":
            server = socket.create_server(("127.0.0.1", 0))
            conn.send(server.getsockname()[1])
            server.settimeout(SETUP_TIMEOUT_S)
            self.sock, _ = server.accept()
            server.close()
        else:
            port = conn.recv()
            self.sock = socket.create_connection(("127.0.0.1", port), timeout=SETUP_TIMEOUT_S)
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


class _ShmRing:
    def __init__(self, role: str, conn, sizes: list[int]) -> None:
        from splitrun.runtime.transport.shm.ring import (
            RingReader,
            RingSettings,
            RingWriter,
            new_job_prefix,
        )
        if role == "a":
            self.prefix = new_job_prefix()
            conn.send(self.prefix)
        else:
            self.prefix = conn.recv()
        me, peer = ("a", "b") if role == "a" else ("b", "a")
        self.writer = RingWriter(self.prefix, f"{me}-{peer}", owner=me, peer=peer,
                                 settings=RingSettings(capacity_bytes=RING_BYTES
                                                       if role == "a" else 64 * KiB))
        self.reader = RingReader.attach(self.prefix, f"{peer}-{me}", owner=me, peer=peer,
                                        timeout_s=SETUP_TIMEOUT_S)
        self.writer.wait_attached(SETUP_TIMEOUT_S)
        self.buffer = memoryview(bytearray(max(sizes)))
        self.ack = memoryview(bytearray(1))

    def round_trip(self, payload: memoryview) -> None:
        self.writer.send(b"", [payload], PAIR_TIMEOUT_S)
        self.reader.recv_header(PAIR_TIMEOUT_S)
        self.reader.recv_payload_into(self.ack, PAIR_TIMEOUT_S)

    def serve_one(self, size: int) -> None:
        _, nbytes = self.reader.recv_header(PAIR_TIMEOUT_S)
        self.reader.recv_payload_into(self.buffer[:nbytes], PAIR_TIMEOUT_S)
        self.writer.send(b"", [self.ack], PAIR_TIMEOUT_S)

    def close(self) -> None:
        self.writer.close()
        self.reader.close()


_KINDS = {"tcp": _Tcp, "shm_ring": _ShmRing}


def _side(role: str, kind: str, sizes: list[int], conn) -> None:
    try:
        end = _KINDS[kind](role, conn, sizes)
        results = {}
        for size in sizes:
            count = _warmup(size) + _repeats(size)
            if role == "a":
                payload = memoryview(os.urandom(size))
                times = []
                for index in range(count):
                    started = time.perf_counter()
                    end.round_trip(payload)
                    if index >= _warmup(size):
                        times.append(time.perf_counter() - started)
                results[size] = times
            else:
                for _ in range(count):
                    end.serve_one(size)
        end.close()
        conn.send(("ok", results))
    except BaseException as exc:  # report to the parent, which raises
        conn.send(("error", f"{kind} side {role}: {exc!r}"))


def _pair(kind: str, sizes: list[int]) -> dict[int, list[float]]:
    ctx = mp.get_context("spawn")
    a_conn, a_child = ctx.Pipe()
    b_conn, b_child = ctx.Pipe()
    a = ctx.Process(target=_side, args=("a", kind, sizes, a_child))
    b = ctx.Process(target=_side, args=("b", kind, sizes, b_child))
    a.start()
    b.start()
    try:
        # Relay side a's set-up message (a port, a job prefix) to side b.
        if not a_conn.poll(SETUP_TIMEOUT_S):
            raise RuntimeError(f"{kind}: side a did not start")
        b_conn.send(a_conn.recv())
        outcome = {}
        for name, conn in (("a", a_conn), ("b", b_conn)):
            if not conn.poll(PAIR_TIMEOUT_S):
                raise RuntimeError(f"{kind}: side {name} did not finish in {PAIR_TIMEOUT_S} s")
            status, value = conn.recv()
            if status != "ok":
                raise RuntimeError(value)
            outcome[name] = value
        return outcome["a"]
    finally:
        for process in (a, b):
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join(timeout=10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sizes", type=int, nargs="+", default=SIZES)
    args = parser.parse_args()
    times: dict[str, dict[int, list[float]]] = {kind: {s: [] for s in args.sizes}
                                               for kind in KINDS}
    for _ in range(args.rounds):
        for kind in KINDS:
            for size, values in _pair(kind, args.sizes).items():
                times[kind][size].extend(values)
    table = {}
    for kind in KINDS:
        table[kind] = {}
        for size in args.sizes:
            median = statistics.median(times[kind][size])
            table[kind][str(size)] = {"median_round_trip_us": round(median * 1e6, 1),
                                      "throughput_gbytes_s": round(size / median / 1e9, 3),
                                      "samples": len(times[kind][size])}
    ratios = {}
    for size in args.sizes:
        tcp = statistics.median(times["tcp"][size])
        ring = statistics.median(times["shm_ring"][size])
        ratios[str(size)] = {"shm_ring_throughput_vs_tcp": round(tcp / ring, 2)}
    print(json.dumps({"bench": "shm_ring", "host": platform.node(), "cpus": os.cpu_count(),
                      "python": sys.version.split()[0], "rounds": args.rounds,
                      "ring_bytes": RING_BYTES, "results": table, "ratios": ratios},
                     indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
