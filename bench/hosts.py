"""Two simulated hosts on one machine: two network namespaces joined by a veth
pair whose rate is limited with `tc qdisc ... tbf`, for benches and tests that
need a job split across "machines" with a real (shaped) network between them.

    from hosts import two_hosts

    with two_hosts(rate_mbit=1000) as hosts:
        scheduler = hosts.a.popen([sys.executable, "-m", "splitrun.launcher",
                                   "scheduler", "--host", hosts.a.address, ...])
        hosts.b.run(["ip", "addr"])
    # on exit (also after an exception): every process started through
    # `hosts` is killed by its pid, then the namespaces (and with them the
    # veth pair) are removed.

Each end's egress is shaped with a token bucket (`tbf`) at the same rate, so
the link is symmetric. Each host also gets its own /dev/shm (a directory under
the machine's, bind-mounted over /dev/shm for every process started through
it): processes on one simulated host can share memory, processes on the two
hosts cannot, as on two machines. `netem` (delay, loss) is not used: not every kernel
has it; `tbf` is in every one we run on.

Needs root (CAP_NET_ADMIN); `require_root()` raises `HostsError` saying so.
Names carry a fixed prefix and the creating process's pid
(`splitrun-hosts-<pid>-<hex>-a`), so `remove_stale()` removes what a killed
earlier run left behind without touching a concurrent run's namespaces.

    python bench/hosts.py [--rate-mbit N]   # smoke run: prints the link as JSON
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

__all__ = ["HostsError", "Host", "TwoHosts", "two_hosts", "require_root", "remove_stale",
           "NAMESPACE_PREFIX"]

logger = logging.getLogger(__name__)

# Every namespace this module creates starts with this; followed by the pid of
# the creating process, so stale ones (creator gone) can be told apart.
NAMESPACE_PREFIX = "splitrun-hosts-"
# veth names: at most 15 characters (IFNAMSIZ - 1).
_VETH_PREFIX = "srh"
# Bounds one `ip`/`tc` command (they return in milliseconds).
_COMMAND_TIMEOUT_S = 30.0
# Bounds the wait for a killed process to be reaped.
_REAP_TIMEOUT_S = 10.0
# Bounds the wait for a process to end by itself at exit before it is killed.
_STOP_GRACE_S = 3.0
# Subnets are drawn from here (a /30 each); namespaced, so they cannot clash with
# the machine's own routes, but one that the root namespace uses is avoided anyway.
_POOL = ipaddress.ip_network("10.200.0.0/14")
_SHM_ROOT = "/dev/shm"
_NAME_PATTERN = re.compile(rf"^{re.escape(NAMESPACE_PREFIX)}(\d+)-[0-9a-f]+-[ab]$")


class HostsError(RuntimeError):
    """The two-host harness could not be set up (or torn down)."""


def require_root() -> None:
    """Raise `HostsError` unless this process may create network namespaces."""
    if os.geteuid() != 0:
        raise HostsError(
            f"the two-host harness needs root (network namespaces, veth, tc); this process "
            f"runs as uid {os.geteuid()}. Run the tests that use it as root (CI does), "
            f"e.g. `sudo .venv/bin/python -m pytest tests/bench/test_hosts.py "
            f"tests/e2e/test_hosts_e2e.py`")
    for tool in ("ip", "tc"):
        if not any(os.access(os.path.join(d, tool), os.X_OK)
                   for d in os.environ.get("PATH", "/usr/sbin:/sbin").split(os.pathsep)
                   + ["/usr/sbin", "/sbin"]):
            raise HostsError(f"the two-host harness needs `{tool}` (iproute2) on PATH")


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(list(argv), capture_output=True, text=True,
                            timeout=_COMMAND_TIMEOUT_S, stdin=subprocess.DEVNULL)
    if check and result.returncode != 0:
        raise HostsError(f"`{' '.join(argv)}` failed ({result.returncode}): "
                         f"{(result.stderr or result.stdout).strip()}")
    return result


def list_namespaces() -> list[str]:
    """Names of the machine's network namespaces (`ip netns list`)."""
    out = _run(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace_processes(namespace: str) -> list[int]:
    """SIGKILL every process inside `namespace` (all of them were started in it
    by this module's user); returns their pids."""
    result = _run(["ip", "netns", "pids", namespace], check=False)
    pids = [int(p) for p in result.stdout.split() if p.isdigit()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


def _delete_namespace(namespace: str) -> None:
    _kill_namespace_processes(namespace)
    _run(["ip", "netns", "delete", namespace], check=False)
    shutil.rmtree(_shm_dir_of(namespace), ignore_errors=True)


def _shm_dir_of(namespace: str) -> str:
    return os.path.join(_SHM_ROOT, namespace)


def remove_stale() -> list[str]:
    """Remove namespaces of earlier runs whose creating process is gone (a run
    that was SIGKILLed could not clean up). Best effort; returns what it removed."""
    removed = []
    for namespace in list_namespaces():
        match = _NAME_PATTERN.match(namespace)
        if match and not _pid_alive(int(match.group(1))):
            _delete_namespace(namespace)
            removed.append(namespace)
    for entry in os.listdir(_SHM_ROOT) if os.path.isdir(_SHM_ROOT) else []:
        match = _NAME_PATTERN.match(entry)
        if match and not _pid_alive(int(match.group(1))):
            shutil.rmtree(os.path.join(_SHM_ROOT, entry), ignore_errors=True)
            removed.append(os.path.join(_SHM_ROOT, entry))
    if removed:
        logger.warning("removed stale namespaces of dead runs: %s", ", ".join(removed))
    return removed


def _used_networks() -> list[ipaddress.IPv4Network]:
    out = _run(["ip", "-4", "-o", "addr", "show"], check=False).stdout
    nets = []
    for cidr in re.findall(r"inet (\d+\.\d+\.\d+\.\d+/\d+)", out):
        nets.append(ipaddress.ip_interface(cidr).network)
    return nets


def _pick_subnet() -> ipaddress.IPv4Network:
    used = _used_networks()
    subnets = _POOL.num_addresses // 4
    for _ in range(64):
        index = secrets.randbelow(subnets)
        candidate = ipaddress.ip_network(f"{_POOL.network_address + 4 * index}/30")
        if not any(candidate.overlaps(net) for net in used):
            return candidate
    raise HostsError(f"no free /30 in {_POOL} after 64 draws")


@dataclass(eq=False)  # a host is itself: compared and hashed by identity
class Host:
    """One simulated host: a network namespace with one address on the link."""

    namespace: str
    device: str
    address: str
    # This host's /dev/shm (None: the machine's, shared with the other host).
    shm_dir: str | None = None
    _procs: list[subprocess.Popen] = field(default_factory=list, repr=False)

    def argv(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside this host's namespace, with this host's /dev/shm
        (`ip netns exec` and the `sh` in between exec it, so the pid is the
        command's own; the bind mount is private to the command's mount namespace)."""
        argv = [str(arg) for arg in argv]
        if self.shm_dir is None:
            return ["ip", "netns", "exec", self.namespace, *argv]
        return ["ip", "netns", "exec", self.namespace, "sh", "-c",
                'mount --bind "$0" /dev/shm && exec "$@"', self.shm_dir, *argv]

    def run(self, argv: Sequence[str], timeout_s: float = _COMMAND_TIMEOUT_S,
            check: bool = True) -> subprocess.CompletedProcess:
        """Run `argv` inside the namespace to completion; its output as text."""
        result = subprocess.run(self.argv(argv), capture_output=True, text=True,
                                timeout=timeout_s, stdin=subprocess.DEVNULL)
        if check and result.returncode != 0:
            raise HostsError(f"[{self.namespace}] `{' '.join(map(str, argv))}` failed "
                             f"({result.returncode}): {(result.stderr or result.stdout).strip()}")
        return result

    def popen(self, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start `argv` inside the namespace, in a new session; it is killed
        (by its process group) when the `two_hosts` block ends."""
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        kwargs.setdefault("start_new_session", True)
        process = subprocess.Popen(self.argv(argv), **kwargs)
        self._procs.append(process)
        return process

    def adopt(self, process: subprocess.Popen) -> None:
        """Track a process started elsewhere with `argv()`: killed at exit too."""
        self._procs.append(process)

    def qdisc(self) -> str:
        """`tc qdisc show` of this host's end of the link."""
        return self.run(["tc", "qdisc", "show", "dev", self.device]).stdout

    def _stop_processes(self) -> None:
        deadline = time.monotonic() + _STOP_GRACE_S
        for process in self._procs:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGTERM)
        for process in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(deadline - time.monotonic(), 0.01))
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=_REAP_TIMEOUT_S)


@dataclass
class TwoHosts:
    """Host `a` and host `b`, joined by a link of `rate_mbit` each way."""

    a: Host
    b: Host
    rate_mbit: float | None  # None: unshaped (the veth's own speed)
    subnet: str

    @property
    def hosts(self) -> tuple[Host, Host]:
        return self.a, self.b

    def describe(self) -> dict:
        return {"a": {"namespace": self.a.namespace, "address": self.a.address,
                      "shm_dir": self.a.shm_dir},
                "b": {"namespace": self.b.namespace, "address": self.b.address,
                      "shm_dir": self.b.shm_dir},
                "rate_mbit": self.rate_mbit, "subnet": self.subnet}


def _tbf_args(rate_mbit: float) -> list[str]:
    rate_bytes_s = rate_mbit * 1e6 / 8
    # The bucket must hold at least one timer tick's worth of tokens (or the rate
    # is not reached) and one 64 KiB GSO segment; 4 ms of traffic does both at
    # 1-10 Gbit/s and keeps bursts short at low rates.
    burst = max(int(rate_bytes_s * 0.004), 128 << 10)
    # Queue up to 50 ms of traffic before dropping (TCP then backs off).
    limit = max(int(rate_bytes_s * 0.05), 2 * burst)
    return ["tbf", "rate", f"{int(rate_mbit * 1000)}kbit", "burst", str(burst),
            "limit", str(limit)]


@contextlib.contextmanager
def two_hosts(rate_mbit: float | None = 1000.0, *, mtu: int = 1500,
              private_shm: bool = True) -> Iterator[TwoHosts]:
    """Create the two hosts, yield them, and remove them (processes first) at
    exit, whatever happens inside the block. `private_shm`: each host gets its
    own /dev/shm (as two machines have)."""
    require_root()
    if rate_mbit is not None and rate_mbit <= 0:
        raise HostsError(f"rate_mbit must be positive, got {rate_mbit}")
    remove_stale()
    tag = f"{os.getpid()}-{secrets.token_hex(3)}"
    subnet = _pick_subnet()
    first, second = list(subnet.hosts())
    veth = f"{_VETH_PREFIX}{secrets.token_hex(4)}"  # 11 characters, + a/b
    names = (f"{NAMESPACE_PREFIX}{tag}-a", f"{NAMESPACE_PREFIX}{tag}-b")
    shm_dirs = [_shm_dir_of(name) if private_shm else None for name in names]
    hosts = TwoHosts(
        a=Host(names[0], f"{veth}a", str(first), shm_dirs[0]),
        b=Host(names[1], f"{veth}b", str(second), shm_dirs[1]),
        rate_mbit=rate_mbit, subnet=str(subnet))
    created: list[str] = []
    try:
        for host in hosts.hosts:
            _run(["ip", "netns", "add", host.namespace])
            created.append(host.namespace)
            if host.shm_dir is not None:
                os.mkdir(host.shm_dir, 0o1777)
                os.chmod(host.shm_dir, 0o1777)  # like /dev/shm itself
        _run(["ip", "link", "add", hosts.a.device, "mtu", str(mtu), "type", "veth",
              "peer", "name", hosts.b.device, "mtu", str(mtu)])
        for host in hosts.hosts:
            _run(["ip", "link", "set", host.device, "netns", host.namespace])
            _run(["ip", "-n", host.namespace, "addr", "add", f"{host.address}/30",
                  "dev", host.device])
            _run(["ip", "-n", host.namespace, "link", "set", "lo", "up"])
            _run(["ip", "-n", host.namespace, "link", "set", host.device, "up"])
            if rate_mbit is not None:
                host.run(["tc", "qdisc", "add", "dev", host.device, "root",
                          *_tbf_args(rate_mbit)])
        logger.info("two hosts: %s", json.dumps(hosts.describe()))
        yield hosts
    finally:
        for host in hosts.hosts:
            host._stop_processes()
        for namespace in created:
            _delete_namespace(namespace)
        # A veth end still in the root namespace (failure between add and set
        # netns) is not removed with the namespaces.
        for host in hosts.hosts:
            if _run(["ip", "link", "show", host.device], check=False).returncode == 0:
                _run(["ip", "link", "delete", host.device], check=False)


def _main() -> int:
    import argparse
    parser = argparse.ArgumentParser(description="Set up two hosts, show the link, remove it.")
    parser.add_argument("--rate-mbit", type=float, default=1000.0)
    args = parser.parse_args()
    with two_hosts(args.rate_mbit) as hosts:
        info = hosts.describe()
        info["qdisc_a"] = hosts.a.qdisc().strip()
        info["qdisc_b"] = hosts.b.qdisc().strip()
    info["left_after_exit"] = [n for n in list_namespaces()
                               if n in (hosts.a.namespace, hosts.b.namespace)]
    print(json.dumps(info, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
