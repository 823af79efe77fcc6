"""Optional C++ kernels, compiled on first use with torch's cpp_extension.

The pure-PyTorch path in attention.py is always there; a kernel is used only when it built
and loaded. Build failures (no compiler, no ninja) are logged once, never raised.
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from types import ModuleType

log = logging.getLogger(__name__)

_lock = threading.Lock()
_cached: dict[str, ModuleType | None] = {}


def paged_attention_ext() -> ModuleType | None:
    """The compiled decode-attention kernel module, or None when it cannot be built here."""
    return _get("batchserve_paged_attention", "paged_attention.cpp", "C++ paged attention")


def fused_ops_ext() -> ModuleType | None:
    """The fused per-layer ops (add + RMSNorm, RoPE + cache write, SiLU * up), or None."""
    return _get("batchserve_fused_ops", "fused_ops.cpp", "C++ fused layer ops")


def gemm_ext() -> ModuleType | None:
    """The float32 panel GEMM on packed weights (runner/csrc/gemm.cpp), or None."""
    return _get("batchserve_gemm", "gemm.cpp", "C++ panel GEMM")


def _get(name: str, source: str, what: str) -> ModuleType | None:
    with _lock:
        if name not in _cached:
            _cached[name] = _build(name, source, what)
        return _cached[name]


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


def _build(name: str, source: str, what: str) -> ModuleType | None:
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        here = os.path.join(os.path.dirname(__file__), "csrc")
        src = os.path.join(here, source)
        # -fno-trapping-math: without it GCC will not vectorise a loop holding a float -> int
        # conversion (the exp polynomials); nothing here reads floating-point exception flags.
        flags = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-fno-trapping-math"]
        # One build per checkout and version of the sources (the .cpp and the header it includes):
        # torch rebuilds an extension whose recorded source path changed, so two checkouts sharing
        # one build would rebuild each other's in turn.
        digest = hashlib.sha1(" ".join(flags).encode() + here.encode())
        for f in (source, "cpu_math.h"):
            with open(os.path.join(here, f), "rb") as fh:
                digest.update(fh.read())
        name = f"{name}_{digest.hexdigest()[:10]}"
        build_dir = _get_build_directory(name, False)
        clear_stale_lock(build_dir)
        if not os.path.exists(os.path.join(build_dir, f"{name}.so")):
            log.info("building the %s (first start of this version: a minute or two)", what)
        return load(name=name, sources=[src], extra_cflags=flags, extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # any toolchain problem means: use the PyTorch path
        log.warning("%s unavailable, using the PyTorch path: %s", what, str(e).splitlines()[0])
        return None
