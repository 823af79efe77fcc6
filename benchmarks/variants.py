"""Hot-path variants side by side, in one process: the elementwise work per layer in PyTorch
ops vs the C++ fused ops, the GGUF file's blocks vs weights dequantized at load (`--quantized-weights off`),
the C++ panel GEMM vs oneDNN for the float32 products, float32 vs bfloat16 matrix products (`--matmul-dtype bfloat16`),
float32 vs float16 / bfloat16 / int8 KV cache (`--kv-cache-dtype`), integer dot products on the GGUF blocks (`--matmul-dtype
int16 / int8`), with each variant's output quality against float32 (products and cache).

    python -m benchmarks.variants --out BENCHMARKS.md      # about 5 minutes, quiet machine

Decode steps of each variant alternate on the same batch (128-token contexts), medians of 7.
Quality: greedy continuations (64 tokens) of a prompt set, compared token by token with the
float32 model's; and, feeding both models the float32 continuation (teacher forcing), how often
their next-token argmax agrees and how far their logits are apart.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import os
import platform
import time

import torch

from batchserve.config import CacheConfig, ModelConfig
from batchserve.core.kv_cache import KVCacheManager
from batchserve.engine.engine import tokenize
from batchserve.runner.loader import load_model
from batchserve.runner.model_runner import ModelRunner
from benchmarks.foundation import decode_batch, offline_workload, run_offline
from benchmarks.report_md import publish
from benchmarks.roofline import decode_ceiling, measure_machine, stored_weight_bytes

TITLE = "## Hot-path variants: fused layer ops, bf16 matrix products, bf16 KV cache"
QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis in two sentences.",
    "List three prime numbers greater than 20.", "Who wrote Romeo and Juliet?", "How do I reverse a list in Python?",
    "What causes the seasons on Earth?", "Give me a recipe for pancakes.", "Translate 'good morning' into Spanish.",
    "What is 17 times 23?", "Describe a cat to someone who has never seen one.", "Why is the sky blue?",
    "Suggest a name for a bakery.", "What is the difference between weather and climate?",
    "Summarise the plot of Cinderella.", "How many legs does a spider have?", "What is machine learning?",
    "Write a short apology email for a late reply.", "What are the benefits of exercise?",
    "Explain what a black hole is.", "Name the planets of the solar system.", "What is the boiling point of water?",
    "How does a bicycle stay upright?", "Tell me a fun fact about octopuses.",
]


def forced_logits(runner: ModelRunner, prompts: list[list[int]], forced: list[list[int]]) -> list[torch.Tensor]:
    """Per prompt, the float32 logits [len(forced), V] at each output position when the model is
    fed `forced` (teacher forcing) through the engine's own path: one prefill step, then one
    decode step per token, so the KV cache (and its dtype) is read as in serving."""
    from batchserve.core.batch import ScheduledBatch, ScheduledSeq
    from batchserve.request import SamplingParams

    greedy = SamplingParams(temperature=0.0)
    kv = KVCacheManager(runner.num_blocks, runner.block_size)
    ids = [f"q{i}" for i in range(len(prompts))]
    for rid, p, f in zip(ids, prompts, forced):
        kv.allocate(rid, len(p) + len(f))
    out: list[list[torch.Tensor]] = [[] for _ in prompts]
    steps = [[(p, 0) for p in prompts]] + [[([f[j]], len(p) + j) for p, f in zip(prompts, forced)]
                                           for j in range(len(forced[0]) - 1)]
    for k, step in enumerate(steps):  # output_index k: the forced tokens run as the decodes they stand for
        seqs = [ScheduledSeq(rid, toks, start, kv.block_table(rid), True, greedy, k)
                for rid, (toks, start) in zip(ids, step)]
        logits = runner.compute_logits(ScheduledBatch(seqs))
        for i in range(len(prompts)):
            out[i].append(logits[i])
    for rid in ids:
        kv.free(rid)
    return [torch.stack(x) for x in out]


def quality(llm32, llm16, max_tokens: int = 64) -> dict:
    """How closely `llm16` follows the reference `llm32` (see the module docstring)."""
    from batchserve.request import SamplingParams

    tok = llm32.tokenizer
    prompts = [tokenize(tok, messages=[{"role": "user", "content": q}]) for q in QUESTIONS]
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    a = [o.token_ids for o in llm32.generate(prompts, greedy)]
    b = [o.token_ids for o in llm16.generate(prompts, greedy)]
    prefix = []
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        prefix.append(n)
    l32s = forced_logits(llm32.engine.executor, prompts, a)
    l16s = forced_logits(llm16.engine.executor, prompts, a)
    agree = total = 0
    rel = []
    for l32, l16 in zip(l32s, l16s):
        agree += int((l32.argmax(-1) == l16.argmax(-1)).sum())
        total += l32.shape[0]
        rel.append(((l16 - l32).abs().max() / l32.abs().max()).item())
    return {"prompts": len(prompts), "tokens": max_tokens, "identical": sum(n == max_tokens for n in prefix),
            "mean_prefix": sum(prefix) / len(prefix), "tf_agree": agree / total, "tf_positions": total,
            "max_rel": max(rel), "mean_rel": sum(rel) / len(rel)}


KV32 = {"kv_cache_dtype": "float32"}
FP32 = {"matmul_dtype": "float32", **KV32}
DEFAULT = "int16 matmul + fp16 KV cache (the default on AVX512-VNNI CPUs)"
VARIANTS = {  # name -> LLM options (the fp32 reference first: everything is compared with it)
    "fp32, fused ops": FP32,
    "fp32, weights dequantized at load": {"quantized_weights": "off", **KV32},
    "fp32, fused ops, oneDNN matmul": {"linear_backend": "onednn", **KV32},
    "fp32 + fp16 KV cache": {**FP32, "kv_cache_dtype": "float16"},
    "fp32 + bf16 KV cache": {**FP32, "kv_cache_dtype": "bfloat16"},
    "fp32 + int8 KV cache": {**FP32, "kv_cache_dtype": "int8"},
    "bf16 matmul": {"matmul_dtype": "bfloat16", **KV32},
    "bf16 matmul + bf16 KV cache": {"matmul_dtype": "bfloat16", "kv_cache_dtype": "bfloat16"},
    "int16 matmul (GGUF blocks x int16 activations), fp32 KV cache": {"matmul_dtype": "int16", **KV32},
    DEFAULT: {"matmul_dtype": "int16", "kv_cache_dtype": "float16"},
    "int16 matmul + int8 KV cache": {"matmul_dtype": "int16", "kv_cache_dtype": "int8"},
    "int8 matmul (GGUF blocks x int8 activations), fp32 KV cache": {"matmul_dtype": "int8", **KV32},
    "int8 matmul + fp16 KV cache": {"matmul_dtype": "int8", "kv_cache_dtype": "float16"},
}
UNFUSED = "fp32, PyTorch elementwise ops"


def time_steps(runners: dict[str, ModelRunner], batch: int, ctx: int, reps: int = 7) -> dict[str, float]:
    """Median decode-step seconds of each runner, the runners alternating on the same batch."""
    batches = {}
    for k, r in runners.items():
        batches[k] = decode_batch(KVCacheManager(r.num_blocks, r.block_size), batch, ctx)
        r.execute(batches[k])  # warm-up
    ts: dict[str, list[float]] = {k: [] for k in runners}
    for _ in range(reps):
        for k, r in runners.items():
            t = time.perf_counter()
            r.execute(batches[k])
            ts[k].append(time.perf_counter() - t)
    return {k: sorted(v)[reps // 2] for k, v in ts.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--cases", default="1x128,8x128,32x128,64x128,128x128,32x512",
                    help="decode cases, batch x context")
    ap.add_argument("--requests", type=int, default=64, help="offline workload size (0: skip)")
    a = ap.parse_args(argv)
    t_start = time.perf_counter()

    from batchserve.llm import LLM

    # ~32K tokens of KV each (1.5 GB at 4 bytes an element, 0.75 GB at 2, 0.4 at int8's 1 + scales), so
    # every engine schedules the workload (~22K tokens) alike and thirteen fit in 24 GB side by side
    engine_kw = dict(max_num_seqs=64, max_num_batched_tokens=2048)
    gb = {"float32": 1.5, "float16": 0.75, "bfloat16": 0.75, "int8": 0.4}
    llms = {name: LLM(**engine_kw, **kw, kv_cache_gb=gb[kw.get("kv_cache_dtype", "float32")])
            for name, kw in VARIANTS.items()}
    base = next(iter(llms.values()))
    unfused = ModelRunner(copy.copy(load_model(ModelConfig())), ModelConfig(matmul_dtype="float32"),
                          CacheConfig(kv_cache_gb=1.0, **KV32))
    unfused.model.fused = None  # same runner, elementwise work back in PyTorch ops (C++ attention kept)
    runners = {UNFUSED: unfused, **{k: v.engine.executor for k, v in llms.items()}}
    cfg = base.engine.executor.cfg
    mach = measure_machine(cfg)
    mach16 = measure_machine(cfg, dtype=torch.bfloat16)
    mach_int = {mm: measure_machine(cfg, dtype=getattr(torch, mm)) for mm in ("int8", "int16")}

    def own_ceiling(k: str, b: int, c: int) -> float:
        """The ceiling of the variant's own dtypes: bf16 / int8 / int16 matmul rate, weight bytes, KV bytes."""
        kw = VARIANTS.get(k, {})
        kv = {"bfloat16": 2, "float16": 2, "int8": 1 + 4 / cfg.head_dim}.get(kw.get("kv_cache_dtype"), 4)
        if kw.get("matmul_dtype") == "bfloat16":
            return decode_ceiling(cfg, mach16, b, c, elem=kv, w_elem=2)
        model = runners[k].model
        stored = stored_weight_bytes(model) if model.quantized_matrices else None
        return decode_ceiling(cfg, mach_int.get(kw.get("matmul_dtype"), mach), b, c, elem=kv, w_elem=4,
                              weight_bytes=stored)

    cases = [tuple(int(x) for x in c.split("x")) for c in a.cases.split(",")]
    res = {c: time_steps(runners, *c) for c in cases}
    head = "| variant | " + " | ".join(f"B={b}, ctx {c}" for b, c in cases) + " |"
    rows = [head, "|---" * (len(cases) + 1) + "|",
            "| fp32 ceiling tok/s | " + " | ".join(f"{decode_ceiling(cfg, mach, b, c):.0f}" for b, c in cases) + " |",
            "| bf16-matmul + bf16-KV ceiling tok/s | "
            + " | ".join(f"{decode_ceiling(cfg, mach16, b, c, elem=2, w_elem=2):.0f}" for b, c in cases) + " |",
            *(f"| {mm}-matmul ceiling tok/s (GGUF blocks, fp32 KV) | "
              + " | ".join(f"{decode_ceiling(cfg, mi, b, c, weight_bytes=stored_weight_bytes(base.engine.executor.model)):.0f}"
                           for b, c in cases) + " |" for mm, mi in mach_int.items())]
    for k in runners:
        cells = []
        for (b, c) in cases:
            t = res[(b, c)][k]
            cells.append(f"{t * 1e3:.1f} ms, {b / t:.0f} tok/s ({100 * b / t / decode_ceiling(cfg, mach, b, c):.0f}% / "
                         f"{100 * b / t / own_ceiling(k, b, c):.0f}%)")
        rows.append(f"| {k} | " + " | ".join(cells) + " |")
    del unfused, runners
    lines = [f"`python -m benchmarks.variants`, {datetime.datetime.now():%Y-%m-%d %H:%M}; "
             f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
             f"{torch.get_num_threads()} threads; fp32 matmul peak at the model's shapes "
             f"{mach.peak_gflops:.0f} GFLOP/s (bf16 {mach16.peak_gflops:.0f}; dot products on Q4_1 blocks: int8 "
             f"{mach_int['int8'].peak_gflops:.0f}, int16 {mach_int['int16'].peak_gflops:.0f}), memory {mach.bandwidth_gbs:.1f} GB/s.",
             "", "Decode step time, tokens/s, and share of the fp32 ceiling / of the ceiling for the variant's own "
             "dtypes (bf16 / int8 / int16 matmul rate, weight bytes as stored, KV bytes); medians of 7, variants alternating:", "",
             *rows]
    if a.requests:
        work = offline_workload(a.requests, 0, cfg.vocab_size)
        runs = {}
        for k, llm in llms.items():
            run_offline(llm, work[:4])  # warm-up
            runs[k] = run_offline(llm, work)
        b0 = runs[next(iter(runs))]["tok_s"]
        lines += ["", f"Offline workload ({a.requests} requests, as in the foundation section): "
                  + "; ".join(f"{k} {r['tok_s']:.0f} tok/s ({r['seconds']:.1f} s, {r['tok_s'] / b0:.2f}x)"
                              for k, r in runs.items()) + "."]
    lines += ["", "Quality against the fp32 model (24 chat prompts, greedy, 64 tokens; teacher-forced: both "
              "models fed the fp32 continuation, one prefill then one decode step per token, so the KV cache "
              "is read as in serving):", "",
              "| variant | identical continuations | mean common prefix | next-token argmax agrees | largest "
              "logit difference (mean over prompts), % of the largest logit |", "|---|---|---|---|---|"]
    for k, llm in list(llms.items())[1:]:
        q = quality(base, llm)
        lines.append(f"| {k} | {q['identical']}/{q['prompts']} | {q['mean_prefix']:.1f} tokens | "
                     f"{100 * q['tf_agree']:.1f}% of {q['tf_positions']} | {100 * q['max_rel']:.1f} "
                     f"({100 * q['mean_rel']:.1f}) |")
    lines += ["", f"Whole run {time.perf_counter() - t_start:.0f} s."]
    return publish(f"{TITLE}\n\n" + "\n".join(lines) + "\n", a.out, TITLE)


if __name__ == "__main__":
    raise SystemExit(main())
