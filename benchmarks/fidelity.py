"""Fidelity: the simulator against the live engine, on this machine and this model.

    python -m benchmarks.fidelity                          # SmolLM2-135M: profile, 3 rates
    python -m benchmarks.fidelity --profile prof.json --rates 0.5,1,1.5 --out BENCHMARKS.md

1. Profile the model (`batchserve profile`: step time of the runner over prompt tokens,
   decode sequences and context), or load `--profile`.
2. Calibration on a warm-up live run (another seed): the profile times the runner alone,
   while the live engine also schedules, updates and detokenizes every step, so the mean
   of (engine step - runner time) is added to each predicted step; and measured / profiled
   runner time, summed over the steps, scales the profile, should the machine run slower or
   faster now than when it was profiled (~1.0 on a quiet machine).
3. Rates: `--rates`, or 30% / 50% / 70% of the simulated saturation throughput.
4. Per rate, the same workload twice: live (this process, wall clock; requests are added to
   the engine between steps at their arrival times, as the server's engine thread adds them;
   ignore_eos, so outputs have the workload's lengths) and simulated (same engine config,
   profiled cost). Throughput and P50 end-to-end latency should agree within 5%, P99
   within 10%; the table says which do.
Run it on a quiet machine: other load on the CPU slows the live side only.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any

from batchserve.bench.metrics import RequestRecord, span_s, summarize
from batchserve.bench.workload import WorkItem, make_workload
from batchserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from batchserve.request import SamplingParams
from batchserve.runner.profiler import run_profile, save
from batchserve.sim.cost import ProfiledCost, has_prompt
from batchserve.sim.runner import simulate
from batchserve.sim.simulator import prompt_ids
from benchmarks.report_md import write_section

TOLERANCE = {"throughput_rps": 0.05, "e2e_p50_ms": 0.05, "e2e_p99_ms": 0.10}


class TimedExecutor:
    """The live runner, timed and counted as SimExecutor counts (steps, tokens, busy time):
    what the engine spends outside it is host overhead; the profile's prediction for the same
    batches (`cost`) gives the runner's speed relative to it."""

    def __init__(self, runner: Any, cost: ProfiledCost | None = None) -> None:
        self.runner, self.cost = runner, cost
        self.num_blocks, self.max_model_len, self.cfg = runner.num_blocks, runner.max_model_len, runner.cfg
        self.reset()

    def reset(self) -> None:
        self.num_steps = self.num_tokens = 0
        self.busy_time = self.predicted = self.last = 0.0  # runner seconds: summed, predicted, last step
        self.prompt_busy = self.prompt_predicted = 0.0  # the same over steps with prompt tokens

    def execute(self, batch: Any) -> Any:
        t0 = time.perf_counter()
        out = self.runner.execute(batch)
        self.last = time.perf_counter() - t0
        self.num_steps += 1
        self.num_tokens += batch.num_tokens
        self.busy_time += self.last
        if self.cost is not None:
            p = self.cost.runner_time(batch)
            self.predicted += p
            if has_prompt(batch):
                self.prompt_busy += self.last
                self.prompt_predicted += p
        return out


def live_run(engine: Any, items: list[WorkItem]) -> tuple[list[RequestRecord], list[float]]:
    """Drive `engine` (on its wall clock) with `items` at their arrival times. Returns the
    records (times in seconds from the start) and each model step's host overhead."""
    runner = engine.executor
    vocab = runner.cfg.vocab_size
    recs: dict[str, RequestRecord] = {}
    order: list[RequestRecord] = []
    overheads: list[float] = []
    t0 = time.perf_counter()
    i = 0
    while i < len(items) or engine.has_unfinished:
        now = time.perf_counter() - t0
        while i < len(items) and items[i].arrival <= now:
            w = items[i]
            rec = RequestRecord(id=f"r{i}", cls=w.cls, priority=w.priority, send_time=w.arrival,
                                prompt_tokens=w.prompt_len, status=200)
            ids = [t % vocab for t in prompt_ids(w, i)]  # a tiny test model has a tiny vocabulary
            engine.add_request(ids, SamplingParams(max_tokens=w.max_tokens, temperature=0.0, ignore_eos=True),
                               request_id=rec.id, priority=w.priority)
            recs[rec.id] = rec
            order.append(rec)
            i += 1
        if not engine.has_unfinished:
            time.sleep(max(0.0, items[i].arrival - (time.perf_counter() - t0)))
            continue
        runner.last = -1.0
        s0 = time.perf_counter()
        outs = engine.step().outputs
        t = time.perf_counter() - t0
        if runner.last >= 0:
            overheads.append(time.perf_counter() - s0 - runner.last)
        elif i < len(items):  # nothing ran: a window is open; wait a little, as the server does
            time.sleep(min(0.002, max(0.0, items[i].arrival - (time.perf_counter() - t0))))
        for out in outs:
            rec = recs[out.request_id]
            if out.new_token_ids:
                rec.first_token_time = rec.first_token_time or t
                rec.token_times.append(t)
            if out.finished:
                rec.end_time, rec.finish_reason, rec.output_tokens = t, out.finish_reason, len(out.token_ids)
    return order, overheads


def _numbers(summary: dict[str, Any]) -> dict[str, float]:
    e = summary["latency"]["e2e_ms"]
    return {"throughput_rps": summary["throughput_rps"], "e2e_p50_ms": e["p50"], "e2e_p99_ms": e["p99"]}


def calibrated(profile: str, timed: TimedExecutor, overheads: list[float]) -> ProfiledCost:
    """The profile plus what a live run measured: the host overhead per step, and the runner's
    time over the profile's prediction, apart for decode-only steps and steps with prompt tokens
    (`ProfiledCost`'s `scale` and `prompt_scale`; either kind missing takes the overall ratio).
    Means, not medians: latency sums step times, so the occasional slow step counts."""
    overall = timed.busy_time / timed.predicted
    decodes = timed.predicted - timed.prompt_predicted
    return ProfiledCost(profile, num_blocks=timed.num_blocks, overhead_s=statistics.fmean(overheads),
                        scale=(timed.busy_time - timed.prompt_busy) / decodes if decodes > 0 else overall,
                        prompt_scale=timed.prompt_busy / timed.prompt_predicted if timed.prompt_predicted > 0
                        else overall)


def run_fidelity(config: EngineConfig, profile: str, n: int, rates: list[float] | None = None, seed: int = 0,
                 workload: str = "chat", scale: float | None = None, same_run: bool = False) -> list[dict[str, Any]]:
    """Live vs simulated at each rate; one row per rate with both sides' numbers and the
    relative errors. The engine (model load) is built once and reused between rates.
    Calibration comes from a warm-up run; with `same_run`, from each rate's own live run
    instead, which takes a machine whose speed drifts (a shared CI box) out of the
    comparison and leaves the scheduling and queueing to be checked."""
    from batchserve.engine.engine import LLMEngine

    live = LLMEngine.from_config(config)
    base = ProfiledCost(profile, num_blocks=live.executor.num_blocks)
    timed = live.executor = TimedExecutor(live.executor, base)

    def items(rate: float, s: int) -> list[WorkItem]:
        return make_workload(workload, n, rate, seed=s, scale=scale)

    probe = rates[len(rates) // 2] if rates else None
    if probe is None:  # warm up at a third of the runner-only saturation
        probe = simulate(config, base, items(1e4, seed + 100)).summary["throughput_rps"] / 3
    _, over = live_run(live, items(probe, seed + 100))
    cost = calibrated(profile, timed, over)
    if not rates:
        sat = simulate(config, cost, items(1e4, seed)).summary["throughput_rps"]
        rates = [round(f * sat, 3) for f in (0.3, 0.5, 0.7)]
    rows = []
    for rate in rates:
        wl = items(rate, seed)
        timed.reset()
        recs, over = live_run(live, wl)
        if same_run:
            cost = calibrated(profile, timed, over)
        got = _numbers(summarize(recs, span_s(recs)))
        want = _numbers(simulate(config, cost, wl).summary)
        err = {k: abs(want[k] - got[k]) / got[k] for k in got}
        rows.append({"rate": rate, "live": got, "sim": want, "rel_error": err,
                     "within": {k: err[k] <= TOLERANCE[k] for k in err}, "overhead_ms": 1e3 * cost.overhead_s,
                     "runner_scale": cost.scale, "prompt_scale": cost.prompt_scale})
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    within = "/".join(f"{100 * v:g}" for v in TOLERANCE.values())
    out = [f"| rate | req/s live / sim | E2E P50 ms live / sim | E2E P99 ms live / sim | within {within}% |",
           "|---|---|---|---|---|"]
    for r in rows:
        lv, sm, w = r["live"], r["sim"], r["within"]
        out.append(f"| {r['rate']:g} | {lv['throughput_rps']:.2f} / {sm['throughput_rps']:.2f} | "
                   f"{lv['e2e_p50_ms']:.0f} / {sm['e2e_p50_ms']:.0f} | "
                   f"{lv['e2e_p99_ms']:.0f} / {sm['e2e_p99_ms']:.0f} | "
                   + " ".join("yes" if w[k] else "NO" for k in TOLERANCE) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=ModelConfig.model)
    ap.add_argument("--profile", default=None, help="use this profile instead of measuring one")
    ap.add_argument("--rates", default=None, help="requests/s, comma-separated (default 30/50/70%% of saturation)")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--workload", default="chat")
    ap.add_argument("--scale", type=float, default=None)
    ap.add_argument("--kv-cache-gb", type=float, default=1.0)
    ap.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs)
    ap.add_argument("--out", default=None, help="markdown file to add the table to (e.g. BENCHMARKS.md)")
    a = ap.parse_args(argv)
    cfg = EngineConfig(model=ModelConfig(model=a.model), cache=CacheConfig(kv_cache_gb=a.kv_cache_gb),
                       scheduler=SchedulerConfig(max_num_seqs=a.max_num_seqs))
    path = a.profile
    if path is None:
        path = "fidelity_profile.json"
        save(run_profile(dataclasses.replace(cfg)), path)
    rates = [float(x) for x in a.rates.split(",")] if a.rates else None
    rows = run_fidelity(cfg, path, a.requests, rates, workload=a.workload, scale=a.scale)
    table = format_rows(rows)
    text = (f"## Simulator fidelity\n\nCommand: `python -m benchmarks.fidelity` — {a.model}, {a.workload} "
            f"workload, {a.requests} requests per rate, profile `{path}`; from a warm-up run: host overhead "
            f"{rows[0]['overhead_ms']:.2f} ms/step, runner {rows[0]['runner_scale']:.2f}x the profile on decode-only "
            f"steps, {rows[0]['prompt_scale']:.2f}x on steps with prompt tokens."
            f"\n\n{table}\n")
    print(text)
    if a.out:
        write_section(a.out, "## Simulator fidelity", text)


if __name__ == "__main__":
    main()
