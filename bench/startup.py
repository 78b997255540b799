"""Start-up and end-to-end time of the main job (examples/ps_train.py, 2 workers
+ 1 server): `splitrun launch` (local backend, its processes forked from a
template that imported torch once) against the same with `--start-method exec`
(``local_exec``: every process a fresh interpreter, as before the template),
the same forked from a standing template that many launches share
(``local_standing``: launcher/standing_template.py, started once beforehand),
`splitrun launch --backend ray` on a one-node Ray cluster and, with --two-hosts RATE_MBIT, on a
Ray cluster across the two-host harness (bench/hosts.py, needs root: the head
and the server in host a, a second node and both workers in host b, placed by
custom resources; the launcher runs in a, as on the head node). Each cluster
is started once beforehand (as a cluster users submit to already runs; its
start is reported apart).

Per run, seconds from starting the launcher to:
- ``ready_s``: worker 0 logs its plan (every process joined, the plan agreed:
  the next thing is the first step);
- ``end_to_end_s``: the launcher exited;
- ``cpu_s``: CPU seconds (user and system) of the launcher and the processes
  it reaped (a local job's: the template, the job's processes), which load
  from other programs on a shared machine changes far less than the seconds
  above (a Ray job's actors are the raylet's, not counted; a standing
  template's processes are its children: its CPU during the run is counted);
and, for Ray, as the launcher reports them (from its own start, after its
imports): ``placed_s``, connected to Ray and the placement group placed;
``actors_s``, every actor started (its script running).
The backends take turns, so a machine that slows down mid-run biases none.
Medians over the runs; each other row over the local backend's and minus it.

    python bench/startup.py [--runs 3] [--epochs 1]
                            [--backends local,local_exec,local_standing,ray]
                            [--two-hosts 1000]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from ray_head import RAY_ENV, RayHead, ray_on_two_hosts

REPO = pathlib.Path(__file__).resolve().parents[1]
JOB_TIMEOUT_S = 600.0
_READY = re.compile(r"^\[worker 0\] .*\bplan [0-9a-f]+:")
_ACTORS = re.compile(r"every actor started ([0-9.]+) s after start")
_SERVED = re.compile(r"standing template \(pid \d+\) imported .*; the processes are forked")
_PLACED = re.compile(r"\(placement group \S+, ([0-9.]+) s after start\)")
BACKENDS = ("local", "local_exec", "local_standing", "ray", "ray_two_hosts")
# The backends --backends may name (the two-host one comes with --two-hosts).
CHOSEN = BACKENDS[:4]
# Across the two hosts: the server on a (sr_server), the workers on b (sr_worker).
_TWO_HOST_RESOURCES = {"a_resources": {"sr_server": 1}, "b_resources": {"sr_worker": 2}}


def _one_run(backend: str, address: str | None, epochs: int, host=None) -> dict:
    """One run of the job; `host`: run the launcher inside that host of the
    harness (bench/hosts.py)."""
    # -v: the plan and the Ray timings are lifecycle lines.
    argv = [sys.executable, "-m", "splitrun.launcher", "-v", "launch", "--workers", "2",
            "--servers", "1"]
    if backend == "local_exec":
        argv += ["--start-method", "exec"]
    elif backend == "local_standing":
        argv += ["--template", address.socket]
    elif backend == "ray":
        argv += ["--backend", "ray", "--address", address,
                 "--worker-resources", '{"CPU": 0.5}', "--server-resources", '{"CPU": 0.5}']
    elif backend == "ray_two_hosts":
        argv += ["--backend", "ray", "--address", address, "--host", "0.0.0.0", "--insecure",
                 "--worker-resources", '{"CPU": 0.5, "sr_worker": 1}',
                 "--server-resources", '{"CPU": 0.5, "sr_server": 1}']
    argv += [str(REPO / "examples" / "ps_train.py"), "--epochs", str(epochs)]
    if host is not None:
        argv = host.argv(argv)
    env = dict(os.environ)
    env.update(RAY_ENV)
    standing = address if backend == "local_standing" else None
    started = time.monotonic()
    cpu_before = _children_cpu_s() + (standing.cpu_s() if standing else 0.0)
    process = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, start_new_session=True, text=True)
    result: dict = {"backend": backend}
    lines = []
    try:
        for line in process.stdout:  # ends when the launcher exits (bounded by wait below)
            lines.append(line)
            if "ready_s" not in result and _READY.search(line):
                result["ready_s"] = time.monotonic() - started
            actors = _ACTORS.search(line)
            if actors:
                result["actors_s"] = float(actors.group(1))
            placed = _PLACED.search(line)
            if placed:
                result["placed_s"] = float(placed.group(1))
        code = process.wait(timeout=JOB_TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
    result["end_to_end_s"] = time.monotonic() - started
    result["cpu_s"] = _children_cpu_s() + (standing.cpu_s() if standing else 0.0) - cpu_before
    if code != 0:
        raise RuntimeError(f"{backend} run exited with {code}:\n{''.join(lines[-40:])}")
    if standing and not any(_SERVED.search(line) for line in lines):
        raise RuntimeError(f"the standing template did not serve the run:\n{''.join(lines)}")
    return result


def _children_cpu_s() -> float:
    """CPU seconds of this process's reaped children and theirs."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class _StandingTemplate:
    """A standing template for the ``local_standing`` runs, ended with the benchmark."""

    def __init__(self, folder: str) -> None:
        self.socket = os.path.join(folder, "template.sock")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "splitrun.launcher.standing_template", "--serve",
             self.socket, "--parent-pid", str(os.getpid())],
            env={**os.environ, **RAY_ENV},  # the launches' (`_one_run`)
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True)
        for line in self.process.stdout:  # ends if it exits (then it said why)
            if line.startswith(("imported", "unusable")):
                break
        if not line.startswith("imported"):
            self.close()
            raise RuntimeError(f"the standing template is not usable: {line}")

    def cpu_s(self) -> float:
        """Its CPU seconds and those of the processes it reaped (the jobs')."""
        with open(f"/proc/{self.process.pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return sum(int(fields[k]) for k in (11, 12, 13, 14)) / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        self.process.kill()
        self.process.wait(timeout=30)


def _median(runs: list[dict], key: str) -> float | None:
    values = [run[key] for run in runs if key in run]
    return round(statistics.median(values), 2) if values else None


def _cluster(stack: contextlib.ExitStack, backend: str, rate_mbit: float | None):
    """Start the cluster `backend` runs on (None for the local backend):
    (address, host to run the launcher in, seconds it took to start)."""
    started = time.monotonic()
    if backend in ("local", "local_exec"):
        return None, None, None
    if backend == "local_standing":
        folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="splitrun-bench-"))
        template = _StandingTemplate(folder)
        stack.callback(template.close)
        return template, None, time.monotonic() - started
    if backend == "ray":
        head = RayHead(num_cpus=2, resources={})
        stack.callback(head.close)
        head.wait_up()
        return head.address, None, time.monotonic() - started
    from hosts import two_hosts

    hosts = stack.enter_context(two_hosts(rate_mbit))
    gcs = stack.enter_context(ray_on_two_hosts(hosts, **_TWO_HOST_RESOURCES))
    return gcs, hosts.a, time.monotonic() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=1, help="of ps_train.py (22 steps each)")
    parser.add_argument("--backends", default="local,local_exec,ray",
                        help="comma-separated, of " + ", ".join(CHOSEN) +
                             " (default %(default)s); local always runs")
    parser.add_argument("--two-hosts", type=float, default=None, metavar="RATE_MBIT",
                        help="also Ray across the two-host harness with a link of this rate "
                             "(needs root)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    chosen = {"local", *args.backends.split(",")}
    unknown = chosen - set(CHOSEN)
    if unknown:
        parser.error(f"--backends: unknown {sorted(unknown)}; choose from {CHOSEN}")
    backends = [b for b in CHOSEN if b in chosen]
    if args.two_hosts:
        backends.append("ray_two_hosts")
    runs: dict[str, list[dict]] = {backend: [] for backend in backends}
    cluster_start_s = {}
    standing_start_cpu_s = None
    with contextlib.ExitStack() as stack:
        clusters = {}
        for backend in backends:
            address, host, took = _cluster(stack, backend, args.two_hosts)
            clusters[backend] = (address, host)
            if took is not None:
                cluster_start_s[backend] = round(took, 2)
            if backend == "local_standing":
                standing_start_cpu_s = round(address.cpu_s(), 2)
        for _ in range(args.runs):
            for backend in backends:
                address, host = clusters[backend]
                runs[backend].append(_one_run(backend, address, args.epochs, host))
    keys = ("ready_s", "placed_s", "actors_s", "end_to_end_s", "cpu_s")
    summary = {backend: {key: _median(results, key) for key in keys}
               for backend, results in runs.items()}
    local = summary["local"]
    compared = ("ready_s", "end_to_end_s", "cpu_s")
    print(json.dumps({
        "benchmark": "startup", "job": "examples/ps_train.py, 2 workers + 1 server",
        "epochs": args.epochs, "runs": args.runs, "two_hosts_rate_mbit": args.two_hosts,
        "machine": platform.machine(), "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "ray_cluster_start_s": {b: t for b, t in cluster_start_s.items() if b.startswith("ray")},
        # Once, before its runs: its wall seconds to be ready, and its CPU seconds then.
        "standing_template_start": {"s": cluster_start_s.get("local_standing"),
                                    "cpu_s": standing_start_cpu_s},
        "median": summary,
        "over_local": {backend: {key: round(summary[backend][key] / local[key], 2)
                                 for key in compared if summary[backend][key] and local[key]}
                       for backend in backends[1:]},
        "adds_to_local_s": {backend: {key: round(summary[backend][key] - local[key], 2)
                                      for key in compared
                                      if summary[backend][key] and local[key]}
                            for backend in backends[1:]},
        "runs_detail": runs,
    }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
