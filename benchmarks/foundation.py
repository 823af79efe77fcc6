"""Foundation benchmark: decode step time vs linear layers vs ceiling, prefill rate, offline
throughput on the 64-request workload, and transformers side by side.

    python -m benchmarks.foundation --out BENCHMARKS.md [--skip-hf] [--requests 64]
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import time

import numpy as np
import torch
import torch.nn.functional as F

from batchserve.core.batch import ScheduledBatch, ScheduledSeq
from batchserve.core.kv_cache import KVCacheManager
from batchserve.request import SamplingParams
from batchserve.runner.model_runner import kv_bytes_per_block
from benchmarks.report_md import write_section
from benchmarks.roofline import (decode_ceiling, linear_params, measure_machine, median_time,
                                 prefill_ceiling, schedule_ceiling_seconds, stored_weight_bytes)

GREEDY = SamplingParams(temperature=0.0)


def decode_batch(kv: KVCacheManager, batch: int, ctx: int) -> ScheduledBatch:
    seqs = []
    for i in range(batch):
        kv.allocate(f"d{i}", ctx + 1)
        # output_index 1: a decode (0 would send the row down the prompt path, AMX tiles where present)
        seqs.append(ScheduledSeq(f"d{i}", [100 + i], ctx, kv.block_table(f"d{i}"), True, GREEDY, 1))
    return ScheduledBatch(seqs)


def linear_only(model, batch: int) -> float:
    """Time of the step's matrix products alone: every layer's four, and the LM head."""
    h = model.cfg.hidden_size
    x = torch.randn(batch, h)
    xi = torch.randn(batch, model.cfg.intermediate_size)
    xo = torch.randn(batch, model.cfg.num_heads * model.cfg.head_dim)

    def run() -> None:
        with torch.inference_mode():
            for layer in model.layers:  # the model's own linear path (C++ panel GEMM, oneDNN or F.linear)
                layer["wqkv"](x)
                layer["wo"](xo)
                layer["w_gate_up"](x)
                layer["w_down"](xi)
            model.lm_head(x)

    return median_time(run, 5)


def offline_workload(n: int, seed: int, vocab: int) -> list[tuple[list[int], int]]:
    """Prompt lengths lognormal (median ~200, clipped to [32, 1024]); outputs 80% U[32, 64],
    20% U[256, 512]. Prompts are random ordinary token ids (no special tokens)."""
    rng = np.random.default_rng(seed)
    lens = np.clip(rng.lognormal(np.log(200), 0.6, n).astype(int), 32, 1024)
    long = rng.random(n) < 0.2
    outs = np.where(long, rng.integers(256, 513, n), rng.integers(32, 65, n))
    return [(rng.integers(200, vocab - 200, int(p)).tolist(), int(o)) for p, o in zip(lens, outs)]


def run_offline(llm, work) -> dict:
    eng = llm.engine
    sizes: list[int] = []
    t0 = time.perf_counter()
    for ids, m in work:
        eng.add_request(ids, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True))
    ntok = 0
    steps: list[tuple[int, int]] = []  # per step: rows that produced a token, the sum of their contexts
    while eng.has_unfinished:
        outs = eng.step().outputs
        running = len(eng.scheduler.running) + sum(1 for o in outs if o.finished)
        sizes.append(running)
        ctx = [len(o.prompt_token_ids) + len(o.token_ids) - 1 for o in outs if o.new_token_ids]
        steps.append((len(ctx), sum(ctx)))
        ntok += sum(len(o.new_token_ids) for o in outs)
    dt = time.perf_counter() - t0
    return {"tokens": ntok, "seconds": dt, "tok_s": ntok / dt, "mean_batch": float(np.mean(sizes)), "steps": steps}


def hf_model(dtype: torch.dtype = torch.float32):
    """transformers' LlamaForCausalLM on the default model's GGUF file (dequantized), on the CPU."""
    from transformers import AutoModelForCausalLM

    from batchserve.runner.loader import resolve_model_path

    path = resolve_model_path("smollm2-135m-instruct")
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=dtype).eval()


def left_padded(work) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts of `work` as one left-padded batch: (input ids, attention mask)."""
    longest = max(len(ids) for ids, _ in work)
    x = torch.tensor([[0] * (longest - len(ids)) + ids for ids, _ in work])
    mask = torch.tensor([[0] * (longest - len(ids)) + [1] * len(ids) for ids, _ in work])
    return x, mask


def run_hf(work, tok_per_req: list[int]) -> dict:
    """transformers' generate on the same requests: one at a time, and one static batch."""
    m = hf_model()
    kw = dict(do_sample=False, eos_token_id=[], pad_token_id=0)
    t0 = time.perf_counter()
    for ids, n in work:
        x = torch.tensor([ids])
        m.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, **kw)
    single = time.perf_counter() - t0
    x, mask = left_padded(work)
    t0 = time.perf_counter()
    m.generate(x, attention_mask=mask, max_new_tokens=max(n for _, n in work), **kw)
    static = time.perf_counter() - t0
    useful = sum(tok_per_req)
    return {"single_tok_s": useful / single, "static_tok_s": useful / static,
            "single_s": single, "static_s": static}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=None, help="markdown file to write (replaced section)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--batches", default="1,8,32,64,128")
    ap.add_argument("--workload-runs", type=int, default=3,
                    help="run the offline workload this many times and report the median run (this machine's "
                         "speed drifts from minute to minute)")
    ap.add_argument("--matmul-dtype", default="auto", choices=["auto", "float32", "int8", "int16"],
                    help="the engine's --matmul-dtype (a value other than auto gets its own section); with integer "
                         "dot products (auto picks int16 on AVX512-VNNI CPUs) the ceilings at their measured rate "
                         "are shown beside the fp32 ones")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16", "int8"],
                    help="the engine's --kv-cache-dtype (a value other than auto gets its own section; the ceilings "
                         "still count float32 K/V, and the workload's is also shown at the cache's own bytes)")
    ap.add_argument("--cpu-isa", default="auto", choices=["auto", "avx512", "avx2", "portable"],
                    help="the engine's --cpu-isa: the C++ matrix products' code path (a value other than auto gets "
                         "its own section)")
    a = ap.parse_args(argv)

    from batchserve.llm import LLM

    llm = LLM(kv_cache_gb=2.0, max_num_seqs=64, max_num_batched_tokens=2048, matmul_dtype=a.matmul_dtype,
              kv_cache_dtype=a.kv_cache_dtype, cpu_isa=a.cpu_isa)
    runner, cfg = llm.engine.executor, llm.engine.executor.cfg
    integer = runner.model.act_bits > 0  # the products run as integer dot products
    mmd = f"int{runner.model.act_bits}"
    mach = measure_machine(cfg)
    mach_int = measure_machine(cfg, dtype=getattr(torch, mmd)) if integer else None
    qm = runner.model.quantized_matrices
    wbytes = stored_weight_bytes(runner.model)
    fp32_bytes = 4 * (linear_params(cfg) + cfg.vocab_size * cfg.hidden_size)  # what the fp32 ceiling counts
    lines = [f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
             f"{torch.__version__}, {mach.threads} threads. Matmul at the model's shapes: "
             + ", ".join(f"M={m}: {r:.0f}" for m, r in mach.matmul_gflops.items())
             + f" GFLOP/s (peak {mach.peak_gflops:.0f}; the best of "
             + "; ".join(f"{b}: " + ", ".join(f"{r:.0f}" for r in by_m.values())
                         for b, by_m in (mach.by_backend or {}).items())
             + f"); memory {mach.bandwidth_gbs:.1f} GB/s."
             + (f" {mmd} dot products on Q4_1 blocks at the model's shapes: "
                + ", ".join(f"M={m}: {r:.0f}" for m, r in mach_int.matmul_gflops.items())
                + f" GOP/s (peak {mach_int.peak_gflops:.0f})." if integer else "")
             + f" The model runs on {runner.model.linear_backend}"
             + (f", {qm} of its matrices from their GGUF blocks ({wbytes / 1e6:.0f} MB read per decode step "
                f"against {fp32_bytes / 1e6:.0f} MB as float32)" if qm else "") + ".", "",
             "| decode batch (ctx 128) | step ms | linear ms | step/linear | tok/s | ceiling tok/s (fp32 weights) "
             "| % of ceiling |" + (" ceiling tok/s (stored weights) | % of it |" if qm else "")
             + (f" ceiling tok/s ({mmd} rate, stored weights) | % of it |" if integer else ""),
             "|---|---|---|---|---|---|---|" + ("---|---|" if qm else "") + ("---|---|" if integer else "")]
    kv = KVCacheManager(runner.num_blocks, runner.block_size)
    for b in [int(x) for x in a.batches.split(",")]:
        batch = decode_batch(kv, b, 128)
        step = median_time(lambda: runner.execute(batch), 5)
        lin = linear_only(runner.model, b)
        ceil = decode_ceiling(cfg, mach, b, 128)
        own = decode_ceiling(cfg, mach, b, 128, weight_bytes=wbytes)
        own_int = decode_ceiling(cfg, mach_int, b, 128, weight_bytes=wbytes) if integer else 0.0
        lines.append(f"| {b} | {step * 1e3:.1f} | {lin * 1e3:.1f} | {step / lin:.2f} | {b / step:.0f} | "
                     f"{ceil:.0f} | {100 * b / step / ceil:.0f}% |"
                     + (f" {own:.0f} | {100 * b / step / own:.0f}% |" if qm else "")
                     + (f" {own_int:.0f} | {100 * b / step / own_int:.0f}% |" if integer else ""))
        for i in range(b):
            kv.free(f"d{i}")
    for plen, nseq in ((512, 1), (256, 4)):
        seqs = []
        for i in range(nseq):
            kv.allocate(f"p{i}", plen)
            seqs.append(ScheduledSeq(f"p{i}", list(range(200, 200 + plen)), 0, kv.block_table(f"p{i}"),
                                     True, GREEDY, 0))
        t = median_time(lambda: runner.execute(ScheduledBatch(seqs)), 3)
        rate, ceil = plen * nseq / t, prefill_ceiling(cfg, mach, plen)
        c8 = prefill_ceiling(cfg, mach_int, plen) if integer else 0.0
        lines.append(f"\nPrefill {nseq} x {plen} tokens: {t * 1e3:.0f} ms, {rate:.0f} tok/s; ceiling "
                     f"{ceil:.0f} tok/s ({100 * rate / ceil:.0f}%)"
                     + (f"; at the {mmd} rate {c8:.0f} tok/s ({100 * rate / c8:.0f}%)" if integer else "") + ".")
        for i in range(nseq):
            kv.free(f"p{i}")

    work = offline_workload(a.requests, 0, cfg.vocab_size)
    runs = sorted((run_offline(llm, work) for _ in range(max(1, a.workload_runs))), key=lambda r: r["tok_s"])
    res = runs[len(runs) // 2]  # the median run
    ceil = decode_ceiling(cfg, mach, max(1, round(res["mean_batch"])), 200 + 64)
    own = decode_ceiling(cfg, mach, max(1, round(res["mean_batch"])), 200 + 64, weight_bytes=wbytes)
    lines.append(f"\nOffline workload ({a.requests} requests, seed 0, prompts lognormal median 200 "
                 f"[32, 1024], outputs 80% U[32,64] / 20% U[256,512], ignore_eos, all at t=0): "
                 f"{res['tokens']} output tokens in {res['seconds']:.1f} s = **{res['tok_s']:.0f} tok/s**"
                 + (f" (the median of {len(runs)} runs: " + ", ".join(f"{r['tok_s']:.0f}" for r in runs) + " tok/s)"
                    if len(runs) > 1 else "")
                 + f", mean running batch {res['mean_batch']:.1f}; decode ceiling at that batch ~{ceil:.0f} tok/s "
                 f"({100 * res['tok_s'] / ceil:.0f}%)"
                 + (f"; with the weights as stored ~{own:.0f} tok/s ({100 * res['tok_s'] / own:.0f}%)" if qm else "")
                 + ".")
    # The same ceiling step by step: each step's rows at their own contexts (the line above takes
    # the mean batch and the median prompt + 64 tokens of context; the long answers decode further out).
    def sched_share(r: dict) -> float:
        return 100 * schedule_ceiling_seconds(cfg, mach, r["steps"]) / r["seconds"]

    sched = schedule_ceiling_seconds(cfg, mach, res["steps"])
    rows = sum(b for b, _ in res["steps"])
    lines.append(f"\nDecode ceiling of this run's own steps (each step's {rows / len(res['steps']):.1f} rows on average "
                 f"at their own contexts, mean {sum(c for _, c in res['steps']) / max(1, rows):.0f} tokens): "
                 f"{sched:.1f} s, {res['tokens'] / sched:.0f} tok/s; the run reaches **{sched_share(res):.0f}%** "
                 "of it" + ("" if len(runs) == 1 else " (the other runs: " + ", ".join(
                     f"{sched_share(r):.0f}%" for r in runs if r is not res) + ")") + ".")
    kv_elem = kv_bytes_per_block(cfg, runner.block_size, runner.kv_dtype) / (
        2 * cfg.num_layers * runner.block_size * cfg.num_kv_heads * cfg.head_dim)  # bytes a K/V element, scales in
    if kv_elem != 4:
        own_kv = schedule_ceiling_seconds(cfg, mach, res["steps"], elem=kv_elem, w_elem=4)
        lines.append(f"\nThe same with K/V at the bytes this cache stores ({kv_elem:.2f} per element, not float32's 4): "
                     f"{own_kv:.1f} s, {res['tokens'] / own_kv:.0f} tok/s; the run reaches "
                     f"{100 * own_kv / res['seconds']:.0f}% of it.")
    # The run's floor: its prompt tokens cannot go faster than the prefill ceiling, nor its output
    # tokens than the decode ceiling at the batch it runs at; a decode-only ceiling ignores the former.
    ptoks = sum(len(p) for p, _ in work)
    fm = mach_int if integer else mach  # the rate of the arithmetic the engine runs
    own = decode_ceiling(cfg, fm, max(1, round(res["mean_batch"])), 200 + 64, weight_bytes=wbytes)
    floor_s = ptoks / prefill_ceiling(cfg, fm, round(ptoks / len(work))) + res["tokens"] / own
    lines.append(f"\nThat run's own floor: its {ptoks} prompt tokens at the prefill ceiling plus its output tokens at "
                 f"the decode ceiling at its batch = {floor_s:.1f} s, at most {res['tokens'] / floor_s:.0f} output tok/s "
                 f"({100 * res['tokens'] / floor_s / ceil:.0f}% of the decode-only ceiling above); the run takes "
                 f"{res['seconds']:.1f} s, **{100 * floor_s / res['seconds']:.0f}% of the floor's speed**.")
    if not a.skip_hf:
        first = work[:16]
        ours = run_offline(llm, first)
        hf = run_hf(first, [n for _, n in first])
        lines.append(f"\nFirst 16 requests ({ours['tokens']} output tokens): batchserve "
                     f"{ours['tok_s']:.0f} tok/s ({ours['seconds']:.1f} s); transformers one at a time "
                     f"{hf['single_tok_s']:.1f} tok/s ({hf['single_s']:.0f} s) -> "
                     f"{ours['tok_s'] / hf['single_tok_s']:.1f}x; transformers static batch of 16 "
                     f"(left-padded, to the longest) {hf['static_tok_s']:.1f} tok/s ({hf['static_s']:.0f} s) "
                     f"-> {ours['tok_s'] / hf['static_tok_s']:.1f}x.")
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    body = "\n".join(lines)
    mode = ("" if a.matmul_dtype == "auto" else f" --matmul-dtype {a.matmul_dtype}") + (
        "" if a.kv_cache_dtype == "auto" else f" --kv-cache-dtype {a.kv_cache_dtype}") + (
        "" if a.cpu_isa == "auto" else f" --cpu-isa {a.cpu_isa}")
    head = f"## Foundation,{mode}:" if mode else "## Foundation:"
    report = (f"{head} decode, prefill, offline throughput\n\nCommand: `python -m "
              f"benchmarks.foundation{' --skip-hf' if a.skip_hf else ''}{mode}`, {stamp}"
              f"{f'; matrix products as {mmd} dot products on the GGUF blocks' if integer else ''}; KV cache "
              f"{'int8' if runner.kv_dtype == torch.uint8 else str(runner.kv_dtype).split('.')[-1]}.\n\n{body}\n")
    print(report)
    if a.out:
        write_section(a.out, head, report)


if __name__ == "__main__":
    main()
