"""A 1 GiB tensor through the shared-memory ring between two real processes:
this test process at one end, tests/support/scripts/ring_peer.py at the other
(the ring's other promises: tests/runtime/transport/test_shm_ring.py)."""

import os

import pytest
import torch
from ring_ends import RECV_S, START_S, attach, producer

from splitrun.runtime.transport.shm.ring import SHM_DIR, new_job_prefix, remove_job_segments


@pytest.fixture
def prefix():
    prefix = new_job_prefix()
    yield prefix
    left = [name for name in os.listdir(SHM_DIR) if name.startswith(prefix)]
    remove_job_segments(prefix)
    assert not left, f"files of the job left in {SHM_DIR}: {left}"


@pytest.mark.xdist_group("one_gib")  # one at a time under pytest-xdist
def test_a_1_gib_tensor(prefix):
    numel = (1 << 30) // 4
    proc = producer(prefix, 64 << 20, "int32", numel)
    try:
        reader = attach(prefix)
        header, size = reader.recv_header(RECV_S)
        assert (header, size) == (b"int32", 1 << 30)
        received = torch.empty(numel, dtype=torch.int32)
        reader.recv_payload_into_tensor(received, RECV_S)
        reader.close()
        step = 1 << 24
        for start in range(0, numel, step):  # every element at its place
            expected = torch.arange(start, min(start + step, numel), dtype=torch.int32)
            assert torch.equal(received[start:start + step], expected), f"differs at {start}"
        assert proc.wait(START_S) == 0, proc.output()
    finally:
        proc.kill()
