"""TLS for splitrun's gRPC servers (tensor service, scheduler) and their
clients, and the rule that an address off loopback needs it.

    tls = TlsFiles(cert="node.pem", key="node.key", ca="ca.pem")
    server.add_secure_port(address, tls.server_credentials())
    grpc.secure_channel(address, tls.channel_credentials())

Every process of a job gets the same three files: its certificate and key (the
server side) and the CA that signed the certificates (the client side checks
the server against it). The job's token still authenticates every call.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

import grpc

from ..errors import ClusterError

__all__ = ["TlsFiles", "is_loopback", "check_bind"]


@dataclass(frozen=True)
class TlsFiles:
    cert: str
    key: str
    ca: str

    @classmethod
    def from_paths(cls, cert: str | None, key: str | None, ca: str | None
                   ) -> TlsFiles | None:
        """None when no file is given; all three, or a `ClusterError`."""
        given = {"--tls-cert": cert, "--tls-key": key, "--tls-ca": ca}
        if not any(given.values()):
            return None
        missing = [flag for flag, path in given.items() if not path]
        if missing:
            raise ClusterError(f"TLS needs --tls-cert, --tls-key and --tls-ca; missing "
                               f"{', '.join(missing)}")
        files = cls(cert, key, ca)
        for flag, path in given.items():
            _read(path, flag)
        return files

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(_read(self.key, "--tls-key"), _read(self.cert, "--tls-cert"))])

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=_read(self.ca, "--tls-ca"))


def _read(path: str, flag: str) -> bytes:
    try:
        with open(path, "rb") as data:
            return data.read()
    except OSError as exc:
        raise ClusterError(f"{flag} {path}: cannot read it: {exc.strerror}") from None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve anywhere


def check_bind(host: str, tls: TlsFiles | None, insecure: bool, what: str) -> None:
    """Refuse to serve unencrypted off loopback unless the user said so."""
    if tls is None and not insecure and not is_loopback(host):
        raise ClusterError(
            f"{what} would listen on {host} without TLS: traffic (tensors, the job's "
            f"token) would cross the network unencrypted; pass --tls-cert, --tls-key and "
            f"--tls-ca, or --insecure on a network you trust")
