"""Every batching policy on the same workloads, real model, one run, one table.

    python -m benchmarks.policies --out policies.md            # a few minutes on 2 cores
    python -m benchmarks.policies --quick --model dummy --out /tmp/p.md   # a smoke check

Workloads (from `bench.workload`, scaled to a small CPU):
  (a) short-long — the seed's static-vs-continuous case: 90% short requests, 10% with very
      long outputs, arriving over time (Poisson).
  (b) mixed — the seed's token-level case: code-gen / summaries / chat with very different
      prompt and output lengths; (c) the same mix offered above capacity, so that throughput
      measures what each policy can do rather than the arrival rate.
The model is loaded once; each policy gets a fresh engine (scheduler + KV bookkeeping) over
the shared runner, driven in a wall-clock loop that adds each request when its arrival time
comes (its send time is the arrival time, so time spent waiting for a step to end counts).
Outputs are greedy with EOS ignored, so every policy generates exactly the same tokens.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import time
from collections import deque
from dataclasses import dataclass

from batchserve.bench.metrics import SLO, RequestRecord, span_s, summarize
from batchserve.bench.workload import WorkItem, make_workload
from batchserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from batchserve.core.batch import ScheduledBatch, StepOutput
from batchserve.engine.engine import LLMEngine
from batchserve.request import SamplingParams
from batchserve.runner.profiler import TINY_MODEL
from benchmarks.report_md import write_section

# per-policy settings: the seed's figures where it gives them (static: 200 ms window, 32 per
# batch; cascade: prefill 64 / decode 16), otherwise the config defaults
POLICY_SETTINGS: dict[str, dict] = {
    "static": dict(policy="static", window_ms=200.0, max_batch=32),
    "dynamic": dict(policy="dynamic", max_batch=32, window_max_ms=120.0, bucket_by_length=True),
    # the same two paying their padding: the runner computes the rows a padded engine would
    "static-padded": dict(policy="static", window_ms=200.0, max_batch=32, pay_padding=True),
    "dynamic-padded": dict(policy="dynamic", max_batch=32, window_max_ms=120.0, bucket_by_length=True,
                           pay_padding=True),
    "continuous": dict(policy="continuous"),
    "chunked": dict(policy="chunked", chunk_size=64),
    "cascade": dict(policy="cascade", prefill_max_batch=64, decode_max_batch=16),
}


# static and dynamic run ragged request-level batches, so their times are those of a padded
# implementation less its padding; the -padded rows pay it. Said next to every number that could
# be mistaken for a padded baseline's.
PADDING_NOTE = ("**Padding: accounted in static / dynamic, computed in static-padded / dynamic-padded.** "
                "static and dynamic run their batches ragged, as every policy does: their padding is the share "
                "of a padded batch's tokens that would have been padding, counted but never executed, so their "
                "throughput and latencies are better than a padded implementation's would be. The -padded rows "
                "are the same policies with `pay_padding`: the runner also runs those padding rows (prompts "
                "padded to the batch's longest, a decode row per finished member until the batch ends) through "
                "every layer, results discarded, as a padded engine would spend them.")


def padding_paid(name: str) -> bool:
    return bool(POLICY_SETTINGS[name].get("pay_padding"))


@dataclass(frozen=True)
class Workload:
    name: str
    mix: str
    n: int
    rate: float
    scale: float
    short_cls: str | None = None  # the class whose E2E P99 the seed's target is about


def workloads(quick: bool) -> list[Workload]:
    if quick:
        return [Workload("a: short-long", "short-long", 4, 20.0, 0.05, "short"),
                Workload("b: mixed", "mixed", 3, 20.0, 0.01)]
    return [Workload("a: short-long", "short-long", 40, 4.0, 0.25, "short"),
            Workload("b: mixed", "mixed", 24, 1.2, 0.06),
            # above capacity (all 60 within ~1.5 s, faster than any policy serves them):
            # throughput is then what each policy can do, not the offered load
            Workload("c: mixed, overload", "mixed", 60, 40.0, 0.06)]


class CountingExecutor:
    """The shared runner, counting steps and computed tokens for one engine."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.num_blocks, self.max_model_len, self.cfg = runner.num_blocks, runner.max_model_len, runner.cfg
        self.steps = 0
        self.tokens = 0

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        self.steps += 1
        self.tokens += batch.num_tokens
        return self.runner.execute(batch)


def run_one(runner, tokenizer, eos, items: list[WorkItem], sched: dict, block_size: int,
            prefix_caching: bool, slo_ms: float | None, slo: SLO | None = None, ignore_eos: bool = True) -> dict:
    """Drive one engine through the workload on the wall clock; summary + policy stats. `slo`:
    targets beside `slo_ms` (end to end) that the summary's goodput judges; `ignore_eos` off:
    outputs end at the model's EOS, not only at their max_tokens."""
    cfg = EngineConfig(cache=CacheConfig(block_size=block_size, num_blocks=runner.num_blocks,
                                         prefix_caching=prefix_caching),
                       scheduler=SchedulerConfig(slo_p99_ms=slo_ms, **sched))
    ex = CountingExecutor(runner)
    eng = LLMEngine(cfg, ex, tokenizer, eos)
    clock = eng.clock
    pending = deque(sorted(items, key=lambda it: it.arrival))
    recs: dict[str, RequestRecord] = {}
    usage: list[float] = []
    t0 = clock.now()
    while pending or eng.has_unfinished:
        now = clock.now()
        while pending and t0 + pending[0].arrival <= now:
            it = pending.popleft()
            params = SamplingParams(max_tokens=it.max_tokens, temperature=0.0, ignore_eos=ignore_eos)
            req = eng.add_request(it.prompt_token_ids or it.prompt, params, now=t0 + it.arrival)
            recs[req.request_id] = RequestRecord(req.request_id, cls=it.cls, send_time=t0 + it.arrival,
                                                 prompt_tokens=req.num_prompt_tokens, status=200)
        if not eng.has_unfinished:
            time.sleep(max(0.0, min(0.01, t0 + pending[0].arrival - now)))
            continue
        steps = ex.steps
        outs = eng.step().outputs
        t = clock.now()
        if ex.steps == steps:
            time.sleep(0.001)  # a request-level policy is collecting: don't spin
            continue
        usage.append(eng.kv.usage)
        for o in outs:
            r = recs[o.request_id]
            if o.new_token_ids:
                r.token_times.append(t)
                r.first_token_time = r.first_token_time or t
            if o.finished:
                r.end_time, r.output_tokens, r.finish_reason = t, len(o.token_ids), o.finish_reason
    records = list(recs.values())
    pol = eng.scheduler.policy
    return {"summary": summarize(records, span_s(records), slo_ms, slo), "steps": ex.steps, "tokens": ex.tokens,
            "padding": getattr(pol, "padding_fraction", 0.0), "kv_mean": sum(usage) / max(1, len(usage)),
            "kv_peak": max(usage, default=0.0), "prefix_hit_rate": eng.kv.prefix_hit_rate,
            "preemptions": eng.scheduler.num_preemptions,
            "final_window_ms": getattr(pol, "window_ms", None), "final_max_batch": getattr(pol, "max_batch", None)}


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def _padding(name: str, share: float) -> str:
    if not share:
        return "0%"
    return f"{share:.0%} " + ("run" if padding_paid(name) else "accounted")


def table(results: list[tuple[Workload, str, dict]]) -> str:
    head = ("| workload | policy | out tok/s | TTFT P50 | TTFT P99 | E2E P50 | E2E P99 | short E2E P99 "
            "| padding (share; run or only accounted) | KV mean / peak | steps |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for w, name, r in results:
        s = r["summary"]
        lat = s["latency"]
        short = s["per_class"].get(w.short_cls, {}).get("latency", {}).get("e2e_ms", {}).get("p99") \
            if w.short_cls else None
        lines.append(f"| {w.name} | {name} | {s['output_tokens_per_s']:.1f} | {_ms(lat['ttft_ms']['p50'])} | "
                     f"{_ms(lat['ttft_ms']['p99'])} | {_ms(lat['e2e_ms']['p50'])} | {_ms(lat['e2e_ms']['p99'])} | "
                     f"{_ms(short)} | {_padding(name, r['padding'])} | {r['kv_mean']:.0%} / {r['kv_peak']:.0%} | "
                     f"{r['steps']} |")
    return "\n".join(lines)


def targets(results: list[tuple[Workload, str, dict]]) -> list[str]:
    """The seed's two figures, recomputed from this run."""
    by = {(w.mix, n): (w, r) for w, n, r in results}  # the last workload of a mix wins: the overload one
    out = []
    if ("short-long", "static") in by and ("short-long", "continuous") in by:
        def short_p99(key):
            w, r = by[key]
            return r["summary"]["per_class"].get(w.short_cls, {}).get("latency", {}).get("e2e_ms", {}).get("p99")
        a, b = short_p99(("short-long", "static")), short_p99(("short-long", "continuous"))
        if a and b:
            out.append(f"- (a) short requests' E2E P99, static / continuous: {a / b:.2f}x (seed: >= 2.5x)")
    if ("mixed", "chunked") in by:
        tp = {n: by[("mixed", n)][1]["summary"]["output_tokens_per_s"]
              for n in ("static", "dynamic", "static-padded", "dynamic-padded") if ("mixed", n) in by}
        chunked = by[("mixed", "chunked")][1]["summary"]["output_tokens_per_s"]
        for paid, how in ((False, "padding accounted"), (True, "padding paid")):
            req = [v for k, v in tp.items() if padding_paid(k) == paid]
            if req:
                out.append(f"- (b) token-level (chunked) / best request-level throughput, {how}: "
                           f"{chunked / max(req):.2f}x (seed: >= 1.5x)")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="write the markdown table here")
    p.add_argument("--json", default=None, help="write every summary here")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--policies", default=",".join(POLICY_SETTINGS))
    p.add_argument("--quick", action="store_true", help="a handful of tiny requests: a smoke check")
    p.add_argument("--prefix-caching", action="store_true")
    p.add_argument("--kv-cache-gb", type=float, default=0.5)
    p.add_argument("--slo-ms", type=float, default=10_000.0, help="dynamic policy's P99 target")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    from batchserve.runner.loader import load_model
    from batchserve.runner.model_runner import ModelRunner

    names = [n.strip() for n in a.policies.split(",") if n.strip()]
    unknown = set(names) - set(POLICY_SETTINGS)
    if unknown:
        p.error(f"unknown policies {sorted(unknown)}")
    # `dummy`: random weights of a tiny model whose vocabulary covers the workload's token ids
    dummy = dict(TINY_MODEL, vocab_size=32768) if a.model == "dummy" else None
    mcfg, ccfg = ModelConfig(model=a.model, dummy_config=dummy), CacheConfig(kv_cache_gb=a.kv_cache_gb)
    loaded = load_model(mcfg)
    runner = ModelRunner(loaded, mcfg, ccfg)
    eos = loaded.config.eos_token_id
    warm = make_workload("chat", 4, 100.0, seed=99, scale=0.05)
    run_one(runner, loaded.tokenizer, eos, warm, POLICY_SETTINGS["continuous"], ccfg.block_size, False, a.slo_ms)
    results = []
    t_start = time.perf_counter()
    for w in workloads(a.quick):
        items = make_workload(w.mix, w.n, w.rate, seed=a.seed, scale=w.scale)
        for name in names:
            t = time.perf_counter()
            r = run_one(runner, loaded.tokenizer, eos, items, POLICY_SETTINGS[name], ccfg.block_size,
                        a.prefix_caching, a.slo_ms)
            results.append((w, name, r))
            print(f"{w.name:14s} {name:10s} {r['summary']['output_tokens_per_s']:7.1f} tok/s "
                  f"({time.perf_counter() - t:.1f} s)", flush=True)
    text = "\n".join([
        f"## Batching policies ({datetime.date.today()}, {platform.machine()}, {loaded.name}, "
        f"{time.perf_counter() - t_start:.0f} s)", "",
        "Output tokens/s over the run (first arrival to last result); latencies in ms; KV: share of the pool "
        "in use per step.", "",
        PADDING_NOTE, "",
        *(f"- {w.name}: {w.n} requests, mix `{w.mix}` x {w.scale}, Poisson {w.rate}/s" for w in workloads(a.quick)),
        "", table(results), "", *targets(results), ""])
    print(text)
    if a.out:
        write_section(a.out, "## Batching policies", text + "\n")
    if a.json:
        with open(a.json, "w") as f:
            json.dump([{"workload": w.name, "policy": n, **r} for w, n, r in results], f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
