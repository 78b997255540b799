"""The transport contract's largest message, run against both transports (gRPC,
and shared memory between peers on one host): a 1 GiB tensor crosses from
another process intact. The rest of the contract:
tests/runtime/transport/test_transports.py. Nothing of a job is left under
/dev/shm afterwards.

Every wait is bounded; no sleep synchronises anything; timings decide nothing.
"""

import hashlib

import pytest
import torch
from transport_pairs import (
    BIG_TIMEOUT_S,
    KINDS,
    RECV_TIMEOUT_S,
    W0,
    W1,
    job_files,
    key,
    make,
    start_peer,
)

from splitrun.runtime.transport import ChannelContract
from splitrun.runtime.transport.shm.ring import SHM_DIR, new_job_prefix, remove_job_segments
from splitrun.runtime.transport.shm.transport import ShmSettings


@pytest.fixture
def prefix():
    """A fresh job prefix; the test must leave nothing under it."""
    prefix = new_job_prefix()
    yield prefix
    left = job_files(prefix)
    remove_job_segments(prefix)
    assert left == [], f"files of the job left in {SHM_DIR}: {left}"


@pytest.mark.xdist_group("one_gib")  # one at a time under pytest-xdist
@pytest.mark.parametrize("kind", KINDS)
def test_a_one_gib_tensor_crosses_from_another_process_intact(kind, prefix):
    expected = {"big": ChannelContract(W1, ((torch.int64, (1 << 27,)),)),
                "digest": ChannelContract(W1, ((torch.uint8, (16,)),))}
    receiver = make(kind, W0, prefix, expected, ring=ShmSettings())
    address = receiver.start()
    sender = start_peer(kind, prefix, address, "big")
    try:
        receiver.set_peers({W1: sender.wait_for(r"^address (\S+)", 60).group(1)})
        (big,) = receiver.recv(W1, key(0, "big"), BIG_TIMEOUT_S)
        (digest,) = receiver.recv(W1, key(0, "digest"), RECV_TIMEOUT_S)
        assert sender.wait(BIG_TIMEOUT_S) == 0, sender.output()
        assert big.dtype == torch.int64 and big.shape == (1 << 27,)
        assert hashlib.blake2b(memoryview(big.numpy()), digest_size=16).digest() == \
            bytes(digest.tolist())
    finally:
        sender.kill()
        receiver.close()
