"""The allocator tuning every process runtime applies (runtime/allocator.py)."""

import ctypes

import pytest

from splitrun.runtime.engine.allocator import AllocatorSettings, keep_freed_memory


def test_the_users_own_malloc_tuning_wins():
    for environ in ({"MALLOC_TRIM_THRESHOLD_": "1"}, {"MALLOC_MMAP_THRESHOLD_": "1"},
                    {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}):
        assert keep_freed_memory(environ=environ) is False


def test_tunes_glibc_once():
    if not hasattr(ctypes.CDLL(None), "mallopt"):
        pytest.skip("no glibc mallopt here")
    assert keep_freed_memory(AllocatorSettings(), environ={}) is True
    assert keep_freed_memory(environ={}) is True  # already tuned: nothing more to do
