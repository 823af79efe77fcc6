"""The C++ kernels' build: a lock left by a killed build must not hang every later start."""
import os
import time

from batchserve.runner.kernels import STALE_LOCK_S, clear_stale_lock


def test_a_stale_build_lock_is_removed_and_a_live_one_kept(tmp_path):
    lock = tmp_path / "lock"
    assert not clear_stale_lock(str(tmp_path))  # no lock: nothing to do
    lock.touch()
    assert not clear_stale_lock(str(tmp_path)) and lock.exists()  # a build may be running now
    old = time.time() - STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    assert clear_stale_lock(str(tmp_path)) and not lock.exists()
