"""`splitrun launch --backend ray` on a real local Ray cluster: one `ray start
--head` per module (2 CPUs, custom resources for workers and servers), on
127.0.0.2 with free ports, ended by its process group when the module's tests
are done. The jobs run through the real launcher, as users run them."""

import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest
from cluster import REPO, child_env, pid_alive

from splitrun.launcher.cli import main

ray = pytest.importorskip("ray")

EXAMPLES = REPO / "examples"
# Ray resolves 127.0.0.1 to the machine's outward address; any other loopback
# address it keeps, so the cluster's traffic stays on loopback.
NODE_IP = "127.0.0.2"
# Token authentication is for clusters other people can reach; this one is on
# loopback and the test's own.
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
WORKER = '{"CPU": 0.5, "sr_worker": 1}'
SERVER = '{"CPU": 0.5, "sr_server": 1}'
# Bounds on a loaded 2-core machine: the cluster's start, a small job.
RAY_START_TIMEOUT_S = 120.0
JOB_TIMEOUT_S = 240.0
GONE_TIMEOUT_S = 30.0
STARTED = re.compile(r"started (worker|server) (\d+) \(pid (\d+), actor pid (\d+)\) on host "
                     r"(\S+) node (\S+)")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind((NODE_IP, 0))
        return probe.getsockname()[1]


class RayHead:
    """`ray start --head --block` as a process group of its own; `close()`
    ends the group (SIGTERM, then SIGKILL) and removes its temporary folder."""

    def __init__(self) -> None:
        self.temp_dir = tempfile.mkdtemp(prefix="srray-", dir="/tmp")  # short: Ray's sockets
        self.address = f"{NODE_IP}:{_free_port()}"
        ports = {option: _free_port() for option in (
            "--node-manager-port", "--object-manager-port", "--dashboard-agent-grpc-port",
            "--dashboard-agent-listen-port", "--dashboard-port", "--metrics-export-port",
            "--runtime-env-agent-port", "--ray-client-server-port")}
        argv = [os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--head",
                "--block", "--node-ip-address", NODE_IP,
                "--port", self.address.rsplit(":", 1)[1], "--num-cpus", "2",
                "--resources", json.dumps({"sr_worker": 2, "sr_server": 1}),
                "--include-dashboard", "false", "--disable-usage-stats",
                "--temp-dir", self.temp_dir, "--object-store-memory", str(100 << 20)]
        for option, port in ports.items():
            argv += [option, str(port)]
        self.log = open(os.path.join(self.temp_dir, "head.log"), "w")
        self.process = subprocess.Popen(argv, env=child_env(RAY_ENV), stdin=subprocess.DEVNULL,
                                        stdout=self.log, stderr=subprocess.STDOUT,
                                        start_new_session=True)

    def connect(self) -> None:
        """Connect this process to the cluster once it is up (bounded)."""
        os.environ.update(RAY_ENV)
        deadline = time.monotonic() + RAY_START_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                raise AssertionError(f"ray start exited with {self.process.returncode}:\n"
                                     f"{open(self.log.name).read()}")
            try:
                ray.init(address=self.address, logging_level="WARNING", log_to_driver=False)
                return
            except ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)  # polling a cluster that is starting, with a deadline

    def close(self) -> None:
        if ray.is_initialized():
            ray.shutdown()
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass
        except ProcessLookupError:
            pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # what did not stop on SIGTERM
        except ProcessLookupError:
            pass
        if self.process.poll() is None:
            self.process.wait(timeout=15)
        self.log.close()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_head():
    head = RayHead()
    try:
        head.connect()
        yield head
    finally:
        head.close()


def _launch_ray(local_cluster, head: RayHead, script, *args, workers: int, servers: int):
    return local_cluster.start(
        "launch", "--backend", "ray", "--address", head.address, "--workers", workers,
        "--servers", servers, "--worker-resources", WORKER, "--server-resources", SERVER,
        script, *args, env_extra=RAY_ENV)


def _placements(output: str) -> dict[str, tuple[int, int]]:
    """`worker 1` -> (script pid, actor pid), from the launcher's log."""
    return {f"{m[1]} {m[2]}": (int(m[3]), int(m[4])) for m in STARTED.finditer(output)}


def _assert_nothing_left(placements: dict[str, tuple[int, int]]) -> None:
    """No splitrun actor or placement group in the cluster, no script or actor
    process on this machine (ray.kill ends an actor asynchronously: bounded wait)."""
    from ray.util.placement_group import placement_group_table

    deadline = time.monotonic() + GONE_TIMEOUT_S
    while True:
        actors = [a for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith("splitrun-")]
        groups = {k: v["name"] for k, v in placement_group_table().items()
                  if v["state"] != "REMOVED"}
        pids = [pid for pair in placements.values() for pid in pair if pid_alive(pid)]
        if not actors and not groups and not pids:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"left behind after {GONE_TIMEOUT_S} s: actors {actors}, "
                                 f"placement groups {groups}, processes {pids}")
        time.sleep(0.2)  # polling Ray's tables and /proc, with a deadline


def _result(output: str) -> tuple[str, str, str]:
    """What the job computed: its plan, final loss and held-out accuracy."""
    plan = re.search(r"\[worker 0\] plan (\w+):", output).group(1)
    loss = re.findall(r"\[worker 0\] .*step (\d+/\d+ loss [0-9.]+)", output)[-1]  # the last
    accuracy = re.search(r"held-out accuracy: ([0-9.]+)", output).group(1)
    return plan, loss, accuracy


def test_bad_resources_are_refused_before_ray_starts(capsys):
    code = main(["launch", "--backend", "ray", "--worker-resources", '{"GPU": -1}',
                 str(EXAMPLES / "ps_train.py")])
    assert code == 2
    assert '--worker-resources: every amount must be a number > 0; got {"GPU": -1}' in \
        capsys.readouterr().err


@pytest.mark.slow
def test_ps_train_on_ray_matches_the_local_backend(ray_head, local_cluster):
    args = (EXAMPLES / "ps_train.py", "--epochs", 3)
    local = local_cluster.run(*args, workers=2, servers=1)
    proc = _launch_ray(local_cluster, ray_head, *args, workers=2, servers=1)
    code = proc.wait(JOB_TIMEOUT_S)
    output = proc.output()
    assert code == 0, output
    assert _result(output) == _result(local.output())
    placements = _placements(output)
    assert set(placements) == {"worker 0", "worker 1", "server 0"}
    assert "all 3 processes finished" in output
    _assert_nothing_left(placements)


@pytest.mark.slow
def test_a_killed_actor_stops_the_job_naming_it(ray_head, local_cluster):
    proc = _launch_ray(local_cluster, ray_head, EXAMPLES / "ps_train.py", "--epochs", 500,
                       workers=2, servers=1)
    proc.wait_for(r"\[worker 0\] .*step \d+/\d+", JOB_TIMEOUT_S)  # training
    placements = _placements(proc.output())
    script_pid, actor_pid = placements["worker 1"]
    os.kill(actor_pid, signal.SIGKILL)  # the Ray worker process holding worker 1's actor
    code = proc.wait(JOB_TIMEOUT_S)
    output = proc.output()
    assert code != 0, output
    summary = next(line for line in proc.lines if line.startswith("[splitrun] the Ray actor"))
    assert f"the Ray actor of worker 1 (pid {script_pid} on" in summary, output
    assert "died" in summary and "stopped the other 2 processes" in summary, output
    _assert_nothing_left(placements)
