"""Sampling cost per step: `runner.sampler.sample` on the default model's real logits (24 chat
prompts' next-token rows, repeated to the batch size), for greedy and the usual sampled settings;
then the 64-request offline workload (as in the foundation section) sampled with temperature 0.7
and top_p 0.9, whose output rate reads against the greedy one of the foundation section.

    python -m benchmarks.sampling --out BENCHMARKS.md
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import time

import torch

from batchserve.request import SamplingParams
from batchserve.runner.sampler import sample
from benchmarks.report_md import publish
from benchmarks.roofline import median_time

TITLE = "## Sampling cost per step"
SETTINGS = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature 1 (the server's default)": SamplingParams(temperature=1.0),
    "temperature 0.7, top_p 0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "temperature 0.7, top_k 50, top_p 0.9": SamplingParams(temperature=0.7, top_k=50, top_p=0.9),
}


def chat_logits() -> torch.Tensor:
    """The default model's next-token logits after each of the 24 chat prompts, [24, V]."""
    from batchserve.core.batch import ScheduledBatch, ScheduledSeq
    from batchserve.core.kv_cache import KVCacheManager
    from batchserve.engine.engine import tokenize
    from batchserve.llm import LLM
    from benchmarks.variants import QUESTIONS

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


def sampled_workload(requests: int) -> float:
    """Output tok/s of the offline workload sampled with temperature 0.7 / top_p 0.9 (seeded),
    after a four-request warm-up in the same engine."""
    from batchserve.llm import LLM
    from benchmarks.foundation import offline_workload

    llm = LLM(kv_cache_gb=2.0, max_num_seqs=64, max_num_batched_tokens=2048)
    eng = llm.engine
    work = offline_workload(requests, 0, eng.executor.cfg.vocab_size)
    rate = 0.0
    for jobs in (work[:4], work):  # the warm-up, then the measured run
        t0 = time.perf_counter()
        for i, (ids, m) in enumerate(jobs):
            eng.add_request(ids, SamplingParams(max_tokens=m, temperature=0.7, top_p=0.9, seed=i, ignore_eos=True))
        ntok = 0
        while eng.has_unfinished:
            ntok += sum(len(o.new_token_ids) for o in eng.step().outputs)
        rate = ntok / (time.perf_counter() - t0)
    return rate


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--batches", default="1,8,32,64,128,256")
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
            t = median_time(lambda: sample(logits, params, idx, g), 9)
            cells.append(f"{t * 1e3:.2f} ms")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    text = (f"{TITLE}\n\n`python -m benchmarks.sampling`, {datetime.datetime.now():%Y-%m-%d %H:%M}; "
            f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} "
            f"threads. `sample()` per step on SmolLM2's logits (vocabulary {base.shape[1]}), all rows with the "
            "setting; median of 9.\n\n"
            + "\n".join(rows) + "\n")
    if a.requests:
        rate = sampled_workload(a.requests)
        text += (f"\nThe {a.requests}-request offline workload (foundation section) sampled with temperature 0.7 "
                 f"and top_p 0.9 (seeded, ignore_eos): **{rate:.0f}** output tok/s.\n")
    return publish(text, a.out, TITLE)


if __name__ == "__main__":
    raise SystemExit(main())
