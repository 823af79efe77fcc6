"""Output quality of every numerics option: perplexity on an English text and greedy agreement.

    make bench-quality
    python -m benchmarks.perplexity --out BENCHMARKS.md [--llama-perplexity PATH/llama-perplexity]

Perplexity: the text (benchmarks/data/pd_english.txt, public domain, see the README there) is
tokenized without special tokens and cut into non-overlapping windows of `--window` tokens (the
tail that fills no window is dropped); each window is scored from scratch and only its second
half counts: positions window/2 + 1 .. window - 1, so that every scored token has at least half
a window of context. This is llama.cpp's `llama-perplexity -c WINDOW` scheme (this model's GGUF
adds no BOS token), so its figure on the same file and text is comparable. Perplexity =
exp(-mean log P(token | context)) over the scored tokens, the log P from
`LLM.prompt_logprobs`.

Configurations: transformers' LlamaForCausalLM in float32 on the same GGUF file (an
independent reference); batchserve's reference, the GGUF's matrices dequantized to float32
(`--quantized-weights off --matmul-dtype float32 --kv-cache-dtype float32`); the defaults (auto,
auto, resolved on this machine: on a CPU with AMX its prompts run on bf16 tiles); every
`--matmul-dtype` {float32, bfloat16, int16, int8} x `--kv-cache-dtype` {float32, bfloat16,
float16, int8} on the GGUF blocks, prompts included (`--prompt-matmul off`); and `--dtype
bfloat16` (the whole model in bf16). For each: perplexity, the mean and largest |difference| of
the scored tokens' log P from the reference's, and greedy agreement with the reference over
`PROMPTS` (the first 32 greedy tokens, ignore_eos): prompts whose 32 tokens are identical, and
the mean number of tokens before the first difference.
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import re
import subprocess
import sys

import numpy as np

from benchmarks.report_md import publish

TITLE = "## Output quality: perplexity and greedy agreement per numerics option"
TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "pd_english.txt")
MATMUL = ("float32", "bfloat16", "int16", "int8")
KV = ("float32", "bfloat16", "float16", "int8")
REFERENCE = {"quantized_weights": "off", "matmul_dtype": "float32", "kv_cache_dtype": "float32"}
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "In 1969, the first humans",
    "A haiku about autumn:",
    "The quick brown fox",
    "To make a cup of tea, first",
    "The most important rule of writing is",
]
GREEDY_TOKENS = 32


def windows(ids: list[int], window: int) -> list[list[int]]:
    return [ids[i:i + window] for i in range(0, len(ids) - window + 1, window)]


def scored(logprobs: list[float], window: int) -> list[float]:
    """The scored part of one window's logprobs (entry j - 1 is token j's): tokens window/2 + 1
    .. window - 1, as llama-perplexity counts them."""
    return logprobs[window // 2:window - 1]


def cpu_name() -> tuple[str, str]:
    """lscpu's model name and the AVX-512 / AMX flags that pick kernels here."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or platform.machine(), ""
    info = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = [f for f in info.get("Flags", "").split() if f.startswith(("avx512", "amx")) or f in ("avx2", "fma")]
    return info.get("Model name", "?").strip(), " ".join(flags)


def run_batchserve(opts: dict, wins: list[list[int]], window: int) -> dict:
    """Score the windows and the greedy prompts under one set of engine options."""
    from batchserve.llm import LLM
    from batchserve.request import SamplingParams

    llm = LLM(kv_cache_gb=0.25, **opts)
    runner = llm.engine.executor
    lps = [lp for w in wins for lp in scored(llm.prompt_logprobs(w), window)]
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True))
    m = runner.model
    mm = f"int{m.act_bits}" if m.act_bits and m.int_matrices else _dtype_name(m.matmul_dtype)
    return {"logprobs": lps, "greedy": [o.token_ids for o in outs], "kv": _dtype_name(runner.kv_dtype), "mm": mm,
            "amx": getattr(m, "prompt_layers", None) is not None}


def _dtype_name(dt) -> str:
    s = str(dt).split(".")[-1]
    return "int8" if s == "uint8" else s


def run_transformers(wins: list[list[int]], window: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from batchserve.runner.loader import resolve_model_path

    path = resolve_model_path("smollm2-135m-instruct")
    m = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                             dtype=torch.float32).eval()
    lps: list[float] = []
    with torch.no_grad():
        for w in wins:
            logp = torch.log_softmax(m(torch.tensor([w])).logits[0, :-1].float(), -1)
            lps += scored(logp.gather(1, torch.tensor(w[1:])[:, None]).squeeze(1).tolist(), window)
    return {"logprobs": lps, "greedy": None}


def run_llama_perplexity(binary: str, window: int, threads: int) -> dict:
    """llama.cpp's perplexity tool on the same GGUF file and text: its final estimate."""
    from batchserve.runner.loader import resolve_model_path

    cmd = [binary, "-m", resolve_model_path("smollm2-135m-instruct"), "-f", TEXT, "-c", str(window),
           "-b", str(window), "-t", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    text = out.stdout + out.stderr
    m = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", text)
    chunks = re.search(r"calculating perplexity over (\d+) chunks", text)
    if out.returncode != 0 or m is None:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {text[-500:]}")
    return {"ppl": float(m.group(1)), "pm": float(m.group(2)), "chunks": int(chunks.group(1)) if chunks else None,
            "cmd": " ".join(os.path.basename(c) if c.endswith(".gguf") else os.path.relpath(c) if c == TEXT else c
                            for c in cmd[1:])}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--window", type=int, default=512, help="tokens per window (the second half is scored)")
    p.add_argument("--llama-perplexity", default=None, help="llama.cpp's llama-perplexity binary, to run as well")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama-perplexity's threads")
    a = p.parse_args(argv)

    from batchserve.config import ModelConfig
    from batchserve.runner.loader import load_tokenizer

    tok = load_tokenizer(ModelConfig())
    with open(TEXT) as fh:
        ids = tok.encode(fh.read(), add_special_tokens=False)
    wins = windows(ids, a.window)
    configs: list[tuple[str, dict | None]] = [("transformers float32 (same GGUF, dequantized)", None),
                                              ("reference: dequantized float32", REFERENCE),
                                              ("defaults", {})]
    # each pair on its own products, prompts included (not on AMX tiles, which the defaults may take)
    configs += [(f"{mm} / {kv}", {"matmul_dtype": mm, "kv_cache_dtype": kv, "prompt_matmul": "off"})
                for mm in MATMUL for kv in KV]
    configs.append(("--dtype bfloat16", {"dtype": "bfloat16"}))
    results: dict[str, dict] = {}
    for name, opts in configs:
        try:
            results[name] = run_transformers(wins, a.window) if opts is None else run_batchserve(opts, wins, a.window)
        except (ValueError, RuntimeError) as e:  # an option this machine cannot run
            results[name] = {"error": f"{type(e).__name__}: {e}"}
        r = results[name]
        print(f"{name}: " + (r["error"] if "error" in r else f"ppl {math.exp(-np.mean(r['logprobs'])):.4f}"),
              file=sys.stderr, flush=True)
    llama = None
    if a.llama_perplexity:
        try:
            llama = run_llama_perplexity(a.llama_perplexity, a.window, a.threads)
        except (OSError, RuntimeError) as e:
            llama = {"error": str(e)}
        print(f"llama-perplexity: {llama}", file=sys.stderr)

    ref = results["reference: dequantized float32"]
    ref_lp = np.array(ref["logprobs"])
    model, flags = cpu_name()
    n_scored = len(ref_lp)
    lines = [TITLE, "", f"`python -m benchmarks.perplexity {' '.join(argv)}` — {datetime.date.today().isoformat()}, "
             f"{model} ({os.cpu_count()} cores; flags {flags or 'n/a'}), Python {platform.python_version()}. "
             f"Text: benchmarks/data/pd_english.txt ({len(ids)} tokens), {len(wins)} non-overlapping windows of "
             f"{a.window} tokens, each scored on its second half ({n_scored} tokens in all; llama-perplexity's "
             f"scheme). Model: SmolLM2-135M-Instruct, the Q4_1 GGUF file. Δ log P: against the reference row, over "
             f"the scored tokens. Greedy: the first {GREEDY_TOKENS} greedy tokens of {len(PROMPTS)} prompts against "
             "the reference's. matmul / KV: `--matmul-dtype` / `--kv-cache-dtype`.", "",
             "| configuration | perplexity | against the reference | mean / max abs Δ log P | greedy: identical "
             "prompts | greedy: mean tokens before a difference |", "|---|---|---|---|---|---|"]
    ref_ppl = math.exp(-ref_lp.mean())
    for name, _ in configs:
        r = results[name]
        if "error" in r:
            lines.append(f"| {name} | not run here: {r['error']} | | | | |")
            continue
        lp = np.array(r["logprobs"])
        d = np.abs(lp - ref_lp)
        label = name if name != "defaults" else (f"defaults (auto / auto: {r['mm']} / {r['kv']} here"
                                                 + (", prompts on AMX bf16 tiles)" if r.get("amx") else ")"))
        if r["greedy"] is None:
            same, prefix = "–", "–"
        else:
            pairs = list(zip(r["greedy"], ref["greedy"]))
            same = f"{sum(x == y for x, y in pairs)}/{len(pairs)}"
            firsts = [next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), len(x)) for x, y in pairs]
            prefix = f"{np.mean(firsts):.1f}"
        ppl = math.exp(-lp.mean())
        lines.append(f"| {label} | {ppl:.4f} | {(ppl / ref_ppl - 1) * 100:+.2f} % | {d.mean():.5f} / {d.max():.4f} "
                     f"| {same} | {prefix} |")
    if llama is not None:
        if "error" in llama:
            lines.append(f"| llama.cpp `llama-perplexity` | failed: {llama['error'][:200]} | | | | |")
        else:
            lines.append(f"| llama.cpp `llama-perplexity {llama['cmd']}` ({llama['chunks']} chunks; its own "
                         f"tokenizer and numerics) | {llama['ppl']:.4f} ± {llama['pm']:.4f} | "
                         f"{(llama['ppl'] / ref_ppl - 1) * 100:+.2f} % | – | – | – |")
    lines.append("")
    return publish("\n".join(lines), a.out, TITLE)


if __name__ == "__main__":
    sys.exit(main())
