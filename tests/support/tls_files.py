"""Throwaway TLS files for tests: a CA and a certificate it signed for
127.0.0.1 and localhost, made with the openssl command."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class Files:
    cert: pathlib.Path
    key: pathlib.Path
    ca: pathlib.Path

    def args(self) -> list[str]:
        return ["--tls-cert", str(self.cert), "--tls-key", str(self.key), "--tls-ca", str(self.ca)]


def have_openssl() -> bool:
    return shutil.which("openssl") is not None


def make(directory: pathlib.Path, name: str = "job") -> Files:
    """A fresh CA and a certificate for 127.0.0.1 and localhost, signed by it."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca = directory / f"{name}-ca.key", directory / f"{name}-ca.pem"
    key, csr, cert = directory / f"{name}.key", directory / f"{name}.csr", directory / f"{name}.pem"
    ext = directory / f"{name}.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")

    def run(*args):
        subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=60)
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca,
        "-days", "1", "-subj", f"/CN={name} test CA")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr,
        "-subj", "/CN=localhost")
    run("x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
        "-out", cert, "-days", "1", "-extfile", ext)
    return Files(cert, key, ca)
