"""Connecting `splitrun launch --backend ray` to a Ray cluster, and whether
that cluster can ever hold the job.

- No `--address` and no `RAY_ADDRESS`: the launcher starts a local Ray for the
  job (`ray.init(address="local")`, never an unrelated cluster found on the
  machine), with as many logical CPUs as the job asks (at least the machine's
  cores) and the custom resources it names: on a 2-core machine the main job
  (3 processes of 1 CPU) fits. Ray turns token authentication on for a new
  local cluster and, without a token, writes one to ~/.ray/auth_token, which
  a later `ray start` then picks up (a cluster that refuses clients without
  it). The launcher gives the cluster a token of its own through the
  environment instead, and removes it when the job ends: nothing is left in
  the home folder.
- An existing cluster (`--address`, `RAY_ADDRESS`): connected as is; an
  authentication failure is named with its fix.
- `check_fits`: the bundles the job asks, against the resources of the
  cluster's live nodes. A bundle no node can hold, or more of a resource than
  the whole cluster has, is refused at once with the option that fixes it,
  instead of waiting for a placement that cannot come.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import secrets
from collections.abc import Iterator, Mapping

from splitrun.runtime.errors import ClusterError
from splitrun.splitter.labels import Role

__all__ = ["connect", "check_fits", "RayBackendError", "is_auth_failure", "first_line",
           "local_resources"]

logger = logging.getLogger(__name__)

_AUTH_MODE = "RAY_AUTH_MODE"
_TOKEN = "RAY_AUTH_TOKEN"
_TOKEN_PATH = "RAY_AUTH_TOKEN_PATH"
# What Ray's refusals of a token say (its AuthenticationError, gRPC's status).
_AUTH_WORDS = ("invalidauthtoken", "authentication", "unauthenticated", "auth token")
_OPTION = {Role.WORKER: "--worker-resources", Role.SERVER: "--server-resources"}
# Bounds the one call that asks a GCS whether it refuses this process's token.
_PROBE_TIMEOUT_S = 10.0


class RayBackendError(ClusterError):
    """The Ray backend cannot run the job as asked (no Ray, bad resources, a
    cluster that cannot place it)."""


def is_auth_failure(exc: BaseException) -> bool:
    text = f"{type(exc).__name__} {exc}".lower()
    return any(word in text for word in _AUTH_WORDS)


def first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def local_resources(bundles: list[dict[str, float]]) -> dict:
    """`ray.init` options for a local cluster that holds `bundles`: logical
    CPUs for every bundle (the machine's cores at least; a process computes
    with the threads its CPU amount says, not with more cores), and the custom
    resources they name. GPUs and memory are the machine's: a bundle asking
    more is refused by `check_fits`."""
    cpus = math.ceil(sum(bundle.get("CPU", 0.0) for bundle in bundles))
    custom: dict[str, float] = {}
    for bundle in bundles:
        for name, amount in bundle.items():
            if name not in ("CPU", "GPU", "memory"):
                custom[name] = custom.get(name, 0.0) + amount
    options = {"num_cpus": max(os.cpu_count() or 1, cpus)}
    if custom:
        options["resources"] = custom
    return options


@contextlib.contextmanager
def _own_token() -> Iterator[None]:
    """A token for the local cluster, in this process's environment (which
    the cluster's processes inherit) while it runs, unless the user chose
    (RAY_AUTH_MODE, a token of their own): Ray then writes none to the home
    folder."""
    chosen = any(os.environ.get(name) for name in (_AUTH_MODE, _TOKEN, _TOKEN_PATH))
    if not chosen:
        os.environ[_TOKEN] = secrets.token_hex(32)
    try:
        yield
    finally:
        if not chosen:
            os.environ.pop(_TOKEN, None)
            os.environ.pop(_AUTH_MODE, None)  # ray.init set it to "token"


@contextlib.contextmanager
def connect(ray, address: str | None, bundles: list[dict[str, float]],
            logging_level: int) -> Iterator[str]:
    """Connect to the cluster at `address` (or $RAY_ADDRESS), or start a local
    one sized to `bundles`; yields what it connected to, for messages.
    Disconnects (ending a local cluster) on exit. Raises RayBackendError
    naming the problem and its fix when Ray refuses."""
    existing = address or os.environ.get("RAY_ADDRESS")
    where = existing or "a new local cluster"
    token = contextlib.nullcontext() if existing else _own_token()
    with token:
        sends_token = os.environ.get(_AUTH_MODE, "").lower() == "token"
        if existing and not sends_token and _refuses_token(existing):  # before Ray retries
            raise RayBackendError(_refusal(where, None, True))
        try:
            if existing:
                ray.init(address=address, log_to_driver=False, logging_level=logging_level)
            else:
                ray.init(address="local", log_to_driver=False, logging_level=logging_level,
                         **local_resources(bundles))
        except Exception as exc:  # noqa: BLE001 - Ray's errors vary; each is named below
            raise RayBackendError(_refusal(where, exc, is_auth_failure(exc))) from None
        try:
            yield where
        finally:
            ray.shutdown()


def _refuses_token(address: str) -> bool:
    """True when the GCS at `address` (HOST:PORT) refuses a call without a
    token, as this process would make it (RAY_AUTH_MODE is not "token").
    ray.init would retry for 20 s and say only "Failed to connect", the
    reason (InvalidAuthToken) in Ray's C++ log; one call answers it at once:
    the GCS checks the token before it reads a request."""
    import grpc

    target = address.removeprefix("ray://")
    if target == "auto" or ":" not in target:
        return False
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_unary("/ray.rpc.NodeInfoGcsService/GetClusterId")
        try:
            call(b"", timeout=_PROBE_TIMEOUT_S)
        except grpc.RpcError as error:
            return error.code() is grpc.StatusCode.UNAUTHENTICATED
    return False


def _refusal(where: str, exc: BaseException | None, refused_token: bool) -> str:
    if refused_token:
        said = "" if exc is None else f"; ray.init: {first_line(exc)}"
        return (f"Ray at {where} refused this launcher's token (InvalidAuthToken{said}): "
                f"the cluster uses token authentication and this process has no token or "
                f"another one. Give it the cluster's token: {_AUTH_MODE}=token with "
                f"{_TOKEN}=... or {_TOKEN_PATH}=FILE (`ray get-auth-token` on the head node "
                f"prints it). A ~/.ray/auth_token left by an earlier local Ray makes `ray "
                f"start` turn token authentication on with that token: remove it (or start "
                f"the cluster with {_AUTH_MODE}=disabled) if that is not what you meant")
    return (f"cannot connect to Ray ({where}): {first_line(exc)}; is a cluster running "
            f"there (`ray start --head`), and is --address HOST:PORT its GCS address?")


def check_fits(nodes: list[Mapping[str, float]], resources: Mapping[Role, dict[str, float]],
               counts: Mapping[Role, int]) -> None:
    """Raise RayBackendError when the cluster whose live nodes offer `nodes`
    (their total resources) can never place the job: a role's bundle that no
    node holds, or more of a resource in all than the cluster has."""
    def fmt(amounts: Mapping[str, float]) -> str:
        return json.dumps({k: (int(v) if float(v).is_integer() else v)
                           for k, v in sorted(amounts.items())})

    for role, bundle in resources.items():
        if not counts.get(role):
            continue
        if not any(all(node.get(k, 0.0) >= v for k, v in bundle.items()) for node in nodes):
            largest = {k: max((node.get(k, 0.0) for node in nodes), default=0.0)
                       for k in bundle}
            raise RayBackendError(
                f"Ray can never place this job: each {role.value} asks {fmt(bundle)} "
                f"({_OPTION[role]}), and no node of the cluster has that much (the most any "
                f"node has: {fmt(largest)}); ask for less with {_OPTION[role]}, or add a node "
                f"that has it")
    needed: dict[str, float] = {}
    for role, bundle in resources.items():
        for name, amount in bundle.items():
            needed[name] = needed.get(name, 0.0) + amount * counts.get(role, 0)
    total = {name: sum(node.get(name, 0.0) for node in nodes) for name in needed}
    short = {name: amount for name, amount in needed.items() if amount > total[name] + 1e-9}
    if short:
        asked = ", ".join(f"{counts[role]} {role.value}{'s' if counts[role] > 1 else ''} x "
                          f"{fmt(resources[role])}" for role in resources if counts.get(role))
        raise RayBackendError(
            f"Ray can never place this job: it asks {fmt(short)} in all ({asked}), and the "
            f"cluster has {fmt({k: total[k] for k in short})}; ask for less per process "
            f"(--worker-resources / --server-resources), run fewer processes, or add nodes")
