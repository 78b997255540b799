"""Where the members of a parallel group meet to form a torch.distributed process group.

A rendezvous hands each member a `torch.distributed.Store` shared by its
group. Through the job's scheduler (`SchedulerRendezvous`): the group's first
member binds a socket on its advertised host (port 0), serves a `TCPStore`
on it and publishes `host:port` under a key of the scheduler's key-value
store that names the job's incarnation and the group; the others read the key
(with a deadline) and connect. Threads of one process (`run_threaded`) share
an in-process `HashStore` per group instead (`InProcessRendezvous`).
"""

from __future__ import annotations

import datetime
import logging
import socket
import threading
from typing import Protocol

import torch.distributed as dist

from ..errors import ClusterError
from .membership import SchedulerClient

__all__ = ["Rendezvous", "SchedulerRendezvous", "InProcessRendezvous", "KV_PREFIX"]

logger = logging.getLogger(__name__)

# Keys of the scheduler's key-value store this module writes.
KV_PREFIX = "splitrun/process-group"


class Rendezvous(Protocol):
    host: str         # the address this process's collective sockets bind to
    timeout_s: float  # bounds forming the group: every member must arrive within it

    def store(self, group: str, position: int, size: int) -> dist.Store:
        """The store `size` members of `group` share; `position` 0 serves it."""


class SchedulerRendezvous:
    """Members of one job meet through its scheduler (`kv_put` / `kv_get`)."""

    def __init__(self, client: SchedulerClient, incarnation: int, host: str,
                 timeout_s: float) -> None:
        self.client = client
        self.incarnation = incarnation
        self.host = host.strip("[]")
        self.timeout_s = timeout_s

    def _key(self, group: str) -> str:
        return f"{KV_PREFIX}/{self.incarnation}/{group}"

    def store(self, group: str, position: int, size: int) -> dist.Store:
        timeout = datetime.timedelta(seconds=self.timeout_s)
        key = self._key(group)
        if position == 0:
            family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
            listener = socket.create_server((self.host, 0), family=family, backlog=size + 8)
            port = listener.getsockname()[1]
            # The store takes the bound socket over: it serves on this host only.
            store = dist.TCPStore(self.host, port, size, True, timeout, wait_for_workers=False,
                                  master_listen_fd=listener.detach())
            address = f"[{self.host}]:{port}" if family == socket.AF_INET6 else \
                f"{self.host}:{port}"
            self.client.kv_put(key, address.encode())
            logger.debug("process group %s: store served at %s", group, address)
        else:
            try:
                address = self.client.kv_get(key, self.timeout_s).decode()
            except ClusterError as exc:
                raise ClusterError(
                    f"process group {group}: its first member did not publish its store "
                    f"within {self.timeout_s:g} s ({exc}); did it start, and does it run "
                    f"the same script?") from None
            host, _, port = address.rpartition(":")
            try:
                store = dist.TCPStore(host.strip("[]"), int(port), size, False, timeout)
            except (RuntimeError, ValueError) as exc:
                raise ClusterError(
                    f"process group {group}: cannot connect to its store at {address} "
                    f"within {self.timeout_s:g} s: {exc}") from None
        return dist.PrefixStore(f"{group}/", store)


class InProcessRendezvous:
    """Members that are threads of this process: one `HashStore` per group."""

    host = "127.0.0.1"

    def __init__(self, timeout_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        self._stores: dict[str, dist.Store] = {}
        self._lock = threading.Lock()

    def store(self, group: str, position: int, size: int) -> dist.Store:
        with self._lock:
            store = self._stores.get(group)
            if store is None:
                store = self._stores[group] = dist.HashStore()
                store.set_timeout(datetime.timedelta(seconds=self.timeout_s))
        return dist.PrefixStore(f"{group}/", store)
