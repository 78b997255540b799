"""A splitrun job across the two simulated hosts of `hosts.py`, started as on two
machines: `splitrun scheduler` and the servers on host a, the workers on host b,
each process through `splitrun join`. Used by the PS and embedding-cache benches.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import time
from collections.abc import Sequence

# Bounds the standalone scheduler's start on a simulated host.
SCHEDULER_START_S = 120

_LAUNCHER = [sys.executable, "-m", "splitrun.launcher", "--log-level", "WARNING"]


def wait_all(processes: Sequence[subprocess.Popen], logs: Sequence[pathlib.Path],
             what: str, timeout_s: float) -> None:
    """Wait for every process to exit 0 within `timeout_s` in all; otherwise
    raise naming the process's log (and its tail)."""
    deadline = time.monotonic() + timeout_s
    for process, log in zip(processes, logs):
        try:
            code = process.wait(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{what}: {log.name} did not finish in {timeout_s} s") from None
        if code != 0:
            raise RuntimeError(f"{what}: {log.name} exited {code}:\n"
                               f"{log.read_text(errors='replace')[-4000:]}")


def _start_scheduler(host, run_dir: pathlib.Path, workers: int, servers: int,
                     token: pathlib.Path) -> tuple[subprocess.Popen, str]:
    scheduler_log = run_dir / "scheduler.log"
    with open(scheduler_log, "w") as out:
        # The bench's own namespaces: --insecure; the token goes through a 0600 file.
        scheduler = host.popen([*_LAUNCHER, "scheduler", "--workers", str(workers),
                                "--servers", str(servers), "--host", host.address,
                                "--insecure", "--token-file", str(token)],
                               stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + SCHEDULER_START_S
    while True:
        match = re.search(r"scheduler at (\S+);", scheduler_log.read_text())
        if match is not None:
            return scheduler, match.group(1)
        if scheduler.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the scheduler did not start:\n{scheduler_log.read_text()}")
        time.sleep(0.1)  # polls a log file: there is no event to wait on


def run_joined_job(hosts, run_dir: pathlib.Path, *, workers: int, servers: int,
                   job_command: Sequence[str], what: str, timeout_s: float,
                   server_hosts: Sequence | None = None) -> list[pathlib.Path]:
    """Run `job_command` (script and its arguments) as `servers` servers on host a
    (or server r on `server_hosts[r]`) and `workers` workers on host b; the
    logs, servers first (so worker 0's is `logs[servers]`)."""
    a, b = hosts.a, hosts.b
    token = run_dir / "job.token"
    scheduler, address = _start_scheduler(a, run_dir, workers, servers, token)
    members = [(a if server_hosts is None else server_hosts[rank], "server", rank)
               for rank in range(servers)]
    members += [(b, "worker", rank) for rank in range(workers)]
    processes, logs = [], []
    for host, role, rank in members:
        log = run_dir / f"{role}{rank}.log"
        with open(log, "w") as out:
            processes.append(host.popen(
                [*_LAUNCHER, "join", "--scheduler", address, "--token-file", str(token),
                 "--role", role, "--rank", str(rank), "--host", host.address, "--insecure",
                 "--device", "cpu", *job_command],
                stdout=out, stderr=subprocess.STDOUT))
        logs.append(log)
    wait_all(processes, logs, what, timeout_s)
    scheduler.wait(timeout=60)
    return logs
