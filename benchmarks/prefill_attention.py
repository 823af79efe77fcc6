"""Prompt attention over the paged KV cache: the C++ prompt-chunk kernel (`paged_prefill` in
runner/csrc/paged_attention.cpp) against the PyTorch path it replaces (per chunk: gather the
context when there is cached history, repeat the kv heads, SDPA's flash kernel).

    python -m benchmarks.prefill_attention --out BENCHMARKS.md      # under a minute

Each case is one layer's call for a step's prompt chunks (SmolLM2-135M's attention shape, blocks
placed at random), median of 15. GFLOP/s counts the causal work only: 4 x head_dim x query
heads per (query, visible key) pair.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform

import torch

from batchserve.runner.attention import AttnMeta, gather_slots, paged_attention
from batchserve.runner.kernels import paged_attention_ext
from benchmarks.perplexity import cpu_name
from benchmarks.report_md import publish
from benchmarks.roofline import median_time

TITLE = "## Prompt attention over the paged KV cache"
N_KV, N_H, HD, BS = 3, 9, 64, 16
CASES = [(4, 256, 0), (1, 512, 0), (1, 1024, 0), (8, 64, 0), (1, 256, 512), (4, 128, 384)]  # chunks, tokens, cached


def case(kernel, nseq: int, n: int, cached: int, reps: int) -> dict:
    ctx = cached + n
    per = -(-ctx // BS)
    gen = torch.Generator().manual_seed(nseq * 7 + n + cached)
    nblocks = nseq * per + 4
    k_cache = torch.randn(nblocks, N_KV, BS, HD, generator=gen)
    v_cache = torch.randn(nblocks, N_KV, BS, HD, generator=gen)
    perm = torch.randperm(nblocks, generator=gen).tolist()
    seqs = [(cached, n, perm[i * per:(i + 1) * per]) for i in range(nseq)]
    q = torch.randn(nseq * n, N_H, HD, generator=gen)
    mk = AttnMeta.build(seqs, BS, torch.device("cpu"), kernel)
    mt = AttnMeta.build(seqs, BS, torch.device("cpu"), None)
    k, v = gather_slots(k_cache, mk.slot_mapping), gather_slots(v_cache, mk.slot_mapping)
    tk = median_time(lambda: paged_attention(q, k, v, k_cache, v_cache, mk, stored=True), reps)
    tt = median_time(lambda: paged_attention(q, k, v, k_cache, v_cache, mt, stored=True), reps)
    k16, v16 = k_cache.half(), v_cache.half()  # the default cache where the kernels run
    t16 = median_time(lambda: paged_attention(q, k, v, k16, v16, mk, stored=True), reps)
    diff = (paged_attention(q, k, v, k_cache, v_cache, mk, stored=True)
            - paged_attention(q, k, v, k_cache, v_cache, mt, stored=True)).abs().max().item()
    pairs = nseq * (n * cached + n * (n + 1) / 2)
    flops = 4 * HD * N_H * pairs
    return {"kernel": tk, "torch": tt, "k16": t16, "gk": flops / tk / 1e9, "gt": flops / tt / 1e9,
            "g16": flops / t16 / 1e9, "diff": diff}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--reps", type=int, default=15)
    a = ap.parse_args(argv)
    kernel = paged_attention_ext()
    if kernel is None or not kernel.prefill_supported(HD):
        print("the C++ prompt-chunk kernel does not run here; nothing to compare")
        return 0
    rows = ["| chunks x tokens, cached before | kernel ms/layer | GFLOP/s | PyTorch gather + SDPA ms/layer | GFLOP/s "
            "| speed-up | max abs difference | kernel, fp16 cache (the default) ms/layer | GFLOP/s |",
            "|---|---|---|---|---|---|---|---|---|"]
    cpu, flags = cpu_name()
    for nseq, n, cached in CASES:
        r = case(kernel, nseq, n, cached, a.reps)
        rows.append(f"| {nseq} x {n}, {cached} | {r['kernel'] * 1e3:.2f} | {r['gk']:.0f} | {r['torch'] * 1e3:.2f} | "
                    f"{r['gt']:.0f} | {r['torch'] / r['kernel']:.2f}x | {r['diff']:.1e} | {r['k16'] * 1e3:.2f} | "
                    f"{r['g16']:.0f} |")
    text = "\n".join([
        TITLE, "", f"`python -m benchmarks.prefill_attention`, {datetime.datetime.now():%Y-%m-%d %H:%M}; "
        f"{cpu} ({flags or 'no AVX2'}; the kernel's {'AVX-512' if 'avx512f' in flags.split() else 'AVX2'} path), "
        f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads. "
        f"{N_H} query / {N_KV} kv heads of {HD}, blocks of {BS}, fp32 cache (the last two columns: the same "
        f"kernel on a float16 copy of it); one layer's call, median of {a.reps}; "
        "GFLOP/s over the causal pairs only.", "", *rows]) + "\n"
    return publish(text, a.out, TITLE)


if __name__ == "__main__":
    raise SystemExit(main())
