"""Decode attention over the paged KV cache: time per layer, KV bytes read
against the minimum, and attention's share of a real decode step at 512-token contexts.

    python -m benchmarks.attention_kernel --out BENCHMARKS.md      # about 2 minutes

Each case keeps 30 layers' caches (random block placement), one per call in turn, so K/V come
from DRAM as in a 30-layer step. Minimum traffic: every cached K and V element read once. The
C++ kernel reads exactly that; the PyTorch path gathers each history into a padded copy (read,
write, read again) before SDPA.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import time

import torch

from batchserve.core.kv_cache import KVCacheManager
from batchserve.runner.attention import AttnMeta, _decode_torch
from batchserve.runner.kernels import paged_attention_ext
from benchmarks.foundation import decode_batch
from benchmarks.report_md import publish
from benchmarks.roofline import median_time

TITLE = "## Decode attention over the paged KV cache"
N_KV, N_H, HD, BS, LAYERS = 3, 9, 64, 16, 30  # SmolLM2-135M's attention shape


def time_layers(fn, layers: int, reps: int) -> float:
    """Median seconds per layer of `fn(layer)` called over all layers in turn."""
    return median_time(lambda: [fn(i) for i in range(layers)], reps) / layers


def int8_cache(kernel, blocks: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's int8 K and V caches holding random rows."""
    k = torch.zeros(blocks, N_KV, BS, HD + HD // 4, dtype=torch.uint8)  # a float32 scale per 16 elements
    v = torch.zeros(blocks, N_KV, BS, HD + 4, dtype=torch.uint8)  # one per row
    kernel.kv_int8_store(k, v, torch.randn(blocks * BS, N_KV, HD, generator=gen),
                         torch.randn(blocks * BS, N_KV, HD, generator=gen), torch.arange(blocks * BS))
    return k, v


def case(kernel, b: int, ctx: int, reps: int) -> dict:
    n = ctx + 1  # the context plus the token being decoded
    nblk = -(-n // BS)
    gen = torch.Generator().manual_seed(b * 1000 + ctx)
    total = b * nblk + 8
    tables = torch.randperm(total, generator=gen)[:b * nblk].view(b, nblk)
    lens = torch.full((b,), n, dtype=torch.long)
    q = torch.randn(b, N_H, HD, generator=gen)
    caches = {dt: [(torch.randn(total, N_KV, BS, HD, generator=gen).to(dt),
                    torch.randn(total, N_KV, BS, HD, generator=gen).to(dt)) for _ in range(LAYERS)]
              for dt in (torch.float32, torch.float16, torch.bfloat16)}
    caches[torch.uint8] = [int8_cache(kernel, total, gen) for _ in range(LAYERS)]  # --kv-cache-dtype int8
    out = {}
    for dt, layers in caches.items():
        out[dt] = time_layers(lambda i: kernel.paged_decode(q, *layers[i], tables, lens, BS, HD ** -0.5), LAYERS, reps)
    # the same caches with each request's blocks one run, as the KV manager places them
    runs = torch.arange(b * nblk).view(b, nblk)
    for dt, layers in caches.items():
        out["runs", dt] = time_layers(lambda i: kernel.paged_decode(q, *layers[i], runs, lens, BS, HD ** -0.5),
                                      LAYERS, reps)
    meta = AttnMeta.build([(ctx, 1, tables[i].tolist()) for i in range(b)], BS, torch.device("cpu"))
    f32 = caches[torch.float32]
    with torch.inference_mode():
        out["torch"] = time_layers(lambda i: _decode_torch(q, *f32[i], meta), LAYERS, max(3, reps // 4))
    out["min_bytes"] = b * n * N_KV * HD * 2  # elements of K and V read once
    out["int8_bytes"] = b * n * N_KV * (2 * HD + HD // 4 + 4)  # int8: a byte an element, and the scales
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--cases", default="1x128,1x2048,8x512,32x128,32x512,64x128")
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args(argv)
    kernel = paged_attention_ext()
    if kernel is None:
        print("the C++ kernel did not build here; nothing to measure")
        return 1
    rows = ["| batch, context | fp32 cache µs/layer | GB/s | fp16 cache (the default) µs/layer | GB/s | fp16 speed-up | "
            "bf16 cache µs/layer | GB/s | bf16 speed-up | PyTorch gather + SDPA µs/layer (fp32) | "
            "kernel speed-up over it (fp32) | fp16, each request's blocks contiguous µs/layer | GB/s | "
            "vs scattered | int8 cache, contiguous µs/layer | GB/s (int8 bytes) | vs fp16 contiguous |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in a.cases.split(","):
        b, ctx = (int(x) for x in c.split("x"))
        r = case(kernel, b, ctx, a.reps)
        f, e, h, t, c = r[torch.float32], r[torch.float16], r[torch.bfloat16], r["torch"], r["runs", torch.float16]
        i8 = r["runs", torch.uint8]
        rows.append(f"| {b}, {ctx} | {f * 1e6:.0f} | {r['min_bytes'] * 4 / f / 1e9:.1f} | {e * 1e6:.0f} | "
                    f"{r['min_bytes'] * 2 / e / 1e9:.1f} | {f / e:.2f}x | {h * 1e6:.0f} | "
                    f"{r['min_bytes'] * 2 / h / 1e9:.1f} | {f / h:.2f}x | {t * 1e6:.0f} | {t / f:.1f}x | "
                    f"{c * 1e6:.0f} | {r['min_bytes'] * 2 / c / 1e9:.1f} | {e / c:.2f}x | {i8 * 1e6:.0f} | "
                    f"{r['int8_bytes'] / i8 / 1e9:.1f} | {c / i8:.2f}x |")

    # attention's share of a real decode step at batch 32, 512-token contexts
    from batchserve.llm import LLM

    share = []
    for kv_dtype in ("float32", "float16", "bfloat16", "int8"):
        llm = LLM(kv_cache_gb=2.0, kv_cache_dtype=kv_dtype)
        runner = llm.engine.executor
        batch = decode_batch(KVCacheManager(runner.num_blocks, runner.block_size), 32, 512)
        runner.execute(batch)
        ts = []
        for _ in range(7):
            t0 = time.perf_counter()
            runner.execute(batch)
            ts.append(time.perf_counter() - t0)
        step = sorted(ts)[3]
        r = case(kernel, 32, 512, a.reps)
        att = LAYERS * r["runs", runner.kv_dtype]  # the step's requests hold one run of blocks each
        name = {"float32": "fp32", "float16": "fp16 (the default)", "bfloat16": "bf16", "int8": "int8"}[kv_dtype]
        nbytes = r["int8_bytes"] if kv_dtype == "int8" else r["min_bytes"] * runner.kv_caches[0][0].element_size()
        share.append(f"{name} KV: step {step * 1e3:.1f} ms, attention {att * 1e3:.1f} ms = {100 * att / step:.0f} % "
                     f"of it, reading {LAYERS * nbytes / 1e6:.0f} MB per step = the minimum (each element once)")
        del llm, runner
    text = (f"{TITLE}\n\n`python -m benchmarks.attention_kernel`, {datetime.datetime.now():%Y-%m-%d %H:%M}; "
            f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} "
            f"threads. {N_H} query / {N_KV} kv heads of {HD}, blocks of {BS}; medians over {a.reps} passes "
            f"through {LAYERS} layers' caches, each request's blocks scattered over the pool (the last six "
            f"columns: one run of blocks per request, as the KV manager places them; int8: "
            f"`--kv-cache-dtype int8`, in one run too). GB/s: minimum KV bytes over time.\n\n" + "\n".join(rows)
            + "\n\nAttention's share of a real decode step (SmolLM2, batch 32, 512-token contexts; attention timed with "
            "each request's blocks in one run, as in the step): "
            + "; ".join(share) + ".\n")
    return publish(text, a.out, TITLE)


if __name__ == "__main__":
    raise SystemExit(main())
