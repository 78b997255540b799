"""A standing template (launcher/standing_template.py) shared by launches,
through the real launcher: its processes are the template's children, yet the
launcher stops them, reads how they ended and leaves none behind when it is
SIGKILLed; two launchers use it at once; where it cannot serve a launch (gone,
another environment, another nice value) the launch starts its own template and
says why. (How
each way of ending is reported: tests/e2e/test_start_methods_e2e.py, "standing".
conftest.py starts the standing template every launch of the suite uses.)"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys

import pytest
from cluster import (
    JOB_TIMEOUT_S,
    SCRIPTS,
    Proc,
    StandingTemplateProc,
    child_env,
    pid_alive,
    wait_exited,
)

ENDINGS_JOB = SCRIPTS / "endings.py"
# Bounds the end of a job's processes once their launcher or template is gone.
GONE_S = 30.0


def served_by(template: StandingTemplateProc) -> dict[str, str]:
    """The environment of a launch served by `template` (whatever conftest.py set)."""
    return {StandingTemplateProc.VARIABLE: template.socket}


def waiting_pids(proc, workers: int) -> dict[str, int]:
    """The pids of each waiting worker (tests/support/scripts/endings.py --ending wait)
    and of the helper process it started in its group."""
    pids = {}
    for rank in range(workers):
        pids[f"worker {rank}"] = int(proc.wait_for(rf"started worker {rank} \(pid (\d+)\)",
                                                   60).group(1))
        pids[f"helper {rank}"] = int(proc.wait_for(
            rf"\[worker {rank}\] waiting, with a helper \(pid (\d+)\)", JOB_TIMEOUT_S).group(1))
    return pids


def parents(tmp_path, workers: int) -> set[int]:
    return {json.loads((tmp_path / f"facts-worker{rank}.json").read_text())["ppid"]
            for rank in range(workers)}


def test_a_sigkilled_launcher_leaves_no_process_of_its_job(local_cluster, tmp_path,
                                                           standing_template):
    proc = local_cluster.start("launch", "--workers", 2, ENDINGS_JOB, "--dir", tmp_path,
                               "--ending", "wait", env_extra=served_by(standing_template))
    pids = {}
    try:
        pids = waiting_pids(proc, 2)
        assert parents(tmp_path, 2) == {standing_template.pid}
        os.kill(proc.process.pid, signal.SIGKILL)
        proc.process.wait(timeout=10)
        alive = wait_exited(pids.values(), GONE_S)
    finally:
        proc.kill()
        for pid in pids.values():
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert not alive, {name: pid for name, pid in pids.items() if pid in alive}
    assert pid_alive(standing_template.pid), "the standing template went with the launcher"


def test_two_launchers_share_one_template_at_once(local_cluster, tmp_path, standing_template):
    """One job waits while another starts, runs and ends cleanly beside it; then
    the first is stopped by SIGTERM: every process of it (and its helpers) is
    stopped and reported as the launcher reports its own children."""
    waiting, clean = tmp_path / "waiting", tmp_path / "clean"
    waiting.mkdir()
    clean.mkdir()
    first = local_cluster.start("launch", "--workers", 2, ENDINGS_JOB, "--dir", waiting,
                                "--ending", "wait", env_extra=served_by(standing_template))
    pids = waiting_pids(first, 2)
    second = local_cluster.start("launch", "--workers", 2, ENDINGS_JOB, "--dir", clean,
                                 "--ending", "clean", env_extra=served_by(standing_template))
    assert second.wait(JOB_TIMEOUT_S) == 0, second.output()
    assert "all 2 processes finished" in second.output()
    assert parents(waiting, 2) == parents(clean, 2) == {standing_template.pid}
    assert all(pid_alive(pid) for pid in pids.values()), "the second job stopped the first's"
    os.kill(first.process.pid, signal.SIGTERM)
    assert first.wait(JOB_TIMEOUT_S) == 128 + signal.SIGTERM, first.output()
    assert "interrupted by SIGTERM; stopped every process" in first.output()
    assert not wait_exited(pids.values(), GONE_S)


@pytest.mark.parametrize("why", ["gone", "environment", "nice"])
def test_where_the_standing_template_cannot_serve_the_launch_starts_its_own(
        local_cluster, tmp_path, why, standing_template):
    prefix = []
    if why == "gone":
        # What a killed template leaves: its socket file, nobody listening.
        path = str(tmp_path / "gone.sock")
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as stale:
            stale.bind(path)
        env = {StandingTemplateProc.VARIABLE: path}
        said = rf"the standing template at {re.escape(path)} is gone \(.*refused.*\); this " \
               r"launch starts its own template"
    elif why == "environment":
        # torch reads OMP_NUM_THREADS at import; splitrun's own variables may differ
        env = {**served_by(standing_template), "SPLITRUN_TEST_ONLY": "1", "OMP_NUM_THREADS": "1"}
        said = rf"the standing template at {re.escape(standing_template.socket)} cannot serve " \
               r"this launch: its environment differs from the template's in " \
               r"MKL_NUM_THREADS, OMP_NUM_THREADS; this launch starts its own template"
    else:  # what a process inherits beyond its environment
        prefix, env = ["nice", "-n", "3"], served_by(standing_template)
        said = rf"the standing template at {re.escape(standing_template.socket)} cannot serve " \
               r"this launch: it runs with another nice value; this launch starts its own"
    proc = Proc([*prefix, sys.executable, "-m", "splitrun.launcher", "-v", "launch",
                 "--workers", 2, ENDINGS_JOB, "--dir", tmp_path, "--ending", "clean"],
                env=child_env(env), cwd=tmp_path)
    local_cluster.procs.append(proc)  # ended with the test
    assert proc.wait(JOB_TIMEOUT_S) == 0, proc.output()
    assert len(re.findall(said, proc.output())) == 1, proc.output()
    assert re.search(r"(?<!standing )template \(pid \d+\) imported torch", proc.output()), \
        proc.output()
    assert parents(tmp_path, 2) == {proc.process.pid}, "adopted from its own template"


def test_processes_die_with_their_standing_template_and_the_launcher_says_so(local_cluster,
                                                                           tmp_path):
    template = StandingTemplateProc(tmp_path)
    try:
        proc = local_cluster.start("launch", "--workers", 1, ENDINGS_JOB, "--dir", tmp_path,
                                   "--ending", "wait",
                                   env_extra=served_by(template))
        pids = waiting_pids(proc, 1)
        assert parents(tmp_path, 1) == {template.pid}
        os.kill(template.pid, signal.SIGKILL)
        code = proc.wait(JOB_TIMEOUT_S)
    finally:
        template.close()
    assert code == 128 + signal.SIGKILL, proc.output()
    assert f"worker 0 (pid {pids['worker 0']}) was killed by SIGKILL" in proc.output()
    assert "ended with the standing template (its exit code is lost" in proc.output()
    assert not wait_exited(pids.values(), GONE_S)


def test_a_socket_path_in_use_is_refused_with_what_to_do(tmp_path):
    taken = tmp_path / "taken.sock"
    taken.touch()
    proc = Proc([sys.executable, "-m", "splitrun.launcher.standing_template", "--serve", taken],
                env=child_env(), cwd=tmp_path)
    assert proc.wait(60) == 1, proc.output()
    assert f"splitrun: cannot listen on {taken}: Address already in use (a path left by a " \
           "killed template: remove it" in proc.output()
