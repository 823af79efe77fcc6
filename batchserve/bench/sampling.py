"""Sampling cost per step: `runner.sampler.sample` on the default model's real logits (24 chat
prompts' next-token rows, repeated to the batch size), for greedy and the usual sampled settings,
beside the per-row PyTorch implementation it replaced (session 7); then the 64-request offline
workload (as in the foundation section) sampled with temperature 0.7 and top_p 0.9, with each.

    python -m batchserve.bench.sampling --out BENCHMARKS.md      # about two minutes
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import time

import torch

from batchserve.bench.foundation import publish
from batchserve.bench.roofline import median_time
from batchserve.request import SamplingParams
from batchserve.runner.sampler import _generator, sample

TITLE = "## Sampling cost per step"
SETTINGS = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature 1 (the server's default)": SamplingParams(temperature=1.0),
    "temperature 0.7, top_p 0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "temperature 0.7, top_k 50, top_p 0.9": SamplingParams(temperature=0.7, top_k=50, top_p=0.9),
}


def per_row(logits: torch.Tensor, params: list[SamplingParams], output_index: list[int],
            generator: torch.Generator) -> list[int]:
    """The sampler before session 7, kept here only to measure against: PyTorch ops row by row
    (softmax, a full sort for top-p, multinomial)."""
    out = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = logits[i] / p.temperature
        if p.top_k and p.top_k < row.shape[0]:
            row = row.masked_fill(row < torch.topk(row, p.top_k).values[-1], float("-inf"))
        if p.top_p < 1.0:
            sorted_l, order = torch.sort(row, descending=True)
            probs = torch.softmax(sorted_l, dim=-1)
            row = row.scatter(0, order[probs.cumsum(-1) - probs > p.top_p], float("-inf"))
        gen = generator if p.seed is None else _generator(p.seed, output_index[i], logits.device)
        out[i] = int(torch.multinomial(torch.softmax(row, dim=-1), 1, generator=gen).item())
    return out


def chat_logits() -> torch.Tensor:
    """The default model's next-token logits after each of the 24 chat prompts, [24, V]."""
    from batchserve.bench.variants import QUESTIONS
    from batchserve.core.batch import ScheduledBatch, ScheduledSeq
    from batchserve.core.kv_cache import KVCacheManager
    from batchserve.engine.engine import tokenize
    from batchserve.llm import LLM

    llm = LLM(kv_cache_gb=0.25)
    runner = llm.engine.executor
    kv = KVCacheManager(runner.num_blocks, runner.block_size)
    seqs = []
    for i, q in enumerate(QUESTIONS):
        ids = tokenize(llm.tokenizer, messages=[{"role": "user", "content": q}])
        kv.allocate(f"q{i}", len(ids))
        seqs.append(ScheduledSeq(f"q{i}", ids, 0, kv.block_table(f"q{i}"), True, SETTINGS["greedy"], 0))
    with torch.inference_mode():
        return runner.compute_logits(ScheduledBatch(seqs)).clone()


def sampled_workload(requests: int) -> dict[str, float]:
    """Output tok/s of the offline workload sampled with temperature 0.7 / top_p 0.9 (seeded), with
    the sampler and with the old per-row one in the same engine."""
    import batchserve.runner.model_runner as model_runner
    from batchserve.bench.foundation import offline_workload
    from batchserve.llm import LLM

    llm = LLM(kv_cache_gb=2.0, max_num_seqs=64, max_num_batched_tokens=2048)
    eng = llm.engine
    work = offline_workload(requests, 0, eng.executor.cfg.vocab_size)
    out = {}
    for name, fn in (("warm-up", sample), ("per-row PyTorch ops (before)", per_row), ("sample_rows (now)", sample)):
        model_runner.sample = fn
        try:
            jobs = work[:4] if name == "warm-up" else work
            t0 = time.perf_counter()
            for i, (ids, m) in enumerate(jobs):
                eng.add_request(ids, SamplingParams(max_tokens=m, temperature=0.7, top_p=0.9, seed=i, ignore_eos=True))
            ntok = 0
            while eng.has_unfinished:
                ntok += sum(len(o.new_token_ids) for o in eng.step())
            out[name] = ntok / (time.perf_counter() - t0)
        finally:
            model_runner.sample = sample
    del out["warm-up"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--batches", default="1,8,32,64,128,256")
    ap.add_argument("--old-max-batch", type=int, default=64, help="largest batch to time the old sampler at")
    ap.add_argument("--requests", type=int, default=64, help="sampled offline workload size (0: skip)")
    a = ap.parse_args(argv)
    base = chat_logits()
    batches = [int(b) for b in a.batches.split(",")]
    g = torch.Generator().manual_seed(0)
    rows = ["| setting | " + " | ".join(f"B={b}" for b in batches) + " |", "|---" * (len(batches) + 1) + "|"]
    for name, p in SETTINGS.items():
        cells = []
        for b in batches:
            logits = base[torch.arange(b) % base.shape[0]].contiguous()
            params, idx = [p] * b, [0] * b
            new = median_time(lambda: sample(logits, params, idx, g), 9)
            cell = f"{new * 1e3:.2f} ms"
            if b <= a.old_max_batch:
                old = median_time(lambda: per_row(logits, params, idx, g), 3)
                cell += f" (was {old * 1e3:.1f}; {old / new:.0f}x)"
            cells.append(cell)
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    text = (f"{TITLE}\n\n`python -m batchserve.bench.sampling`, {datetime.datetime.now():%Y-%m-%d %H:%M}; "
            f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} "
            f"threads. `sample()` per step on SmolLM2's logits (vocabulary {base.shape[1]}), all rows with the "
            f"setting; median of 9 (the old per-row sampler: of 3, up to batch {a.old_max_batch}).\n\n"
            + "\n".join(rows) + "\n")
    if a.requests:
        w = sampled_workload(a.requests)
        old, new = w["per-row PyTorch ops (before)"], w["sample_rows (now)"]
        text += (f"\nThe {a.requests}-request offline workload (foundation section) sampled with temperature 0.7 "
                 f"and top_p 0.9 (seeded, ignore_eos), same engine: {old:.0f} output tok/s with the per-row "
                 f"sampler, **{new:.0f}** with `sample_rows` ({new / old:.2f}x).\n")
    return publish(text, a.out, TITLE)


if __name__ == "__main__":
    raise SystemExit(main())
