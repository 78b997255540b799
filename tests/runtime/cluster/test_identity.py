"""Identity from Slurm's and torchrun's variables (runtime/cluster/identity.py), the GPU
of a process's local rank, and a job refused off loopback under Slurm's variables
without TLS. (Jobs whose processes are started the way srun and torchrun start
them: tests/e2e/test_identity_e2e.py.)"""

from __future__ import annotations

import pytest
import torch

from splitrun.runtime.cluster.env import ENV, ProcessEnvironment
from splitrun.runtime.cluster.identity import (
    SLURM_BASE_PORT,
    IdentitySource,
    first_host,
    foreign_identity,
)
from splitrun.runtime.errors import ClusterError
from splitrun.runtime.job import pick_device
from splitrun.splitter.labels import Cluster, Label

TOKEN = "identity-test-token"


# -- reading the variables -----------------------------------------------------------------

@pytest.mark.parametrize("nodelist, first", [
    ("node07", "node07"),
    ("node[03-05,9],gpu1", "node03"),
    ("node[01-04]", "node01"),
    ("gpu-a[7,2]", "gpu-a7"),
    ("a1,b2", "a1"),
    ("localhost", "localhost"),
])
def test_first_host_of_a_slurm_node_list(nodelist, first):
    assert first_host(nodelist) == first


def slurm(task: int, num_tasks: int, **extra: str) -> dict[str, str]:
    env = {"SLURM_PROCID": str(task), "SLURM_NTASKS": str(num_tasks),
           "SLURM_LOCALID": str(task % 2), "SLURM_JOB_ID": "123456",
           "SLURM_STEP_NODELIST": "node[03-04]", "SLURM_JOB_NODELIST": "node[01-04]"}
    env.update(extra)
    return env


def test_slurm_tasks_are_workers_then_servers_and_task_0_hosts_the_scheduler():
    labels = []
    for task in range(4):
        identity = foreign_identity(slurm(task, 4, SPLITRUN_NUM_SERVERS="1"))
        assert identity.source is IdentitySource.SLURM
        assert identity.cluster == Cluster(3, 1)
        assert identity.hosts_scheduler == (task == 0)
        assert identity.local_rank == task % 2
        # The first node of the step (srun puts task 0 there), one port per job.
        assert identity.scheduler == f"node03:{SLURM_BASE_PORT + 123456 % 10000}"
        labels.append(identity.label)
    assert labels == [Label.worker(0), Label.worker(1), Label.worker(2), Label.server(0)]


def test_master_addr_and_port_name_the_scheduler_and_torchrun_wins_over_slurm():
    env = slurm(3, 4, RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="10.0.0.5",
                MASTER_PORT="29500")
    identity = foreign_identity(env)
    assert identity.source is IdentitySource.TORCHRUN
    assert (identity.task, identity.num_tasks, identity.local_rank) == (1, 2, 1)
    # torchrun's own store listens on MASTER_PORT; the scheduler takes the next port.
    assert identity.scheduler == "10.0.0.5:29501"
    assert identity.label == Label.worker(1)
    env[ENV.SCHEDULER_PORT] = "31000"
    assert foreign_identity(env).scheduler == "10.0.0.5:31000"


def test_no_launcher_variables_means_no_foreign_identity():
    assert foreign_identity({"PATH": "/bin"}) is None


@pytest.mark.parametrize("env, message", [
    (slurm(0, 3, SPLITRUN_NUM_WORKERS="2", SPLITRUN_NUM_SERVERS="2"),
     r"SLURM_NTASKS=3 tasks, but the job wants 2 workers and 2 servers"),
    (slurm(0, 2, SPLITRUN_NUM_SERVERS="2"), r"at least 1 worker"),
    (slurm(5, 3), r"SLURM_PROCID=5 and SLURM_NTASKS=3"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, r"no scheduler host: set MASTER_ADDR"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "n1"},
     r"no scheduler port: set SPLITRUN_SCHEDULER_PORT"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, r"RANK='x' is not an integer"),
])
def test_inconsistent_variables_are_named(env, message):
    with pytest.raises(ClusterError, match=message):
        foreign_identity(env)


def test_a_role_asked_for_against_the_task_number_is_refused():
    env = slurm(0, 2, SPLITRUN_ROLE="server")
    with pytest.raises(ClusterError, match=r"SPLITRUN_ROLE=server is set, but slurm task 0"):
        ProcessEnvironment.parse(env)
    parsed = ProcessEnvironment.parse(slurm(1, 2, SPLITRUN_ROLE="worker"))
    assert (parsed.role.value, parsed.rank, parsed.local_rank) == ("worker", 1, 1)


def test_a_named_scheduler_wins_over_the_launchers_variables():
    # `splitrun launch` inside an sbatch allocation: its children see SLURM_* too.
    parsed = ProcessEnvironment.parse(slurm(0, 1, SPLITRUN_SCHEDULER="127.0.0.1:5",
                                            SPLITRUN_ROLE="server", SPLITRUN_LOCAL_RANK="3"))
    assert parsed.identity is None and parsed.scheduler == "127.0.0.1:5"
    assert (parsed.role.value, parsed.local_rank) == ("server", 3)


def test_the_ring_size_is_read_and_a_bad_one_is_named():
    env = {"SPLITRUN_SCHEDULER": "127.0.0.1:5"}
    assert ProcessEnvironment.parse(env).shm_ring_mb is None
    assert ProcessEnvironment.parse({**env, "SPLITRUN_SHM_RING_MB": "8"}).shm_ring_mb == 8
    with pytest.raises(ClusterError, match=r"SPLITRUN_SHM_RING_MB=0: each ring needs at least"):
        ProcessEnvironment.parse({**env, "SPLITRUN_SHM_RING_MB": "0"})
    with pytest.raises(ClusterError, match=r"SPLITRUN_SHM_RING_MB='big' is not an integer"):
        ProcessEnvironment.parse({**env, "SPLITRUN_SHM_RING_MB": "big"})


# -- the GPU of the local rank -------------------------------------------------------------

@pytest.mark.parametrize("text, local_rank, expected", [
    ("auto", 0, "cuda:0"),
    ("auto", 3, "cuda:1"),   # 4th process on a machine with 2 GPUs
    ("cuda", 2, "cuda:0"),
    ("cuda", 5, "cuda:1"),
    ("cuda:1", 0, "cuda:1"),  # an explicit index is kept
    ("cpu", 3, "cpu"),
])
def test_each_process_uses_the_gpu_of_its_local_rank(monkeypatch, text, local_rank, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert pick_device(text, local_rank) == torch.device(expected)


def test_without_cuda_auto_is_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pick_device("auto", 3) == torch.device("cpu")
    with pytest.raises(ClusterError, match="no CUDA device"):
        pick_device("cuda", 0)


# -- jobs started the srun / torchrun way --------------------------------------------------

def test_off_loopback_without_tls_is_refused_under_slurm_too():
    from splitrun.runtime.job import Job

    env = slurm(1, 2, SPLITRUN_HOST="0.0.0.0", SPLITRUN_TOKEN=TOKEN)
    with pytest.raises(ClusterError, match=r"slurm task 1 of 2 .* would listen on 0.0.0.0 "
                                           r"\(SPLITRUN_HOST\) without TLS.*SPLITRUN_INSECURE=1"):
        Job.from_env(env)
