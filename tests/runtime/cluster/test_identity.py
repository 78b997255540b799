"""Identity from Slurm's and torchrun's variables (runtime/cluster/identity.py), the GPU
of a process's local rank, and jobs whose processes are started the way srun
and torchrun start them: every process with its task's variables and no
scheduler address; task 0 hosts the scheduler. Real processes, loopback only."""

from __future__ import annotations

import socket
import sys

import pytest
import torch
from cluster import JOB_TIMEOUT_S, REPO, SCRIPTS, Proc, child_env

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

PS_TRAIN = REPO / "examples" / "ps_train.py"
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

def free_port() -> int:
    """A port nothing listens on now. srun and torchrun tasks must agree on the
    scheduler's port before any of them starts, so it cannot be bound as 0 and
    reported; the test picks one the kernel just handed out."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def flat_tensors(value, prefix="") -> dict[str, torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return {prefix: value}
    if isinstance(value, dict):
        found = {}
        for key, item in value.items():
            found.update(flat_tensors(item, f"{prefix}/{key}"))
        return found
    return {}


def assert_same_checkpoints(path, reference):
    got = flat_tensors(torch.load(path, weights_only=True))
    expected = flat_tensors(torch.load(reference, weights_only=True))
    assert got.keys() == expected.keys() and len(got) > 6
    for key, value in expected.items():
        assert torch.equal(got[key], value), f"{key} differs from the splitrun launch run"


def accuracy_line(output: str) -> str:
    line = next(line for line in output.splitlines() if "held-out accuracy" in line)
    return line[line.index("held-out accuracy"):]  # without the launcher's prefix


@pytest.fixture(scope="module")
def launched_reference(main_job_one_epoch):
    """examples/ps_train.py for one epoch through `splitrun launch`, 2 workers + 1
    server (conftest.py's run, shared with tests/test_launcher_logs.py): its
    checkpoint and held-out accuracy line."""
    return main_job_one_epoch.checkpoint, accuracy_line(main_job_one_epoch.output)


def start_tasks(tmp_path, argv_of_task, env_of_task, num_tasks) -> list[Proc]:
    procs = []
    try:
        for task in range(num_tasks):
            env = child_env({ENV.TOKEN: TOKEN, **env_of_task(task)})
            for variable in (ENV.SCHEDULER, ENV.ROLE, ENV.RANK):
                env.pop(variable, None)
            procs.append(Proc(argv_of_task(task), env=env, cwd=tmp_path))
        for task, proc in enumerate(procs):
            code = proc.wait(JOB_TIMEOUT_S)
            assert code == 0, f"task {task} exited with {code}:\n{proc.output()}"
    finally:
        for proc in procs:
            proc.kill()
    return procs


@pytest.mark.slow
def test_slurm_tasks_train_the_main_job_like_splitrun_launch(tmp_path, launched_reference):
    reference, accuracy = launched_reference
    out = tmp_path / "slurm.pt"
    # The host comes from the step's node list; the port from SPLITRUN_SCHEDULER_PORT
    # (SLURM_JOB_ID's port, 20000-29999, is below the kernel's free ports here).
    port = str(free_port())

    def env_of(task):
        return {"SLURM_PROCID": str(task), "SLURM_NTASKS": "3", "SLURM_LOCALID": str(task),
                "SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "localhost",
                "SLURM_JOB_NODELIST": "localhost", ENV.SCHEDULER_PORT: port}

    def argv_of(task):
        return [sys.executable, "-m", "splitrun.launcher", "-v", "join", "--workers", "2",
                "--servers", "1", str(PS_TRAIN), "--epochs", "1", "--save", str(out)]

    procs = start_tasks(tmp_path, argv_of, env_of, 3)
    assert f"hosting the scheduler at localhost:{port}" in procs[0].output()
    assert accuracy_line(procs[0].output()) == accuracy
    assert_same_checkpoints(out, reference)


@pytest.mark.slow
def test_torchrun_processes_train_the_main_job_like_splitrun_launch(tmp_path,
                                                                    launched_reference):
    """As `torchrun --nproc-per-node 3 examples/ps_train.py` starts it: no splitrun
    command, the servers counted by SPLITRUN_NUM_SERVERS. (The script runs through
    the bootstrap only so that its log lines show; it adds no variables.)"""
    reference, accuracy = launched_reference
    out = tmp_path / "torchrun.pt"
    master_port = free_port() - 1  # torchrun's store would hold MASTER_PORT

    def env_of(task):
        return {"RANK": str(task), "WORLD_SIZE": "3", "LOCAL_RANK": str(task),
                "LOCAL_WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(master_port), ENV.NUM_SERVERS: "1",
                ENV.LOG_LEVEL: "INFO"}

    def argv_of(task):
        return [sys.executable, "-m", "splitrun.launcher.bootstrap", str(PS_TRAIN),
                "--epochs", "1", "--save", str(out)]

    procs = start_tasks(tmp_path, argv_of, env_of, 3)
    assert f"hosting the scheduler at 127.0.0.1:{master_port + 1}" in procs[0].output()
    assert "joined as server 0" in procs[2].output()
    assert accuracy_line(procs[0].output()) == accuracy
    assert_same_checkpoints(out, reference)


@pytest.mark.slow
def test_real_torchrun_trains_the_main_job_like_splitrun_launch(tmp_path, launched_reference):
    """`torchrun --nproc-per-node 3 examples/ps_train.py`, torchrun's own agent
    on 127.0.0.1 (its store on MASTER_PORT, the scheduler on another port)."""
    reference, accuracy = launched_reference
    out = tmp_path / "torchrun.pt"
    master_port = free_port()
    scheduler_port = free_port()
    while scheduler_port == master_port:
        scheduler_port = free_port()
    env = child_env({ENV.TOKEN: TOKEN, ENV.NUM_SERVERS: "1",
                     ENV.SCHEDULER_PORT: str(scheduler_port)})
    for variable in (ENV.SCHEDULER, ENV.ROLE, ENV.RANK):
        env.pop(variable, None)
    proc = Proc([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3",
                 "--master-addr", "127.0.0.1", "--master-port", str(master_port),
                 str(PS_TRAIN), "--epochs", "1", "--save", str(out)], env=env, cwd=tmp_path)
    try:
        assert proc.wait(JOB_TIMEOUT_S) == 0, proc.output()
    finally:
        proc.kill()
    assert accuracy_line(proc.output()) == accuracy
    assert_same_checkpoints(out, reference)


@pytest.mark.slow
def test_when_task_0_fails_its_peers_are_told_why(tmp_path):
    """Task 0 hosts the scheduler; when its script raises, the scheduler stays up
    until the peers heard the failure, so they name it (not a lost scheduler)."""
    port = str(free_port())

    def env_of(task):
        return {"RANK": str(task), "WORLD_SIZE": "2", "LOCAL_RANK": str(task),
                "MASTER_ADDR": "127.0.0.1", ENV.SCHEDULER_PORT: port, ENV.LOG_LEVEL: "INFO"}

    procs = []
    try:
        for task in range(2):
            env = child_env({ENV.TOKEN: TOKEN, **env_of(task)})
            for variable in (ENV.SCHEDULER, ENV.ROLE, ENV.RANK):
                env.pop(variable, None)
            procs.append(Proc([sys.executable, "-m", "splitrun.launcher.bootstrap",
                               str(SCRIPTS / "fault_job.py"), "--crash-rank", "0",
                               "--crash-at", "3"], env=env, cwd=tmp_path))
        codes = [proc.wait(JOB_TIMEOUT_S) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    assert codes[0] != 0 and codes[1] != 0
    peer = procs[1].output()
    assert "worker 0 failed at step 3" in peer, peer
    assert "unreachable" not in peer


def test_off_loopback_without_tls_is_refused_under_slurm_too():
    from splitrun.runtime.job import Job

    env = slurm(1, 2, SPLITRUN_HOST="0.0.0.0", SPLITRUN_TOKEN=TOKEN)
    with pytest.raises(ClusterError, match=r"slurm task 1 of 2 .* would listen on 0.0.0.0 "
                                           r"\(SPLITRUN_HOST\) without TLS.*SPLITRUN_INSECURE=1"):
        Job.from_env(env)
