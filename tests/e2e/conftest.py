"""The multi-process tier: every test in this folder starts real processes (the
real launcher, real gRPC and shared memory) and is marked `slow` here, so no
test needs its own marker. `make test-fast` (`-m "not slow"`) leaves them out,
and tests/scheduling.py runs each as a work unit of its own (or with its
shared launch's group: tests/conftest.py)."""

import pytest


def pytest_itemcollected(item):
    # Called through the item's own hook proxy: only for the tests of this folder.
    item.add_marker(pytest.mark.slow)
