"""The environment a process of a job gets from its launcher: the thread
budget, glibc's copy tunables, the job's variables (SPLITRUN_*: scheduler,
token, label, device, TLS files, metrics), and the environment a template the
processes are forked from starts with. The local launcher, the Ray backend,
`splitrun join` and the standing template all take it from here."""

from __future__ import annotations

import os

from splitrun.runtime.cluster.env import ENV
from splitrun.runtime.rpc.tls import TlsFiles
from splitrun.runtime.transport.shm.copy_tunables import glibc_tunables_for_copies
from splitrun.splitter.errors import SplitrunError
from splitrun.splitter.labels import Label

__all__ = ["THREAD_VARIABLES", "thread_budget", "thread_env", "copy_env", "template_env",
           "child_env", "tls_env", "metrics_env"]

# The variables that carry the thread budget besides SPLITRUN_THREADS; the user's win.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def thread_budget(requested: int | None, num_local_processes: int) -> int:
    """Intra-op threads per process: as asked, else OMP_NUM_THREADS where the
    user set it, else the cores shared out among the processes on this
    machine. torch's default (every core in every process) oversubscribes the
    machine as soon as two processes compute."""
    if requested is not None:
        if requested < 1:
            raise SplitrunError(f"--threads-per-process must be >= 1, got {requested}")
        return requested
    user = os.environ.get("OMP_NUM_THREADS", "")
    if user.isdigit() and int(user) >= 1:
        return int(user)
    return max(1, (os.cpu_count() or 1) // max(1, num_local_processes))


def thread_env(threads: int) -> dict[str, str]:
    """The variables of a budget of `threads`, but those the user set."""
    env = {ENV.THREADS: str(threads)}
    for variable in THREAD_VARIABLES:
        if variable not in os.environ:
            env[variable] = str(threads)
    return env


def copy_env() -> dict[str, str]:
    """Large copies (a message into or out of a shared-memory ring) bypass
    the caches (`glibc_tunables_for_copies`): set where a process starts."""
    return {"GLIBC_TUNABLES": glibc_tunables_for_copies(os.environ.get("GLIBC_TUNABLES"))}


def template_env(threads: int) -> dict[str, str]:
    """The environment a template of processes with `threads` intra-op threads
    starts with: theirs but their own variables (SPLITRUN_*)."""
    env = dict(os.environ)
    env.update(thread_env(threads))
    env.update(copy_env())
    return env


def child_env(args, address: str, token: str, label: Label,
              shm_prefix: str | None = None) -> dict[str, str]:
    """The environment of the process `label` of the job `splitrun launch
    args` starts, whose scheduler is at `address`."""
    env = dict(os.environ)
    env.update(thread_env(thread_budget(args.threads_per_process,
                                        args.workers + args.servers)))
    env.update(copy_env())
    env.update({ENV.SCHEDULER: address, ENV.TOKEN: token, ENV.ROLE: label.role.value,
                ENV.RANK: str(label.rank), ENV.DEVICE: args.device, ENV.HOST: args.host,
                ENV.LOG_LEVEL: args.log_level, ENV.HEARTBEAT_TIMEOUT_S: str(args.heartbeat_timeout),
                "PYTHONUNBUFFERED": "1"})
    if args.recv_timeout is not None:
        env[ENV.RECV_TIMEOUT_S] = str(args.recv_timeout)
    if shm_prefix is not None:
        env[ENV.SHM_PREFIX] = shm_prefix
    env.update(metrics_env(args))
    return env


def tls_env(tls: TlsFiles | None) -> dict[str, str]:
    """The variables that hand a process the job's TLS files."""
    if tls is None:
        return {}
    return {ENV.TLS_CERT: os.path.abspath(tls.cert), ENV.TLS_KEY: os.path.abspath(tls.key),
            ENV.TLS_CA: os.path.abspath(tls.ca)}


def metrics_env(args) -> dict[str, str]:
    """--metrics-dir: where each process writes its TensorBoard scalars."""
    if args.metrics_dir is None:
        return {}
    return {ENV.METRICS_DIR: os.path.abspath(args.metrics_dir)}
