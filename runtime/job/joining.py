"""What a process decides for itself when it joins a job: its device, the
address its peers reach it by, and (task 0 of an srun or torchrun job)
whether it hosts the job's scheduler."""

from __future__ import annotations

import atexit
import logging
import socket

import torch

from ..cluster.env import ENV, ProcessEnvironment
from ..cluster.hosted import HostedScheduler
from ..errors import ClusterError
from ..rpc.tls import is_loopback
from .settings import JobSettings

__all__ = ["pick_device", "advertised_host", "host_scheduler"]

logger = logging.getLogger(__name__)

# Hosts that bind every interface: a peer cannot connect to them.
_WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "[::]"})


def advertised_host(env: ProcessEnvironment) -> str:
    """The name peers reach this process by: --advertise, else --host, unless
    that binds every interface (0.0.0.0); then this machine's address on the
    route to the scheduler, which peers on the scheduler's network can reach."""
    if env.advertise not in _WILDCARD_HOSTS:
        return env.advertise
    host, _, port = env.scheduler.rpartition(":")
    host = host.strip("[]")
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((host, int(port)))  # picks the route; sends nothing
            address = probe.getsockname()[0]
    except (OSError, ValueError) as exc:
        raise ClusterError(
            f"this process's tensor server binds {env.host}, which peers cannot connect "
            f"to, and no route to the scheduler {env.scheduler} gave an address to "
            f"advertise instead ({exc}); pass --advertise NAME (splitrun join) or "
            f"{ENV.ADVERTISE}") from None
    logger.info("binding %s; advertising %s (this host's address towards the scheduler)",
                env.host, address)
    return f"[{address}]" if ":" in address else address


def pick_device(text: str, local_rank: int = 0) -> torch.device:
    """The device of a process whose local rank (its index among the job's
    processes on this machine) is `local_rank`. `auto`: CUDA where there is a
    device, else the CPU. CUDA without an index means the GPU of the local
    rank, `cuda:(local_rank % visible devices)`, so the processes on one machine
    spread over its GPUs instead of all sharing `cuda:0`. Under `srun` or
    `torchrun` each process sees every GPU of its node and picks its own this
    way; a launcher that gives each process one GPU (`CUDA_VISIBLE_DEVICES`)
    leaves one to pick."""
    if text in ("", "auto"):
        text = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(text)
    except RuntimeError:
        raise ClusterError(f"{ENV.DEVICE}={text!r} is not a device; use cpu, cuda, "
                           f"cuda:N or auto") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ClusterError(f"{ENV.DEVICE}={text} but this machine has no CUDA device; "
                           f"launch with --device cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
    return device


def host_scheduler(env: ProcessEnvironment, settings: JobSettings) -> HostedScheduler | None:
    """Task 0 of a job started by srun or torchrun (no scheduler named): start
    the job's scheduler in this process, where every task will look for it."""
    identity = env.identity
    if identity is None:
        return None
    # No splitrun launcher checked this process's bind (`splitrun join` did, and
    # passes --insecure on): off loopback, TLS or an explicit opt-out.
    if env.tls is None and not env.is_insecure and not is_loopback(env.host):
        raise ClusterError(
            f"{identity.describe()} would listen on {env.host} ({ENV.HOST}) without TLS: "
            f"tensors and the job's token would cross the network unencrypted; give "
            f"{ENV.TLS_CERT}, {ENV.TLS_KEY} and {ENV.TLS_CA} (splitrun join --tls-cert, "
            f"--tls-key, --tls-ca), or set {ENV.INSECURE}=1 (--insecure) on a network "
            f"you trust")
    if not identity.hosts_scheduler:
        return None
    if not env.token:
        raise ClusterError(
            f"{identity.describe()} hosts the job's scheduler, which needs the job's token: "
            f"set {ENV.TOKEN} to the same secret in every task (export "
            f"{ENV.TOKEN}=$(openssl rand -hex 16) before srun or torchrun), or pass "
            f"--token-file to splitrun join")
    hosted = HostedScheduler(identity.cluster, env.token,
                             heartbeat_timeout_s=settings.heartbeat_timeout_s)
    try:
        hosted.start(env.host, identity.scheduler_port, env.tls)
    except ClusterError as exc:
        raise ClusterError(f"{identity.describe()}: {exc} (every task derives the port from "
                           f"{ENV.SCHEDULER_PORT}, MASTER_PORT + 1 or SLURM_JOB_ID; set "
                           f"{ENV.SCHEDULER_PORT} to a free one)") from None
    # A failure keeps it up until the peers heard (Job.report_failure); a clean
    # exit closes it in Job.close. Any other exit stops it here, at once.
    atexit.register(hosted.close, 0.0)
    logger.info("%s: hosting the scheduler at %s", identity.describe(), env.scheduler)
    return hosted
