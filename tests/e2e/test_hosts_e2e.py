"""The main job run across the two-host harness (bench/hosts.py: two network
namespaces joined by a shaped veth pair) with `splitrun scheduler` and
`splitrun join`, as on two machines (the harness itself:
tests/bench/test_hosts.py).

Needs root: without it every test here fails with the harness's message
(they are not skipped: CI runs as root, and a silent skip would hide that the
multi-machine path went untested)."""

import os
import re
import sys

import pytest
from cluster import JOB_TIMEOUT_S, REPO, Proc
from hosts import require_root, two_hosts

EXAMPLES = REPO / "examples"
# Bounds the scheduler's start (a Python interpreter inside the namespace).
PROBE_START_S = 60.0


# Epochs and the held-out accuracy each variant must reach. `address` trains the
# main job to its 0.95 across the hosts (8 epochs, 176 steps: 0.9611 in one
# process). `wildcard` differs only in what each process binds and advertises:
# 3 epochs reach 0.9389 (tests/e2e/test_examples.py's run, checked at 0.9 there
# too), while 1 epoch reaches 0.875, so the job must still train every step.
TRAINING = {"address": (8, 0.95), "wildcard": (3, 0.9)}


@pytest.mark.parametrize("bind", ["address", "wildcard"])
def test_main_job_across_two_hosts_reaches_its_accuracy(bind, tmp_path):
    """The scheduler and the server on host a, both workers on host b, over a
    1 Gbit/s link. `address`: every process binds (and so advertises) its
    host's address. `wildcard`: every process binds 0.0.0.0, as in `splitrun
    join --help`, and advertises its address on the route to the scheduler."""
    require_root()
    env = dict(os.environ)
    env.pop("SPLITRUN_LAUNCHER_PID", None)
    launcher = [sys.executable, "-m", "splitrun.launcher", "-v"]  # -v: the lines checked below
    epochs, min_accuracy = TRAINING[bind]
    job = [EXAMPLES / "ps_train.py", "--epochs", epochs, "--min-accuracy", min_accuracy]
    with two_hosts(rate_mbit=1000) as hosts:
        a, b = hosts.a, hosts.b
        bind_host = {a: a.address, b: b.address} if bind == "address" else \
            {a: "0.0.0.0", b: "0.0.0.0"}
        # Off loopback without TLS: --insecure (the test's own namespaces); the
        # token goes through a 0600 file, never a command line.
        token = tmp_path / "job.token"
        scheduler = Proc(a.argv([*launcher, "scheduler", "--workers", 2, "--servers", 1,
                                 "--host", bind_host[a], "--port", 0, "--insecure",
                                 "--token-file", token]), env=env)
        a.adopt(scheduler.process)
        match = scheduler.wait_for(r"scheduler at (\S+);", PROBE_START_S)
        address = f"{a.address}:{match.group(1).rsplit(':', 1)[1]}"
        procs = []
        for host, role, rank in ((a, "server", 0), (b, "worker", 0), (b, "worker", 1)):
            proc = Proc(host.argv([*launcher, "join", "--scheduler", address, "--token-file",
                                   token, "--role", role, "--rank", rank, "--insecure",
                                   "--host", bind_host[host], *job]), env=env)
            host.adopt(proc.process)
            procs.append(proc)
        codes = [proc.wait(JOB_TIMEOUT_S * 2) for proc in procs]
        assert codes == [0, 0, 0], "\n---\n".join(p.output() for p in procs)
        assert scheduler.wait(60) == 0, scheduler.output()
        assert "every process is done" in scheduler.output()
        driver = procs[1].output()
        accuracy = float(re.search(r"held-out accuracy: ([0-9.]+)", driver).group(1))
        assert accuracy >= min_accuracy, driver
        assert f"trained {epochs * 22} steps" in driver, driver  # 1437 digits, batches of 64
        text = "\n".join(p.output() for p in procs)
        # Between the hosts the tensors take the tcp data plane, within host b
        # shared memory (docs/data-plane.md).
        assert re.search(r"\[worker 0\] transport to server 0: tcp", text), text
        assert re.search(r"\[server 0\] transport to worker 1: tcp", text), text
        assert re.search(r"\[worker 0\] transport to worker 1: shm", text) or \
            "transport to worker 1" not in driver, text
        if bind == "address":
            assert f"serving tensors on {a.address}:" in text
            assert f"serving tensors on {b.address}:" in text
        else:  # peers were told the namespaces' addresses, not 0.0.0.0
            assert "serving tensors on 0.0.0.0:" in text
            for host in (a, b):
                assert f"advertising {host.address} " in text
