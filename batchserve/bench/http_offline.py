"""The 64-request workload offline (LLMEngine in this process) and through `batchserve serve`
with 64 concurrent streaming clients: does the HTTP layer steal the model's cores?

    python -m batchserve.bench.http_offline --out BENCHMARKS.md      # a few minutes, quiet machine

Same requests both ways (foundation.offline_workload: prompts ~200 tokens median, 80% short / 20%
long outputs, greedy, ignore_eos, all sent at t = 0), same engine settings. Output tokens per
second is tokens over the span from the first send to the last token.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time

from batchserve.bench.client import ClientConfig, run
from batchserve.bench.foundation import offline_workload, publish, run_offline
from batchserve.bench.standard import running_server
from batchserve.bench.workload import WorkItem

TITLE = "## HTTP vs offline: the 64-request workload through `serve` with 64 streaming clients"
ENGINE_FLAGS = ["--kv-cache-gb", "2", "--max-num-seqs", "64", "--max-num-batched-tokens", "2048"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    from batchserve.llm import LLM

    llm = LLM(kv_cache_gb=2.0, max_num_seqs=64, max_num_batched_tokens=2048)
    work = offline_workload(a.requests, a.seed, llm.engine.executor.cfg.vocab_size)
    run_offline(llm, work[:4])  # warm-up (kernel build, allocator)
    offline = run_offline(llm, work)
    del llm
    print(f"offline: {offline['tok_s']:.1f} tok/s ({offline['tokens']} tokens, {offline['seconds']:.1f} s)",
          file=sys.stderr)

    items = [WorkItem(0.0, len(ids), None, ids, m) for ids, m in work]
    with running_server(ENGINE_FLAGS) as url:
        run([WorkItem(0.0, len(ids), None, ids, m) for ids, m in work[:4]], ClientConfig(url, progress=False))
        t0 = time.perf_counter()
        res = run(items, ClientConfig(url, progress=False, extensions=False))
        wall = time.perf_counter() - t0
    ok = [r for r in res.records if r.ok]
    tokens = sum(r.output_tokens for r in res.records)
    http_tok_s = tokens / res.duration_s
    ratio = http_tok_s / offline["tok_s"]
    print(f"http: {http_tok_s:.1f} tok/s ({tokens} tokens, {res.duration_s:.1f} s; {len(ok)}/{len(items)} ok)",
          file=sys.stderr)
    lines = [TITLE, "", f"`python -m batchserve.bench.http_offline {' '.join(argv or sys.argv[1:])}` — "
             f"{datetime.date.today().isoformat()}, {platform.machine()}, {os.cpu_count()} cores. Engine flags "
             f"`{' '.join(ENGINE_FLAGS)}` (continuous policy, default threads) both ways.", "",
             "| path | requests ok | output tokens | span (s) | output tok/s |", "|---|---|---|---|---|",
             f"| offline (LLMEngine.step in this process) | {a.requests}/{a.requests} | {offline['tokens']} | "
             f"{offline['seconds']:.1f} | {offline['tok_s']:.1f} |",
             f"| `serve` + {len(items)} streaming HTTP clients | {len(ok)}/{len(items)} | {tokens} | "
             f"{res.duration_s:.1f} | {http_tok_s:.1f} |", "",
             f"HTTP / offline = **{ratio:.2f}** (target ≥ 0.90: {'met' if ratio >= 0.9 else 'not met'}). "
             f"The client ran in the benchmark process on the same 2 cores (wall {wall:.1f} s).", ""]
    text = "\n".join(lines)
    return publish(text, a.out, TITLE)


if __name__ == "__main__":
    sys.exit(main())
