"""A local Ray cluster for the Ray backend's tests and benchmark: `ray start
--head --block` as a process group of its own, on a loopback address other than
127.0.0.1 (Ray replaces 127.0.0.1 with the machine's outward address; any other
loopback address it keeps), every port chosen free. `close()` ends the group
(SIGTERM, then SIGKILL) and removes the cluster's temporary folder.

    head = RayHead(num_cpus=2, resources={"sr_worker": 2})
    head.wait_up()                      # ray.init(address=head.address) here too
    (or head.wait_started(): up, this process not connected)
    ...  splitrun launch --backend ray --address head.address ... (with RAY_ENV)
    head.close()

Across the two-host harness (bench/hosts.py): a head in host a, a second node
in host b, each offering its own resources, so a job's roles can be placed
apart by resources (servers on a, workers on b):

    with two_hosts(1000) as hosts, ray_on_two_hosts(
            hosts, a_resources={"sr_server": 1}, b_resources={"sr_worker": 2}) as gcs:
        ...  the launcher inside host a: hosts.a.argv([... "--address", gcs, ...])
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

__all__ = ["RayHead", "RayNode", "ray_on_two_hosts", "RAY_ENV", "NODE_IP", "HEAD_PORT"]

NODE_IP = "127.0.0.2"
# Token authentication is for clusters others can reach; this one is on loopback.
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
# `ray start` on a loaded 2-core machine.
START_TIMEOUT_S = 120.0
STOP_GRACE_S = 5.0  # then SIGKILL: every process of the group is this cluster's
# The head's GCS port inside a fresh namespace of the harness (every port is free there).
HEAD_PORT = 6379
_STARTED = re.compile(r"Ray runtime started")
_PORT_OPTIONS = ("--node-manager-port", "--object-manager-port", "--dashboard-agent-grpc-port",
                 "--dashboard-agent-listen-port", "--dashboard-port", "--metrics-export-port",
                 "--runtime-env-agent-port", "--ray-client-server-port")


def _free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


class RayHead:
    def __init__(self, num_cpus: int, resources: dict[str, float],
                 env: dict[str, str] | None = None, node_ip: str = NODE_IP,
                 dashboard: bool = False, auth_token: str | None = None) -> None:
        self.temp_dir = tempfile.mkdtemp(prefix="srray-", dir="/tmp")  # short: Ray's sockets
        self.address = f"{node_ip}:{_free_port(node_ip)}"
        argv = _ray_argv("--head", "--node-ip-address", node_ip,
                         "--port", self.address.rsplit(":", 1)[1], "--num-cpus", str(num_cpus),
                         "--resources", json.dumps(resources), "--temp-dir", self.temp_dir)
        # The dashboard serves `ray job submit`; it needs `pip install 'ray[default]'`.
        self.dashboard_address = None
        if dashboard:
            self.dashboard_address = f"http://{node_ip}:{_free_port(node_ip)}"
            argv += ["--include-dashboard", "true", "--dashboard-host", node_ip,
                     "--dashboard-port", self.dashboard_address.rsplit(":", 1)[1]]
        else:
            argv += ["--include-dashboard", "false"]
        for option in _PORT_OPTIONS:
            if not (dashboard and option == "--dashboard-port"):
                argv += [option, str(_free_port(node_ip))]
        self.log = open(os.path.join(self.temp_dir, "head.log"), "w")
        environment = dict(os.environ if env is None else env)
        environment.update(RAY_ENV)
        if auth_token is not None:  # a cluster that refuses clients without this token
            environment.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": auth_token})
        try:
            self.process = subprocess.Popen(argv, env=environment, stdin=subprocess.DEVNULL,
                                            stdout=self.log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        except OSError:  # no `ray` beside this interpreter
            self.log.close()
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            raise

    def wait_started(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Return once `ray start` says the head runs (without connecting this
        process); raise if it exits first or does not within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            with open(self.log.name, errors="replace") as log:
                output = log.read()
            if _STARTED.search(output):
                return
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray start not up (exit {self.process.poll()}):\n{output}")
            time.sleep(0.2)  # polling a head that is starting, with a deadline

    def wait_up(self) -> None:
        """Connect this process to the cluster once it is up (bounded); the
        caller may then use Ray's API (`ray.shutdown()` happens in close())."""
        import ray

        os.environ.update(RAY_ENV)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                with open(self.log.name) as log:
                    raise RuntimeError(f"ray start exited with {self.process.returncode}:\n"
                                       f"{log.read()}")
            try:
                ray.init(address=self.address, logging_level="WARNING", log_to_driver=False)
                return
            except ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)  # polling a cluster that is starting, with a deadline

    def close(self) -> None:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        _end_group(self.process)
        self.log.close()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _ray_argv(*options: str) -> list[str]:
    return [os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--block",
            "--disable-usage-stats", "--object-store-memory", str(100 << 20), *options]


class RayNode:
    """`ray start --block` inside one host of the two-host harness, its output
    in a log file of its own temporary folder. The harness kills it (by its
    process group) when its `two_hosts` block ends; `close()` then removes the
    folder."""

    def __init__(self, host, *options: str, env: dict[str, str] | None = None) -> None:
        self.host = host
        self.temp_dir = tempfile.mkdtemp(prefix="srray-", dir="/tmp")  # short: Ray's sockets
        self.log = open(os.path.join(self.temp_dir, "node.log"), "w")
        environment = dict(os.environ if env is None else env)
        environment.update(RAY_ENV)
        try:
            self.process = host.popen(
                _ray_argv("--node-ip-address", host.address, "--temp-dir", self.temp_dir,
                          *options),
                env=environment, stdout=self.log, stderr=subprocess.STDOUT)
        except OSError:
            self.close()
            raise

    def output(self) -> str:
        with open(self.log.name, errors="replace") as log:
            return log.read()

    def wait_up(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Return once `ray start` says the node runs; raise if it exits first
        or does not within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while not _STARTED.search(self.output()):
            if self.process.poll() is not None:
                raise RuntimeError(f"ray start in {self.host.namespace} exited with "
                                   f"{self.process.returncode}:\n{self.output()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"ray start in {self.host.namespace} not up within "
                                   f"{timeout_s:g} s:\n{self.output()}")
            time.sleep(0.2)  # polling a node that is starting, with a deadline

    def close(self) -> None:
        self.log.close()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@contextlib.contextmanager
def ray_on_two_hosts(hosts, *, a_resources: dict[str, float], b_resources: dict[str, float],
                     a_cpus: int = 1, b_cpus: int = 2,
                     env: dict[str, str] | None = None) -> Iterator[str]:
    """A Ray head in `hosts.a` and a second node in `hosts.b` (bench/hosts.py),
    each with its CPUs and custom resources; yields the GCS address (on a)
    once both are up. Use inside the `two_hosts` block: the nodes' processes
    end with it, their folders when this block ends."""
    gcs = f"{hosts.a.address}:{HEAD_PORT}"
    nodes: list[RayNode] = []
    try:
        nodes.append(RayNode(hosts.a, "--head", "--port", str(HEAD_PORT),
                             "--include-dashboard", "false", "--num-cpus", str(a_cpus),
                             "--resources", json.dumps(a_resources), env=env))
        nodes[0].wait_up()
        nodes.append(RayNode(hosts.b, "--address", gcs, "--num-cpus", str(b_cpus),
                             "--resources", json.dumps(b_resources), env=env))
        nodes[1].wait_up()
        yield gcs
    finally:
        for node in reversed(nodes):
            _end_group(node.process)  # Ray's processes may still write in its folder
            node.close()


def _end_group(process: subprocess.Popen) -> None:
    """End `ray start` and what it started (its process group: gcs, raylet,
    workers): SIGTERM, then SIGKILL after the grace period or once it exited."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        process.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    try:  # what it started may linger after it exited
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    process.wait(timeout=STOP_GRACE_S)
