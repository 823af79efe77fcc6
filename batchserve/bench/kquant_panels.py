"""GGUF K-quant blocks (Q4_K, Q6_K) on the C++ GEMM against the fp32 panel GEMM.

    python -m batchserve.bench.kquant_panels [--n 2048 --k 1024 --matrices 24]

SmolLM2's width (576) is not a multiple of the K-quants' 256-weight super-blocks, so no K-quant
file of the default model exists; this runs `--matrices` distinct matrices of [n, k] with random
blocks (weight-like fp16 scales), so that their bytes stream from memory as in a decode step, at
1, 8 and 32 rows. Best of 5 passes; milliseconds for all the matrices.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

from batchserve.runner.kernels import gemm_ext

# GGUF source code in pack_q, panel layout in gemm_q, bytes per 256-weight super-block, where its fp16 d sits
KINDS = {"Q4_K": (3, 0, 144, 0), "Q6_K": (4, 2, 210, 208)}


def random_blocks(kind: str, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    _, _, size, dpos = KINDS[kind]
    nb = k // 256
    raw = rng.integers(0, 256, (n, nb, size), dtype=np.uint8)
    raw[:, :, dpos:dpos + 2] = (rng.standard_normal((n, nb)) * 1e-3).astype(np.float16).view(np.uint8).reshape(n, nb, 2)
    if kind == "Q4_K":  # dmin >= 0
        raw[:, :, 2:4] = (abs(rng.standard_normal((n, nb))) * 1e-3).astype(np.float16).view(np.uint8).reshape(n, nb, 2)
    return torch.from_numpy(raw.reshape(n, nb * size))


def best_ms(fn, reps: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--k", type=int, default=1024, help="a multiple of 256")
    ap.add_argument("--matrices", type=int, default=24)
    a = ap.parse_args(argv)
    ext = gemm_ext()
    if ext is None or a.k % 256:
        print("needs the C++ GEMM and --k a multiple of 256", file=sys.stderr)
        return 1
    rng = np.random.default_rng(0)
    fp32 = [ext.pack(torch.randn(a.n, a.k)) for _ in range(a.matrices)]
    packed = {kind: [ext.pack_q(random_blocks(kind, a.n, a.k, rng), src) for _ in range(a.matrices)]
              for kind, (src, _, _, _) in KINDS.items()}
    print(f"| rows | fp32 panel GEMM ms | " + " | ".join(f"{k} ms (speed-up)" for k in KINDS) + " |")
    print("|---|---|" + "---|" * len(KINDS))
    for m in (1, 8, 32):
        x = torch.randn(m, a.k)
        base = best_ms(lambda: [ext.gemm(x, w, a.n) for w in fp32])
        cells = []
        for kind, (_, fmt, _, _) in KINDS.items():
            t = best_ms(lambda: [ext.gemm_q(x, w, a.n, fmt) for w in packed[kind]])
            cells.append(f"{t:.2f} ({base / t:.1f}×)")
        print(f"| {m} | {base:.2f} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
