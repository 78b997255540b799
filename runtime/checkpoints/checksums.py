"""The checksums of a sharded checkpoint directory (`sharded/`): worker 0
writes `checksums.sha256` last, in `sha256sum -c` format, listing every file
of the directory; a file is good while its sha256 is the one listed. The
standard library only: the launcher finds a restart's checkpoint with it
(`periodic.latest_checkpoint`) without importing torch."""

from __future__ import annotations

import hashlib
import os

from ..errors import CheckpointError

__all__ = ["CHECKSUMS", "file_sha256", "read_sums", "verify_file", "verify_all"]

CHECKSUMS = "checksums.sha256"
_CHUNK = 1 << 20


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as data:
        for chunk in iter(lambda: data.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_sums(directory: str) -> dict[str, str]:
    """File name -> sha256 as `directory`'s checksums file lists them."""
    where = f"checkpoint {directory}"
    try:
        with open(os.path.join(directory, CHECKSUMS)) as lines:
            pairs = [line.split() for line in lines if line.strip()]
    except OSError:
        raise CheckpointError(
            f"{where} has no {CHECKSUMS}: the save did not complete (worker 0 "
            f"writes it last), or this is not a splitrun checkpoint") from None
    if not pairs or any(len(p) != 2 for p in pairs):
        raise CheckpointError(f"{where}: {CHECKSUMS} is malformed")
    return {name: digest.lower() for digest, name in pairs}


def verify_file(directory: str, name: str, sums: dict[str, str]) -> None:
    """`directory`/`name` is listed in `sums`, present, and has its sha256."""
    where = f"checkpoint {directory}"
    path = os.path.join(directory, name)
    if name not in sums:
        raise CheckpointError(f"{where}: {name} is not listed in {CHECKSUMS}")
    if not os.path.exists(path):
        raise CheckpointError(
            f"{where}: {name} is missing (written by another process; gather "
            f"every process's files into this directory before resuming)")
    actual = file_sha256(path)
    if actual != sums[name]:
        raise CheckpointError(
            f"{where}: {name} is corrupt: its sha256 is {actual[:16]}..., "
            f"{CHECKSUMS} says {sums[name][:16]}...; the file changed after it "
            f"was written")


def verify_all(directory: str) -> None:
    """Every file `directory`'s checksums list is there, unchanged."""
    sums = read_sums(directory)
    for name in sums:
        verify_file(directory, name, sums)
