"""What a process spends before its first step, kept to what it needs: a
shared-memory ring has its pages mapped as its producer reaches them (not all
of a 64 MiB ring in each of the two processes at the start of every job), and
the template process collects garbage once after its imports, its forked
processes collecting as fresh ones do."""

from __future__ import annotations

import gc
import os

import pytest

from splitrun.launcher.template import collected_once
from splitrun.runtime.transport.shm.ring import (
    RingReader,
    RingSettings,
    RingWriter,
    new_job_prefix,
    remove_job_segments,
)
from splitrun.runtime.transport.shm.ring_segment import POPULATE_AHEAD_BYTES

RING_BYTES = 16 << 20
# Bounds one send or receive between two ends in this process.
RECV_S = 60.0


def mapped_bytes(ring_path: str) -> int:
    """Bytes of the segment `ring_path` (both ends' mappings) that have page
    table entries in this process (Rss in /proc/self/smaps)."""
    total, in_ring = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's first line
                in_ring = len(fields) >= 6 and fields[5] == ring_path
            elif in_ring and fields[0] == "Rss:":
                total += int(fields[1]) << 10
    return total


@pytest.fixture
def ring():
    prefix = new_job_prefix()
    writer = RingWriter(prefix, "w0-s0", owner="worker 0", peer="server 0",
                        settings=RingSettings(capacity_bytes=RING_BYTES))
    reader = RingReader.attach(prefix, "w0-s0", owner="server 0", peer="worker 0")
    try:
        yield writer, reader
    finally:
        writer.close()
        reader.close()
        remove_job_segments(prefix)


def test_a_ring_maps_its_pages_as_the_producer_reaches_them(ring):
    writer, reader = ring
    path = writer.ring_path
    assert mapped_bytes(path) < POPULATE_AHEAD_BYTES, "the rings are mapped whole at the start"
    small = [os.urandom(4096) for _ in range(100)]  # 400 KiB: one chunk ahead
    for index, payload in enumerate(small):
        writer.send(b"s%d" % index, [memoryview(payload)], RECV_S)
        assert reader.recv(RECV_S) == (b"s%d" % index, payload)
    assert 400 << 10 <= mapped_bytes(path) <= 3 * POPULATE_AHEAD_BYTES
    # A large payload: a stream of them soon walks the whole ring, which both
    # ends map at once (their copies then run over mapped pages).
    large = os.urandom(POPULATE_AHEAD_BYTES * 2)
    writer.send(b"large", [memoryview(large)], RECV_S)
    assert reader.recv(RECV_S) == (b"large", large)
    assert mapped_bytes(path) >= 2 * RING_BYTES


def test_the_template_collects_once_after_its_imports_and_forks_collecting():
    collections = []

    def count(phase, info):
        if phase == "start":
            collections.append(info["generation"])
    gc.callbacks.append(count)
    try:
        with collected_once():
            assert not gc.isenabled()
            # Cyclic garbage, as imports leave some: many times the young
            # generation's threshold, collected by the one pass at the end.
            for _ in range(20 * gc.get_threshold()[0]):
                cycle = []
                cycle.append(cycle)
            del cycle
            assert collections == []
        assert collections == [2]
        assert gc.isenabled(), "a forked process would never collect"
        assert gc.get_freeze_count() > 0
    finally:
        gc.callbacks.remove(count)
        gc.unfreeze()
