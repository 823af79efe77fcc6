"""A GGUF file's matrices as the C++ GEMM packs them, packed once and then mapped from a cache.

Packing regroups every matrix's blocks into the GEMM's 32-column panels (and, for integer
products, splits the quants from their scales): work that depends only on the file's bytes,
the activation bits and the GEMM's source, yet ran on every start. `load` maps a cache entry
written by `save` on an earlier start (torch.load with mmap: the pages come from the OS page
cache, nothing is copied), keyed by the file's path, size and modification time, the
activation bits, the GEMM source's digest and torch's version, so a rewritten file, another
numerics option or a changed kernel gets an entry of its own. An entry is written whole or
not at all (a temporary file moved into place); one that cannot be read or written costs only
the packing it would have saved.
"""
from __future__ import annotations

import hashlib
import logging
import os
import tempfile

import torch

from batchserve.runner.tokenizer import CACHE_ENV, cache_dir  # noqa: F401  (CACHE_ENV: the folder's override)

log = logging.getLogger(__name__)

FORMAT = 1  # of what this module writes; a change makes earlier entries unused


def entry_path(gguf_path: str, act_bits: int) -> str:
    """The cache file for the packed matrices of the GGUF file at `gguf_path`, multiplied with
    `act_bits`-bit activations (0: float32)."""
    from batchserve.runner.kernels import _versioned

    real = os.path.realpath(gguf_path)
    st = os.stat(real)
    key = "\0".join(str(p) for p in (FORMAT, real, st.st_size, st.st_mtime_ns, act_bits,
                                      _versioned("batchserve_gemm"), torch.__version__))
    stem = os.path.splitext(os.path.basename(real))[0]
    return os.path.join(cache_dir(), "weights", f"{stem}-a{act_bits}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt")


def load(gguf_path: str, act_bits: int) -> dict[str, torch.Tensor] | None:
    """The packed matrices cached for this file and activation bits (LlamaModel's `packed`
    keys), or None when there is no readable entry."""
    try:
        path = entry_path(gguf_path, act_bits)
    except OSError:
        return None
    if not os.path.exists(path):
        return None
    try:
        packed = torch.load(path, mmap=True, weights_only=True)
    except Exception as e:  # a truncated or foreign file: pack again, and write a good one
        log.warning("packed-weight cache %s unreadable (%s); packing again", path, e)
        return None
    return packed if isinstance(packed, dict) else None


def save(gguf_path: str, act_bits: int, packed: dict[str, torch.Tensor]) -> str | None:
    """Write `packed` as this file's entry, removing the entries of its earlier versions with the
    same activation bits (another kernel or file version); its path, or None when it cannot be
    written (a warning says why)."""
    try:
        path = entry_path(gguf_path, act_bits)
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as fh:
                torch.save(packed, fh)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        log.warning("packed-weight cache cannot be written (%s); packing the weights on every start", e)
        return None
    prefix, mine = os.path.basename(path).rsplit("-", 1)[0] + "-", os.path.basename(path)
    for name in os.listdir(folder):
        if name.startswith(prefix) and name.endswith(".pt") and name != mine:
            try:
                os.unlink(os.path.join(folder, name))
            except OSError:
                pass
    return path
