"""Prompts on AMX tiles (--prompt-matmul auto) against prompts on the decodes' int8 products
(off), on a CPU with AMX: prompt step times, the 64-request workload, and what it costs in
output quality.

    python -m benchmarks.amx_prompt --out BENCHMARKS.md      # a few minutes, quiet machine

Two engines in one process, each with its option, measured in alternating rounds (this machine's
speed drifts from minute to minute): a step of prompts only (1 x 64, 1 x 512, 4 x 256 and 8 x 256
tokens; the median of 3 runs each), then the foundation benchmark's 64-request offline workload
(all at t = 0, greedy, ignore_eos). Quality as benchmarks.perplexity measures it, against the
dequantized float32 model: perplexity over the same text and windows, and the first 32 greedy
tokens of its 10 prompts.
"""
from __future__ import annotations

import argparse
import datetime
import math
import statistics
import sys

import numpy as np

from benchmarks.foundation import GREEDY, offline_workload, run_offline
from benchmarks.perplexity import REFERENCE, TEXT, cpu_name, run_batchserve, windows
from benchmarks.report_md import write_section
from benchmarks.roofline import median_time

TITLE = "## Prompts on AMX tiles: prefill and the 64-request workload, --prompt-matmul auto against off"
SHAPES = ((1, 64), (1, 512), (4, 256), (8, 256))  # (prompts, tokens each) in one step
OPTIONS = ("auto", "off")


def prompt_step_ms(llm, nseq: int, plen: int) -> float:
    """Median time of one step holding `nseq` fresh prompts of `plen` tokens."""
    from batchserve.core.batch import ScheduledBatch, ScheduledSeq
    from batchserve.core.kv_cache import KVCacheManager

    runner = llm.engine.executor
    kv = KVCacheManager(runner.num_blocks, runner.block_size)
    seqs = []
    for i in range(nseq):
        kv.allocate(f"p{i}", plen)
        seqs.append(ScheduledSeq(f"p{i}", list(range(200, 200 + plen)), 0, kv.block_table(f"p{i}"), True, GREEDY, 0))
    return 1e3 * median_time(lambda: runner.execute(ScheduledBatch(seqs)), 3)


def quality(opts: dict, wins: list[list[int]], window: int, ref: dict | None) -> dict:
    r = run_batchserve(opts, wins, window)
    lp = np.array(r["logprobs"])
    out = {"ppl": math.exp(-lp.mean())}
    if ref is not None:
        out["dlogp"] = float(np.abs(lp - np.array(ref["logprobs"])).mean())
        out["greedy"] = sum(x == y for x, y in zip(r["greedy"], ref["greedy"]))
    return out | {"raw": r}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--window", type=int, default=512)
    a = p.parse_args(argv)

    from batchserve.config import ModelConfig
    from batchserve.llm import LLM
    from batchserve.runner.loader import load_tokenizer

    llms = {o: LLM(kv_cache_gb=2.0, prompt_matmul=o) for o in OPTIONS}
    if llms["auto"].engine.executor.model.prompt_layers is None:
        print("this CPU (or its OS) gives no AMX tiles: --prompt-matmul auto is off here, nothing to compare",
              file=sys.stderr)
        return 1
    work = offline_workload(64, 0, llms["auto"].engine.executor.cfg.vocab_size)
    steps = {o: {s: [] for s in SHAPES} for o in OPTIONS}
    tok_s = {o: [] for o in OPTIONS}
    for llm in llms.values():
        run_offline(llm, work[:4])  # warm-up
    for r in range(a.rounds):
        for o in (OPTIONS if r % 2 == 0 else OPTIONS[::-1]):
            for s in SHAPES:
                steps[o][s].append(prompt_step_ms(llms[o], *s))
            tok_s[o].append(run_offline(llms[o], work)["tok_s"])
            print(f"round {r + 1} {o}: " + ", ".join(f"{n}x{t} {steps[o][(n, t)][-1]:.0f} ms" for n, t in SHAPES)
                  + f"; workload {tok_s[o][-1]:.1f} tok/s", file=sys.stderr, flush=True)
    del llms

    tok = load_tokenizer(ModelConfig())
    with open(TEXT) as fh:
        wins = windows(tok.encode(fh.read(), add_special_tokens=False), a.window)
    ref = quality(REFERENCE, wins, a.window, None)
    q = {o: quality({"prompt_matmul": o}, wins, a.window, ref["raw"]) for o in OPTIONS}

    med = lambda xs: statistics.median(xs)  # noqa: E731
    model, flags = cpu_name()
    lines = [TITLE, "", f"`python -m benchmarks.amx_prompt {' '.join(argv)}` — "
             f"{datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}, {model}, 2 cores (flags {flags}). Both "
             "engines with every other option at its default (int8 products on the GGUF blocks for decodes, "
             "a float16 KV cache), alternating over "
             f"{a.rounds} rounds; medians. auto: prompt rows multiply by bf16 copies of each layer's matrices "
             "on AMX tiles; off: by the int8 products, as decodes do.", "",
             "| step of prompts only | auto ms | off ms | off / auto |", "|---|---|---|---|"]
    for n, t in SHAPES:
        x, y = med(steps["auto"][(n, t)]), med(steps["off"][(n, t)])
        lines.append(f"| {n} x {t} tokens | {x:.0f} | {y:.0f} | **{y / x:.2f}x** |")
    x, y = med(tok_s["auto"]), med(tok_s["off"])
    lines += ["", f"The 64-request workload (foundation's, all at t = 0): auto **{x:.1f}** tok/s, off {y:.1f} "
              f"(**{x / y:.2f}x**; rounds: auto " + ", ".join(f"{v:.0f}" for v in tok_s["auto"]) + "; off "
              + ", ".join(f"{v:.0f}" for v in tok_s["off"]) + ").", "",
              f"Quality against the dequantized float32 model (perplexity {ref['ppl']:.4f} over {len(wins)} windows "
              f"of {a.window} tokens of benchmarks/data/pd_english.txt, second halves scored; greedy: 10 prompts, "
              "32 tokens):", "", "| option | perplexity | against float32 | mean abs Δ log P | greedy prompts "
              "identical |", "|---|---|---|---|---|"]
    for o in OPTIONS:
        lines.append(f"| {o} | {q[o]['ppl']:.4f} | {100 * (q[o]['ppl'] / ref['ppl'] - 1):+.2f} % | "
                     f"{q[o]['dlogp']:.5f} | {q[o]['greedy']}/10 |")
    report = "\n".join(lines) + "\n"
    print(report)
    if a.out:
        write_section(a.out, TITLE, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
