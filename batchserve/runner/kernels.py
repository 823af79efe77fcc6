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
    with _lock:
        if "paged" not in _cached:
            _cached["paged"] = _build()
        return _cached["paged"]


def _build() -> ModuleType | None:
    try:
        from torch.utils.cpp_extension import load

        src = os.path.join(os.path.dirname(__file__), "csrc", "paged_attention.cpp")
        flags = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp"]
        return load(name="batchserve_paged_attention", sources=[src], extra_cflags=flags,
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # any toolchain problem means: use the PyTorch path
        log.warning("C++ paged attention unavailable, using the PyTorch path: %s", str(e).splitlines()[0])
        return None
