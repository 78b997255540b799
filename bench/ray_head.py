"""A local Ray cluster for the Ray backend's tests and benchmark: `ray start
--head --block` as a process group of its own, on a loopback address other than
127.0.0.1 (Ray replaces 127.0.0.1 with the machine's outward address; any other
loopback address it keeps), every port chosen free. `close()` ends the group
(SIGTERM, then SIGKILL) and removes the cluster's temporary folder.

    head = RayHead(num_cpus=2, resources={"sr_worker": 2})
    head.wait_up(this_process=True)     # ray.init(address=head.address) here too
    ...  splitrun launch --backend ray --address head.address ... (with RAY_ENV)
    head.close()
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

__all__ = ["RayHead", "RAY_ENV", "NODE_IP"]

NODE_IP = "127.0.0.2"
# Token authentication is for clusters others can reach; this one is on loopback.
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
# `ray start` on a loaded 2-core machine.
START_TIMEOUT_S = 120.0
STOP_GRACE_S = 5.0  # then SIGKILL: every process of the group is this cluster's
_PORT_OPTIONS = ("--node-manager-port", "--object-manager-port", "--dashboard-agent-grpc-port",
                 "--dashboard-agent-listen-port", "--dashboard-port", "--metrics-export-port",
                 "--runtime-env-agent-port", "--ray-client-server-port")


def _free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


class RayHead:
    def __init__(self, num_cpus: int, resources: dict[str, float],
                 env: dict[str, str] | None = None, node_ip: str = NODE_IP) -> None:
        self.temp_dir = tempfile.mkdtemp(prefix="srray-", dir="/tmp")  # short: Ray's sockets
        self.address = f"{node_ip}:{_free_port(node_ip)}"
        argv = [os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--head",
                "--block", "--node-ip-address", node_ip,
                "--port", self.address.rsplit(":", 1)[1], "--num-cpus", str(num_cpus),
                "--resources", json.dumps(resources), "--include-dashboard", "false",
                "--disable-usage-stats", "--temp-dir", self.temp_dir,
                "--object-store-memory", str(100 << 20)]
        for option in _PORT_OPTIONS:
            argv += [option, str(_free_port(node_ip))]
        self.log = open(os.path.join(self.temp_dir, "head.log"), "w")
        environment = dict(os.environ if env is None else env)
        environment.update(RAY_ENV)
        self.process = subprocess.Popen(argv, env=environment, stdin=subprocess.DEVNULL,
                                        stdout=self.log, stderr=subprocess.STDOUT,
                                        start_new_session=True)

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
        for sig in (signal.SIGTERM, signal.SIGKILL):  # the group: gcs, raylet, workers
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.process.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                continue
            if sig == signal.SIGTERM:
                try:  # ray start has exited; what it started may linger
                    os.killpg(self.process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            break
        self.log.close()
        shutil.rmtree(self.temp_dir, ignore_errors=True)
