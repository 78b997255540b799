"""A process's identity from the launchers users already have: Slurm (`srun`)
and torchrun.

When no splitrun launcher named the scheduler (`SPLITRUN_SCHEDULER` unset), a
process started by `srun` or `torchrun` (directly, or through `splitrun join`)
derives everything from the variables those tools set:

- **which task it is**: torchrun's `RANK`/`WORLD_SIZE`/`LOCAL_RANK`, else
  Slurm's `SLURM_PROCID`/`SLURM_NTASKS`/`SLURM_LOCALID` (torchrun wins when both
  are set: under `srun torchrun ...` Slurm's numbers count the torchrun agents);
- **its label**: tasks `0 .. W-1` are workers `0 .. W-1`, tasks `W .. W+S-1`
  servers `0 .. S-1`, for `S` from `SPLITRUN_NUM_SERVERS` (`splitrun join
  --servers S`, default 0) and `W` from `SPLITRUN_NUM_WORKERS` (default: the
  rest); `W + S` must equal the number of tasks;
- **the scheduler's address**: task 0 (worker 0) hosts the scheduler. Its host
  is `MASTER_ADDR` where set (torchrun always sets it), else the first host of
  `SLURM_STEP_NODELIST` (else `SLURM_JOB_NODELIST`): `srun` places task 0 on the
  first node of its step. Its port is `SPLITRUN_SCHEDULER_PORT` where set, else
  `MASTER_PORT + 1` (torchrun's own store holds `MASTER_PORT`), else
  `20000 + SLURM_JOB_ID % 10000` (one port per Slurm job, the same on every task).

This module only reads; `Job.from_env` acts on what it finds.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass

from splitrun.splitter.labels import Cluster, Label

from ..errors import ClusterError

__all__ = ["IdentitySource", "ForeignIdentity", "foreign_identity", "first_host",
           "label_of_task", "SCHEDULER_PORT_VARIABLE", "SLURM_BASE_PORT"]

# Overrides the port task 0's scheduler listens on (and every task dials).
SCHEDULER_PORT_VARIABLE = "SPLITRUN_SCHEDULER_PORT"
# Without MASTER_PORT or SPLITRUN_SCHEDULER_PORT, a Slurm job's scheduler listens
# on SLURM_BASE_PORT + SLURM_JOB_ID % _SLURM_PORT_SPAN.
SLURM_BASE_PORT = 20000
_SLURM_PORT_SPAN = 10000
# The cluster-size variables `splitrun join --workers/--servers` set (the same
# names `env.ENV` gives them; not imported, `env` imports this module).
_NUM_WORKERS = "SPLITRUN_NUM_WORKERS"
_NUM_SERVERS = "SPLITRUN_NUM_SERVERS"


class IdentitySource(enum.Enum):
    TORCHRUN = "torchrun"
    SLURM = "slurm"


@dataclass(frozen=True, slots=True)
class ForeignIdentity:
    """Who this process is, as Slurm or torchrun numbered it."""

    source: IdentitySource
    task: int            # 0 .. num_tasks - 1 (RANK or SLURM_PROCID)
    num_tasks: int       # WORLD_SIZE or SLURM_NTASKS
    local_rank: int      # among the job's processes on this machine (the GPU to use)
    scheduler: str       # HOST:PORT of the scheduler task 0 hosts
    label: Label
    cluster: Cluster

    @property
    def hosts_scheduler(self) -> bool:
        return self.task == 0

    @property
    def scheduler_port(self) -> int:
        return int(self.scheduler.rsplit(":", 1)[1])

    def describe(self) -> str:
        return (f"{self.source.value} task {self.task} of {self.num_tasks} "
                f"({self.label.describe()}, local rank {self.local_rank})")


def foreign_identity(environ: Mapping[str, str]) -> ForeignIdentity | None:
    """This process's identity from torchrun's or Slurm's variables, or None
    when neither started it. Inconsistent variables raise a `ClusterError`
    that names them."""
    if _has(environ, "RANK") and _has(environ, "WORLD_SIZE"):
        source, task_key, size_key, local_key = (IdentitySource.TORCHRUN, "RANK", "WORLD_SIZE",
                                                 "LOCAL_RANK")
    elif _has(environ, "SLURM_PROCID") and _has(environ, "SLURM_NTASKS"):
        source, task_key, size_key, local_key = (IdentitySource.SLURM, "SLURM_PROCID",
                                                 "SLURM_NTASKS", "SLURM_LOCALID")
    else:
        return None
    task, num_tasks = _int(environ, task_key), _int(environ, size_key)
    if num_tasks < 1 or not 0 <= task < num_tasks:
        raise ClusterError(f"{task_key}={task} and {size_key}={num_tasks}: expected "
                           f"0 <= {task_key} < {size_key}")
    local_rank = _int(environ, local_key) if _has(environ, local_key) else 0
    cluster = _cluster(environ, num_tasks, size_key)
    return ForeignIdentity(source, task, num_tasks, local_rank,
                           _scheduler_address(environ, source), label_of_task(task, cluster),
                           cluster)


def label_of_task(task: int, cluster: Cluster) -> Label:
    """Tasks 0..W-1 are the workers, the next S the servers."""
    if task < cluster.num_workers:
        return Label.worker(task)
    return Label.server(task - cluster.num_workers)


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list: `node[03-05,9],gpu1` -> `node03`."""
    text = nodelist.strip()
    match = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?", text)
    if not text or match is None or not (match.group(1) or match.group(2)):
        raise ClusterError(f"cannot read a host from the Slurm node list {nodelist!r}")
    prefix, ranges = match.group(1), match.group(2)
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first  # zero padding is kept: node[01-04] -> node01


def _cluster(environ: Mapping[str, str], num_tasks: int, size_key: str) -> Cluster:
    num_servers = _int(environ, _NUM_SERVERS) if _has(environ, _NUM_SERVERS) else 0
    num_workers = (_int(environ, _NUM_WORKERS) if _has(environ, _NUM_WORKERS)
                   else num_tasks - num_servers)
    if num_workers < 1 or num_servers < 0 or num_workers + num_servers != num_tasks:
        raise ClusterError(
            f"{size_key}={num_tasks} tasks, but the job wants {num_workers} "
            f"worker{'' if num_workers == 1 else 's'} and {num_servers} "
            f"server{'' if num_servers == 1 else 's'} ({_NUM_WORKERS}/{_NUM_SERVERS}, from "
            f"splitrun join --workers/--servers): start {num_workers + num_servers} tasks, or "
            f"change --workers/--servers so they add up to {num_tasks} (at least 1 worker)")
    return Cluster(num_workers, num_servers)


def _scheduler_address(environ: Mapping[str, str], source: IdentitySource) -> str:
    if _has(environ, "MASTER_ADDR"):
        host = environ["MASTER_ADDR"].strip()
    elif source is IdentitySource.SLURM and (_has(environ, "SLURM_STEP_NODELIST")
                                             or _has(environ, "SLURM_JOB_NODELIST")):
        host = first_host(environ.get("SLURM_STEP_NODELIST") or environ["SLURM_JOB_NODELIST"])
    else:
        raise ClusterError(
            f"no scheduler host: set MASTER_ADDR to the host of task 0 (under "
            f"{source.value}), or give the scheduler's address (splitrun join --scheduler "
            f"HOST:PORT)")
    if _has(environ, SCHEDULER_PORT_VARIABLE):
        port = _int(environ, SCHEDULER_PORT_VARIABLE)
    elif _has(environ, "MASTER_PORT"):
        port = _int(environ, "MASTER_PORT") + 1
    elif _has(environ, "SLURM_JOB_ID"):
        port = SLURM_BASE_PORT + _int(environ, "SLURM_JOB_ID") % _SLURM_PORT_SPAN
    else:
        raise ClusterError(f"no scheduler port: set {SCHEDULER_PORT_VARIABLE} (or "
                           f"MASTER_PORT; the scheduler then listens on MASTER_PORT + 1)")
    if not 0 < port < 65536:
        raise ClusterError(f"the scheduler port {port} (from {SCHEDULER_PORT_VARIABLE}, "
                           f"MASTER_PORT + 1 or SLURM_JOB_ID) is not a TCP port")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _has(environ: Mapping[str, str], key: str) -> bool:
    return environ.get(key, "").strip() != ""


def _int(environ: Mapping[str, str], key: str) -> int:
    text = environ[key].strip()
    try:
        return int(text)
    except ValueError:
        raise ClusterError(f"{key}={text!r} is not an integer") from None
