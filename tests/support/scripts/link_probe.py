"""A TCP probe for the two-host harness tests: `serve HOST` binds port 0 on
HOST, prints "port N", reads one connection to its end and prints
"received BYTES in SECONDS"; `send HOST PORT NBYTES` sends NBYTES to it."""

import socket
import sys
import time

# Bounds accept() and each read: the sender starts right after "port N".
TIMEOUT_S = 60.0


def serve(host: str) -> None:
    with socket.create_server((host, 0)) as server:
        server.settimeout(TIMEOUT_S)
        print(f"port {server.getsockname()[1]}", flush=True)
        conn, _ = server.accept()
        with conn:
            conn.settimeout(TIMEOUT_S)
            buffer = bytearray(1 << 20)
            total, started = 0, None
            while True:
                n = conn.recv_into(buffer)
                if not n:
                    break
                if started is None:
                    started = time.perf_counter()
                total += n
            elapsed = time.perf_counter() - (started or time.perf_counter())
    print(f"received {total} in {elapsed:.6f}", flush=True)


def send(host: str, port: int, nbytes: int) -> None:
    payload = bytes(1 << 20)
    with socket.create_connection((host, port), timeout=TIMEOUT_S) as conn:
        left = nbytes
        while left:
            n = min(left, len(payload))
            conn.sendall(memoryview(payload)[:n])
            left -= n
    print(f"sent {nbytes}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
