"""Optional C++ kernels, compiled on first use with torch's cpp_extension.

The pure-PyTorch path in attention.py is always there; a kernel is used only when it built
and loaded. Build failures (no compiler, no ninja) are logged once, never raised.
"""
from __future__ import annotations

import logging
import os
import threading
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


def _build(name: str, source: str, what: str) -> ModuleType | None:
    try:
        from torch.utils.cpp_extension import load

        src = os.path.join(os.path.dirname(__file__), "csrc", source)
        # -fno-trapping-math: without it GCC will not vectorise a loop holding a float -> int
        # conversion (the exp polynomials); nothing here reads floating-point exception flags.
        flags = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-fno-trapping-math"]
        return load(name=name, sources=[src], extra_cflags=flags, extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # any toolchain problem means: use the PyTorch path
        log.warning("%s unavailable, using the PyTorch path: %s", what, str(e).splitlines()[0])
        return None
