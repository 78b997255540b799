"""bench/ps_memory_cap.py's splitrun job on small models: real `splitrun join`
processes, each server in a memory cgroup of its own. With room, each server
trains keeping only its own parameters and Adam state (the model's freed);
under a cap too small for its share, the OOM-killed server is named by the
scheduler as such, with its memory, not the peer that saw it die."""

import argparse
import os
import re

import ps_memory_cap
import pytest

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="memory cgroups need root")
MIB = 1 << 20


def run(tmp_path, layers: int, width: int, cap_mb: int) -> dict:
    args = argparse.Namespace(layers=layers, width=width, steps=2, gradient_bucket_mb=0)
    return ps_memory_cap.run_splitrun(args, tmp_path, cap_mb * MIB)


def test_each_server_keeps_only_its_share_and_the_model_is_freed(tmp_path):
    result = run(tmp_path, layers=4, width=512, cap_mb=1500)
    assert result["finished"], result
    by_process = {p["process"]: p for p in result["processes"]}
    params_mb = 4 * 512 * 513 * 4 / MIB
    servers = [by_process["server 0"], by_process["server 1"]]
    for server in servers:
        assert server["model_parameters_mb_left_here"] == 0.0
        assert 0 < server["owned_state_mb"] < 3 * params_mb
    assert sum(s["owned_state_mb"] for s in servers) == pytest.approx(3 * params_mb, abs=0.2)
    worker = by_process["worker 0"]
    assert worker["owned_state_mb"] == 0.0
    assert worker["model_parameters_mb_left_here"] == pytest.approx(params_mb, abs=0.1)
    assert len(worker["losses"]) == 2 and worker["losses"][1] < worker["losses"][0]
    assert {"__s0_0.distcp", "__s1_0.distcp"} <= set(result["checkpoint_files"])
    assert all(m["oom_kills"] == 0 for m in result["server_memory"])


def test_a_server_killed_at_its_memory_cap_is_named_out_of_memory(tmp_path):
    result = run(tmp_path, layers=4, width=4096, cap_mb=800)
    assert not result["finished"]
    assert sum(m["oom_kills"] for m in result["server_memory"]) >= 1, result
    verdict = (tmp_path / "scheduler.log").read_text()
    assert re.search(r"job failed: server \d \(pid \d+ on \S+\) (died|sent no heartbeat).*its "
                     r"last heartbeat said RSS [\d.]+ MiB \(peak [\d.]+ MiB\) of its memory "
                     r"cgroup's limit 800.0 MiB: likely killed by the OOM killer", verdict), \
        verdict
