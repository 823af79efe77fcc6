"""Optional C++ kernels, compiled on first use with torch's cpp_extension.

The pure-PyTorch path in attention.py is always there; a kernel is used only when it built
and loaded. Build failures (no compiler, no ninja) are logged once, never raised. `build_all`
compiles every kernel not yet built at once, saying which are still building: a first start
waits for the slowest build rather than for their sum. `python -m batchserve.runner.kernels`
does it ahead of a first start (the Makefile's install does).
"""
from __future__ import annotations

import hashlib
import logging
import os
import queue
import sys
import threading
import time
from types import ModuleType

log = logging.getLogger(__name__)

_locks: dict[str, threading.Lock] = {}  # one per kernel: kernels build at the same time
_locks_lock = threading.Lock()
_cached: dict[str, ModuleType | None] = {}
_announced: set[str] = set()  # kernels whose build build_all has already told of
# name -> (source, what it is called in the log)
KERNELS = {"batchserve_paged_attention": ("paged_attention.cpp", "C++ paged attention"),
           "batchserve_fused_ops": ("fused_ops.cpp", "C++ fused layer ops"),
           "batchserve_gemm": ("gemm.cpp", "C++ panel GEMM")}


def paged_attention_ext() -> ModuleType | None:
    """The compiled decode-attention kernel module, or None when it cannot be built here."""
    return _get("batchserve_paged_attention")


def fused_ops_ext() -> ModuleType | None:
    """The fused per-layer ops (add + RMSNorm, RoPE + cache write, SiLU * up), or None."""
    return _get("batchserve_fused_ops")


def gemm_ext() -> ModuleType | None:
    """The float32 panel GEMM on packed weights (runner/csrc/gemm.cpp), or None."""
    return _get("batchserve_gemm")


def _get(name: str) -> ModuleType | None:
    with _locks_lock:
        lock = _locks.setdefault(name, threading.Lock())
    with lock:
        if name not in _cached:
            _cached[name] = _build(name, *KERNELS[name])
        return _cached[name]


def build_all(every_s: float = 15.0) -> dict[str, bool]:
    """Build (or load) every kernel at once, one thread each — the compilers run as processes
    — saying on a first start what it builds, each kernel as it is done ("2/3") and, every
    `every_s` seconds, which are still building. Whether each is usable."""
    todo = [n for n in KERNELS if n not in _cached]
    if todo:
        fresh = [n for n in todo if not _built(n)]
        _announced.update(fresh)  # said here, not again by _build
        if fresh:
            log.info("building %d C++ kernel%s at once (first start of this version; a few minutes): %s", len(fresh),
                     "s" if len(fresh) > 1 else "", ", ".join(KERNELS[n][1] for n in fresh))
        finished: queue.SimpleQueue[str] = queue.SimpleQueue()

        def build(name: str) -> None:
            try:
                _get(name)
            finally:
                finished.put(name)

        t0 = time.monotonic()
        for n in todo:
            threading.Thread(target=build, args=(n,), daemon=True, name=f"build-{n}").start()
        left, done = set(todo), 0
        while left:
            try:
                name = finished.get(timeout=every_s)
            except queue.Empty:
                if fresh:
                    log.info("%d/%d built; still building %s (%.0f s)", done, len(fresh),
                             ", ".join(KERNELS[n][1] for n in todo if n in left), time.monotonic() - t0)
                continue
            left.discard(name)
            if name in fresh:
                done += 1
                log.info("%s %s (%d/%d, %.0f s)", KERNELS[name][1],
                         "built" if _cached.get(name) is not None else "unavailable", done, len(fresh),
                         time.monotonic() - t0)
        if fresh:
            log.info("C++ kernels ready in %.0f s", time.monotonic() - t0)
    return {n: _cached.get(n) is not None for n in KERNELS}


# A build takes 1-3 minutes here; a lock older than this was left by a build that was killed.
STALE_LOCK_S = 15 * 60


def clear_stale_lock(build_dir: str, max_age_s: float = STALE_LOCK_S) -> bool:
    """Remove `build_dir`/lock when it is older than `max_age_s`. torch's loader waits for that
    file to go away and nothing else removes it, so a first start killed while compiling would
    make every later start hang without a word. True when a lock was removed."""
    lock = os.path.join(build_dir, "lock")
    try:
        age = time.time() - os.path.getmtime(lock)
    except OSError:
        return False
    if age < max_age_s:
        return False
    log.warning("removing a stale C++ build lock (%.0f minutes old, its build was interrupted): %s", age / 60, lock)
    try:
        os.remove(lock)
    except OSError:
        return False
    return True


# -fno-trapping-math: without it GCC will not vectorise a loop holding a float -> int
# conversion (the exp polynomials); nothing here reads floating-point exception flags.
_FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-fno-trapping-math"]
_HERE = os.path.join(os.path.dirname(__file__), "csrc")


def _versioned(name: str) -> str:
    """One build per checkout and version of the sources (the .cpp and the header it includes):
    torch rebuilds an extension whose recorded source path changed, so two checkouts sharing
    one build would rebuild each other's in turn."""
    digest = hashlib.sha1(" ".join(_FLAGS).encode() + _HERE.encode())
    for f in (KERNELS[name][0], "cpu_math.h"):
        with open(os.path.join(_HERE, f), "rb") as fh:
            digest.update(fh.read())
    return f"{name}_{digest.hexdigest()[:10]}"


def _built(name: str) -> bool:
    try:
        from torch.utils.cpp_extension import _get_build_directory

        full = _versioned(name)
        return os.path.exists(os.path.join(_get_build_directory(full, False), f"{full}.so"))
    except Exception:
        return False


def _build(name: str, source: str, what: str) -> ModuleType | None:
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        base, name = name, _versioned(name)
        build_dir = _get_build_directory(name, False)
        clear_stale_lock(build_dir)
        if not os.path.exists(os.path.join(build_dir, f"{name}.so")) and base not in _announced:
            log.info("building the %s (first start of this version: a minute or two)", what)
        return load(name=name, sources=[os.path.join(_HERE, source)], extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"],
                    verbose=False)
    except Exception as e:  # any toolchain problem means: use the PyTorch path
        log.warning("%s unavailable, using the PyTorch path: %s", what, str(e).splitlines()[0])
        return None


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ok = build_all()
    for n, good in ok.items():
        print(f"{KERNELS[n][1]}: {'ready' if good else 'unavailable (the PyTorch path is used)'}")
    sys.exit(0)
