"""Jobs whose processes are started the way srun and torchrun start them: every
process with its task's variables and no scheduler address; task 0 hosts the
scheduler. Real processes, loopback only. (Reading the variables:
tests/runtime/cluster/test_identity.py.)"""

from __future__ import annotations

import re
import socket
import sys

import pytest
import torch
from cluster import JOB_TIMEOUT_S, REPO, SCRIPTS, Proc, child_env

from splitrun.runtime.cluster.env import ENV

PS_TRAIN = REPO / "examples" / "ps_train.py"
TOKEN = "identity-test-token"


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


def joined(output: str) -> list[str]:
    """How each process computed: its label, threads and CPU kernels."""
    return re.findall(r"joined as .*", output)


def assert_same_checkpoints(path, reference, output, reference_output):
    """Bit for bit; a failure names every differing entry with its largest
    difference and how each run's processes computed."""
    got = flat_tensors(torch.load(path, weights_only=True))
    expected = flat_tensors(torch.load(reference, weights_only=True))
    assert got.keys() == expected.keys() and len(got) > 6
    differ = {key: (got[key] - value).abs().max().item() for key, value in expected.items()
              if not torch.equal(got[key], value)}
    assert not differ, (
        f"{len(differ)} of {len(expected)} entries differ from the splitrun launch run "
        f"(largest difference each): {differ}\nthis run's processes: {joined(output)}\n"
        f"the launch run's: {joined(reference_output)}")


def accuracy_line(output: str) -> str:
    line = next(line for line in output.splitlines() if "held-out accuracy" in line)
    return line[line.index("held-out accuracy"):]  # without the launcher's prefix


@pytest.fixture(scope="module")
def launched_reference(main_job_one_epoch):
    """examples/ps_train.py for one epoch through `splitrun launch`, 2 workers + 1
    server (conftest.py's run, shared with tests/e2e/test_launcher_logs_e2e.py): its
    checkpoint, held-out accuracy line and output."""
    return (main_job_one_epoch.checkpoint, accuracy_line(main_job_one_epoch.output),
            main_job_one_epoch.output)


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


def test_slurm_tasks_train_the_main_job_like_splitrun_launch(tmp_path, launched_reference):
    reference, accuracy, reference_output = launched_reference
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
    assert_same_checkpoints(out, reference, "".join(proc.output() for proc in procs),
                            reference_output)


def test_torchrun_processes_train_the_main_job_like_splitrun_launch(tmp_path,
                                                                    launched_reference):
    """As `torchrun --nproc-per-node 3 examples/ps_train.py` starts it: no splitrun
    command, the servers counted by SPLITRUN_NUM_SERVERS. (The script runs through
    the bootstrap only so that its log lines show; it adds no variables.)"""
    reference, accuracy, reference_output = launched_reference
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
    assert_same_checkpoints(out, reference, "".join(proc.output() for proc in procs),
                            reference_output)


def test_real_torchrun_trains_the_main_job_like_splitrun_launch(tmp_path, launched_reference):
    """`torchrun --nproc-per-node 3 examples/ps_train.py`, torchrun's own agent
    on 127.0.0.1 (its store on MASTER_PORT, the scheduler on another port)."""
    reference, accuracy, reference_output = launched_reference
    out = tmp_path / "torchrun.pt"
    master_port = free_port()
    scheduler_port = free_port()
    while scheduler_port == master_port:
        scheduler_port = free_port()
    env = child_env({ENV.TOKEN: TOKEN, ENV.NUM_SERVERS: "1",
                     ENV.SCHEDULER_PORT: str(scheduler_port), ENV.LOG_LEVEL: "INFO"})
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
    assert_same_checkpoints(out, reference, proc.output(), reference_output)


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
