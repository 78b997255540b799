"""A shared-memory ring with this test process at one end and
tests/support/scripts/ring_peer.py at the other: starting the producer and
attaching to its ring, for tests/runtime/transport/test_shm_ring.py and
tests/e2e/test_shm_ring_e2e.py."""

import os
import sys

from cluster import SCRIPTS, Proc

from splitrun.runtime.transport.shm.ring import RingReader

PEER = SCRIPTS / "ring_peer.py"
# Bounds a child's start-up (an interpreter importing torch) and its sends.
START_S = 120.0
# Bounds one receive: the child sends as soon as it is attached.
RECV_S = 120.0


def producer(prefix, capacity, *args, hold=False):
    env = dict(os.environ, SPLITRUN_TEST_HOLD="1" if hold else "0")
    proc = Proc([sys.executable, PEER, "produce", prefix, "w7-s0", capacity, *args], env=env)
    proc.wait_for("created", START_S)
    return proc


def attach(prefix):
    return RingReader.attach(prefix, "w7-s0", owner="server 0", peer="worker 7",
                             timeout_s=START_S)
