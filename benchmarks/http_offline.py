"""The 64-request workload offline (LLMEngine in this process) and through `batchserve serve`
with 64 concurrent streaming clients: does the HTTP layer steal the model's cores?

    python -m benchmarks.http_offline --out BENCHMARKS.md      # a few minutes, quiet machine

Same requests both ways (foundation.offline_workload: prompts ~200 tokens median, 80% short / 20%
long outputs, greedy, ignore_eos, all sent at t = 0), same engine settings. Output tokens per
second is tokens over the span from the first send to the last token. The two runs alternate
(`--rounds`, default 3) and the median of the rounds' ratios is reported: this machine's speed
drifts from minute to minute by more than the HTTP layer costs.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

from batchserve.bench.client import ClientConfig, run
from batchserve.bench.workload import WorkItem
from benchmarks.foundation import offline_workload, run_offline
from benchmarks.report_md import publish
from benchmarks.standard import running_server

TITLE = "## HTTP vs offline: the 64-request workload through `serve` with 64 streaming clients"
ENGINE_FLAGS = ["--kv-cache-gb", "2", "--max-num-seqs", "64", "--max-num-batched-tokens", "2048"]


def _server_stack() -> str:
    import importlib.util

    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    return f"uvicorn on {loop} + {http}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=3,
                   help="offline and HTTP runs alternate this many times (this machine's speed drifts)")
    a = p.parse_args(argv)

    from batchserve.llm import LLM

    llm = LLM(kv_cache_gb=2.0, max_num_seqs=64, max_num_batched_tokens=2048)
    work = offline_workload(a.requests, a.seed, llm.engine.executor.cfg.vocab_size)
    items = [WorkItem(0.0, len(ids), None, ids, m) for ids, m in work]
    run_offline(llm, work[:4])  # warm-up (kernel build, allocator)
    rows: list[tuple[dict, float, int, float, int, float]] = []
    with running_server(ENGINE_FLAGS) as url:  # the offline engine idles while the server runs, and back
        run([WorkItem(0.0, len(ids), None, ids, m) for ids, m in work[:4]], ClientConfig(url, progress=False))
        for r in range(a.rounds):
            offline = run_offline(llm, work)
            c0 = time.process_time()
            res = run(items, ClientConfig(url, progress=False, extensions=False))
            client_cpu = time.process_time() - c0
            ok = sum(1 for x in res.records if x.ok)
            tokens = sum(x.output_tokens for x in res.records)
            http = tokens / res.duration_s
            rows.append((offline, http, tokens, res.duration_s, ok, client_cpu))
            print(f"round {r + 1}: offline {offline['tok_s']:.1f} tok/s, http {http:.1f} tok/s "
                  f"({ok}/{len(items)} ok, client CPU {client_cpu:.2f} s)", file=sys.stderr)
    ratios = [h / o["tok_s"] for o, h, *_ in rows]
    median = statistics.median(ratios)
    lines = [TITLE, "", f"`python -m benchmarks.http_offline {' '.join(argv or sys.argv[1:])}` — "
             f"{datetime.date.today().isoformat()}, {platform.machine()}, {os.cpu_count()} cores; server "
             f"{_server_stack()}, client aiohttp. Engine flags `{' '.join(ENGINE_FLAGS)}` (continuous policy, "
             f"default threads) both ways; {a.requests} requests, the offline run (LLMEngine.step in this process) "
             f"and the HTTP run (`serve` + {len(items)} streaming clients, sent at once) alternating.", "",
             "| round | offline tok/s (span s) | HTTP ok | HTTP tokens | HTTP tok/s (span s) | HTTP / offline "
             "| client CPU s |", "|---|---|---|---|---|---|---|"]
    for i, ((o, h, tokens, span, ok, cpu), q) in enumerate(zip(rows, ratios)):
        lines.append(f"| {i + 1} | {o['tok_s']:.1f} ({o['seconds']:.1f}) | {ok}/{len(items)} | {tokens} "
                     f"(offline {o['tokens']}) | {h:.1f} ({span:.1f}) | {q:.2f} | {cpu:.2f} |")
    lines += ["", f"HTTP / offline, median of the rounds = **{median:.2f}** (target ≥ 0.90: "
              f"{'met' if median >= 0.9 else 'not met'}); rounds {min(ratios):.2f}–{max(ratios):.2f}. The client "
              f"ran in the benchmark process on the same {os.cpu_count()} cores: its CPU is taken from the model's.",
              ""]
    return publish("\n".join(lines), a.out, TITLE)


if __name__ == "__main__":
    sys.exit(main())
