"""A wrong advertise address is found when the process joins: the scheduler
dials the address back and refuses that process, naming it and the address
(the job's side, end to end: tests/e2e/test_advertise_e2e.py)."""

from __future__ import annotations

import socket

from splitrun.runtime.cluster.scheduler import dial_back


def test_dial_back_names_why_an_address_cannot_be_reached():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert dial_back(f"127.0.0.1:{port}", 5) is None
        # Same port on another loopback address: nothing listens there.
        assert "refused" in dial_back(f"127.0.0.2:{port}", 5).lower()
    assert "not HOST:PORT" in dial_back("127.0.0.1:http", 5)
