"""The C++ kernels' build: a lock left by a killed build must not hang every later start, and
a first start builds them all at once, saying what is left."""
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


def test_build_all_builds_every_kernel_at_once_and_says_what_is_left(monkeypatch, caplog):
    import threading
    import time

    from batchserve.runner import kernels

    running, most, lock = set(), [0], threading.Lock()

    def fake_get(name):  # a build that takes a while; records how many overlap
        with lock:
            running.add(name)
            most[0] = max(most[0], len(running))
        time.sleep(0.3 if name != "batchserve_gemm" else 0.6)
        with lock:
            running.discard(name)
        kernels._cached[name] = None if name == "batchserve_gemm" else object()
        return kernels._cached[name]

    monkeypatch.setattr(kernels, "_cached", {})
    monkeypatch.setattr(kernels, "_get", fake_get)
    monkeypatch.setattr(kernels, "_built", lambda name: False)
    caplog.set_level("INFO", logger="batchserve.runner.kernels")
    ok = kernels.build_all(every_s=0.1)
    assert most[0] == len(kernels.KERNELS)  # all three at the same time
    assert ok == {"batchserve_paged_attention": True, "batchserve_fused_ops": True, "batchserve_gemm": False}
    text = caplog.text
    assert "building 3 C++ kernels at once" in text
    assert "C++ paged attention built (1/3" in text or "C++ paged attention built (2/3" in text
    assert "2/3 built; still building C++ panel GEMM" in text  # the slowest, named while it is left
    assert "C++ panel GEMM unavailable (3/3" in text and "C++ kernels ready in" in text
    lines = [r.getMessage() for r in caplog.records]
    assert lines.index(next(m for m in lines if "(3/3" in m)) > lines.index(next(m for m in lines if "(1/3" in m))
    assert kernels.build_all() == ok  # built: nothing is started again
