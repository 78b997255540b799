"""The environment contract between a launcher and the processes it starts.

`splitrun launch` and `splitrun join` set these variables; `Job.from_env()`
reads them through `ProcessEnvironment.parse`. Nothing else in splitrun reads
the environment, so this module (with `identity`, which reads what Slurm and
torchrun set when no splitrun launcher named the scheduler) is the whole contract.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass

from splitrun.splitter.errors import LabelError
from splitrun.splitter.labels import Cluster, Role

from ..errors import ClusterError
from ..rpc.tls import TlsFiles
from .identity import SCHEDULER_PORT_VARIABLE, ForeignIdentity, foreign_identity

__all__ = ["ENV", "ProcessEnvironment"]


class ENV:
    """Environment variables `splitrun launch` and `splitrun join` set."""

    SCHEDULER = "SPLITRUN_SCHEDULER"      # host:port of the scheduler
    TOKEN = "SPLITRUN_TOKEN"              # the job's secret; every call carries it
    ROLE = "SPLITRUN_ROLE"                # worker | server
    RANK = "SPLITRUN_RANK"                # optional: the rank to ask for
    DEVICE = "SPLITRUN_DEVICE"            # cpu | cuda | auto
    HOST = "SPLITRUN_HOST"                # interface this process's tensor server binds
    ADVERTISE = "SPLITRUN_ADVERTISE"      # name peers use to reach it (default: HOST)
    RECV_TIMEOUT_S = "SPLITRUN_RECV_TIMEOUT_S"
    IDLE_TIMEOUT_S = "SPLITRUN_IDLE_TIMEOUT_S"
    HEARTBEAT_TIMEOUT_S = "SPLITRUN_HEARTBEAT_TIMEOUT_S"
    THREADS = "SPLITRUN_THREADS"          # intra-op threads (torch.set_num_threads)
    LOG_LEVEL = "SPLITRUN_LOG_LEVEL"      # read by the launcher's bootstrap
    PLAN_OUT = "SPLITRUN_PLAN_OUT"        # `splitrun plan`: write the plan's text form here
    PLAN_MODULES_OUT = "SPLITRUN_PLAN_MODULES_OUT"  # ...and each node's module (JSON) here
    NUM_WORKERS = "SPLITRUN_NUM_WORKERS"  # cluster size for `splitrun plan`
    NUM_SERVERS = "SPLITRUN_NUM_SERVERS"
    TRANSPORT = "SPLITRUN_TRANSPORT"      # auto (default) | grpc | shm: see TransportChoice
    SHM_PREFIX = "SPLITRUN_SHM_PREFIX"    # the job's shared-memory prefix (the launcher's)
    SHM_RING_MB = "SPLITRUN_SHM_RING_MB"  # MiB of each same-host ring (default 64; yours)
    CHECKPOINT_EVERY = "SPLITRUN_CHECKPOINT_EVERY"  # workers save every K steps...
    CHECKPOINT_DIR = "SPLITRUN_CHECKPOINT_DIR"      # ...into this directory
    RESTART_FROM = "SPLITRUN_RESTART_FROM"  # a restarted job resumes from this checkpoint
    TLS_CERT = "SPLITRUN_TLS_CERT"        # this process's certificate (PEM)...
    TLS_KEY = "SPLITRUN_TLS_KEY"          # ...its key...
    TLS_CA = "SPLITRUN_TLS_CA"            # ...and the CA peers' certificates are checked against
    LOCAL_RANK = "SPLITRUN_LOCAL_RANK"    # index among the job's processes on this machine
    METRICS_DIR = "SPLITRUN_METRICS_DIR"  # TensorBoard scalars go to METRICS_DIR/<process>/
    STEP_FILE = "SPLITRUN_STEP_FILE"      # the process keeps its steps done here for its
                                          # launcher, which names them if it is killed
    INSECURE = "SPLITRUN_INSECURE"        # Slurm/torchrun: 1 lets a process serve off
                                          # loopback without TLS (splitrun join --insecure)
    SCHEDULER_PORT = SCHEDULER_PORT_VARIABLE  # Slurm/torchrun: task 0's scheduler port


@dataclass(frozen=True)
class ProcessEnvironment:
    """What a launcher told this process, parsed and checked."""

    scheduler: str | None          # None in plan mode
    token: str
    role: Role
    rank: int | None               # None: the scheduler picks the next free rank
    device: str                    # "auto", "cpu", "cuda", "cuda:1", ...
    host: str
    advertise: str
    recv_timeout_s: float | None
    idle_timeout_s: float | None
    heartbeat_timeout_s: float | None
    plan_out: str | None
    plan_cluster: Cluster          # the cluster `splitrun plan` splits for
    threads: int | None            # intra-op threads the launcher budgeted, if any
    transport: str = "auto"        # SPLITRUN_TRANSPORT, checked by TransportChoice.parse
    shm_prefix: str | None = None  # None: no shared memory (no launcher gave a prefix)
    shm_ring_mb: int | None = None  # None: ShmSettings' default
    checkpoint_every: int | None = None  # save every K steps (splitrun launch --checkpoint-every)
    checkpoint_dir: str | None = None
    restart_from: str | None = None      # a restarted job's checkpoint
    tls: TlsFiles | None = None          # TLS for the tensor service and the scheduler
    # Picks this process's GPU (cuda:local_rank modulo the visible devices):
    # SPLITRUN_LOCAL_RANK, else torchrun's LOCAL_RANK or Slurm's SLURM_LOCALID.
    local_rank: int = 0
    # Started by srun or torchrun with no scheduler named: who Slurm or torchrun
    # says this process is (task 0 hosts the scheduler); see `identity`.
    identity: ForeignIdentity | None = None
    metrics_dir: str | None = None       # splitrun --metrics-dir: TensorBoard scalars
    plan_modules_out: str | None = None  # `splitrun plan`: node -> module map, for the picture
    is_insecure: bool = False            # SPLITRUN_INSECURE=1
    step_file: str | None = None         # SPLITRUN_STEP_FILE (splitrun launch)

    @classmethod
    def parse(cls, environ: Mapping[str, str]) -> ProcessEnvironment:
        plan_out = environ.get(ENV.PLAN_OUT) or None
        scheduler = environ.get(ENV.SCHEDULER) or None
        identity = foreign_identity(environ) if plan_out is None and scheduler is None else None
        if plan_out is None and scheduler is None and identity is None:
            raise ClusterError(
                f"{ENV.SCHEDULER} is not set: this script joins a splitrun job; start it "
                f"with `splitrun launch --workers N {sys.argv[0]}`, `splitrun join "
                f"--scheduler HOST:PORT {sys.argv[0]}`, or under srun or torchrun (their "
                f"SLURM_PROCID/SLURM_NTASKS or RANK/WORLD_SIZE name the process)")
        try:
            role = Role.parse(environ.get(ENV.ROLE, "worker"))
        except LabelError as exc:
            raise ClusterError(f"{ENV.ROLE}: {exc}") from None
        host = environ.get(ENV.HOST, "127.0.0.1")
        rank = _integer(environ, ENV.RANK)
        if identity is not None:
            _check_identity_alone(environ, identity)
            scheduler, role, rank = identity.scheduler, identity.label.role, identity.label.rank
        elif rank is not None and rank < 0:
            raise ClusterError(f"{ENV.RANK}={rank}: ranks start at 0; leave it unset (no "
                               f"--rank) to take the next free one")
        shm_ring_mb = _integer(environ, ENV.SHM_RING_MB)
        if shm_ring_mb is not None and shm_ring_mb < 1:
            raise ClusterError(f"{ENV.SHM_RING_MB}={shm_ring_mb}: each ring needs at least 1 "
                               f"MiB (the default is 64)")
        local_rank = _integer(environ, ENV.LOCAL_RANK)
        if local_rank is None:
            local_rank = identity.local_rank if identity is not None else _foreign_local_rank(
                environ)
        return cls(
            scheduler=scheduler, token=environ.get(ENV.TOKEN, ""), role=role,
            rank=rank,
            device=environ.get(ENV.DEVICE, "auto") or "auto", host=host,
            advertise=environ.get(ENV.ADVERTISE) or host,
            recv_timeout_s=_seconds(environ, ENV.RECV_TIMEOUT_S),
            idle_timeout_s=_seconds(environ, ENV.IDLE_TIMEOUT_S),
            heartbeat_timeout_s=_seconds(environ, ENV.HEARTBEAT_TIMEOUT_S),
            plan_out=plan_out,
            plan_cluster=Cluster(_integer(environ, ENV.NUM_WORKERS) or 1,
                                 _integer(environ, ENV.NUM_SERVERS) or 0),
            threads=_integer(environ, ENV.THREADS),
            transport=environ.get(ENV.TRANSPORT, "") or "auto",
            shm_prefix=environ.get(ENV.SHM_PREFIX) or None, shm_ring_mb=shm_ring_mb,
            checkpoint_every=_integer(environ, ENV.CHECKPOINT_EVERY),
            checkpoint_dir=environ.get(ENV.CHECKPOINT_DIR) or None,
            restart_from=environ.get(ENV.RESTART_FROM) or None,
            tls=TlsFiles.from_paths(environ.get(ENV.TLS_CERT), environ.get(ENV.TLS_KEY),
                                    environ.get(ENV.TLS_CA)),
            local_rank=max(local_rank, 0), identity=identity,
            metrics_dir=environ.get(ENV.METRICS_DIR) or None,
            plan_modules_out=environ.get(ENV.PLAN_MODULES_OUT) or None,
            is_insecure=environ.get(ENV.INSECURE, "") == "1",
            step_file=environ.get(ENV.STEP_FILE) or None)


def _check_identity_alone(environ: Mapping[str, str], identity: ForeignIdentity) -> None:
    """Under Slurm or torchrun the task number decides the role and rank; a
    different role or rank asked for as well would contradict it."""
    asked = {ENV.ROLE: identity.label.role.value, ENV.RANK: str(identity.label.rank)}
    for key, expected in asked.items():
        if environ.get(key, "") not in ("", "-1", expected):
            raise ClusterError(
                f"{key}={environ[key]} is set, but {identity.describe()} takes its role "
                f"and rank from its task number; drop --role/--rank (assign roles with "
                f"--workers/--servers), or name the scheduler with --scheduler HOST:PORT")


def _foreign_local_rank(environ: Mapping[str, str]) -> int:
    """The local rank torchrun or Slurm set, where a splitrun launcher did not."""
    for key in ("LOCAL_RANK", "SLURM_LOCALID"):
        value = _integer(environ, key)
        if value is not None:
            return value
    return 0


def _integer(environ: Mapping[str, str], key: str) -> int | None:
    text = environ.get(key, "")
    if text == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise ClusterError(f"{key}={text!r} is not an integer") from None


def _seconds(environ: Mapping[str, str], key: str) -> float | None:
    text = environ.get(key, "")
    if text == "":
        return None
    try:
        return float(text)
    except ValueError:
        raise ClusterError(f"{key}={text!r} is not a number of seconds") from None
