"""The seed's four case studies live on this engine, beside the simulator on this machine's profile.

    python -m benchmarks.seed_cases --out BENCHMARKS.md          # ~15 minutes on 2 cores
    python -m benchmarks.seed_cases --size 0.01 --only priority-flood   # a smoke run

`batchserve simulate --scenario NAME` replays each case on an A100 roofline. Here the same
scenario code (`batchserve.scenarios`, its configs, workloads and load rules) runs twice:
- live: the real model (SmolLM2-135M by default) and the real engine, driven on the wall
  clock — each request added between steps at its arrival time, as the server's engine
  thread adds them (the offline engine: no interjection between layers);
- simulated: the same engine over `ProfiledCost`, the step-time model fitted to this
  machine by `batchserve profile` and calibrated on a warm-up live run (host overhead per
  step, runner speed against the profile), as `benchmarks.fidelity` does.
Each side sets its loads from its own measured saturation throughput, by the scenario's rule,
so a simulator that misjudges capacity also offers a different load; the table prints both.
Request counts are `--size` of the seed-scale counts and the mixed case's lengths are
`--mixed-scale` of the seed's, so that the whole run takes minutes on a CPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import time
from typing import Any, Sequence

from batchserve.bench.metrics import RequestRecord, span_s, summarize
from batchserve.bench.workload import WorkItem, make_workload
from batchserve.config import CacheConfig, EngineConfig, ModelConfig
from batchserve.request import OverloadedError, RequestError, SamplingParams
from batchserve.scenarios import SCENARIOS, Backend, ScenarioResult, fmt_cell, scenario_result
from batchserve.sim.cost import ProfiledCost
from batchserve.sim.simulator import SimResult, engine_stats, prompt_ids, record_output
from benchmarks.fidelity import TimedExecutor, calibrated
from benchmarks.perplexity import cpu_name
from benchmarks.report_md import write_section

TITLE = "## The seed's case studies, live and simulated on this machine"
BLOCK_SIZE = 16  # the scenarios' (scenarios/common.py)


class Live:
    """Runs an engine config over the real model on the wall clock; `run` is a Backend's."""

    def __init__(self, runner: Any, tokenizer: Any, eos: int | None, cost: ProfiledCost | None = None) -> None:
        self.executor = TimedExecutor(runner, cost)
        self.tokenizer, self.eos = tokenizer, eos
        self.overheads: list[float] = []  # engine step - runner time, per step that ran
        self.last_engine: Any = None  # the last run's, for inspection

    def run(self, config: EngineConfig, items: Sequence[WorkItem], slo_ms: float | None = None) -> SimResult:
        from batchserve.engine.engine import LLMEngine

        ex = self.executor
        ex.reset()
        cache = dataclasses.replace(config.cache, num_blocks=ex.num_blocks, prefix_caching=False)
        engine = self.last_engine = LLMEngine(dataclasses.replace(config, cache=cache), ex, self.tokenizer, self.eos)
        wall0 = time.perf_counter()
        records = self._drive(engine, items)
        duration = span_s(records)
        summary = summarize(records, duration, slo_ms) if duration > 0 else {}
        return SimResult(records, summary, ex.num_steps, ex.busy_time, time.perf_counter() - wall0,
                         engine_stats=engine_stats(engine, ex))

    def _drive(self, engine: Any, items: Sequence[WorkItem]) -> list[RequestRecord]:
        """Each item added at its arrival time (between steps); records in arrival order, times
        in seconds from the start."""
        ex, clock = self.executor, engine.clock
        order = sorted(range(len(items)), key=lambda k: items[k].arrival)
        records: list[RequestRecord] = []
        open_: dict[str, RequestRecord] = {}
        t0 = clock.now()
        i = 0
        while i < len(order) or engine.has_unfinished:
            now = clock.now() - t0
            while i < len(order) and items[order[i]].arrival <= now:
                k = order[i]
                i += 1
                records.append(self._add(engine, items[k], k, t0, open_))
            next_at = items[order[i]].arrival if i < len(order) else None
            if not engine.has_unfinished:
                time.sleep(max(0.0, next_at - (clock.now() - t0)))  # type: ignore[operator]
                continue
            steps, s0 = ex.num_steps, time.perf_counter()
            outs = engine.step().outputs
            t = clock.now() - t0
            if ex.num_steps > steps:
                self.overheads.append(time.perf_counter() - s0 - ex.last)
            for out in outs:
                rec = open_.get(out.request_id)
                if rec is not None and record_output(rec, out, t, True):
                    del open_[out.request_id]
            if ex.num_steps == steps and engine.has_unfinished:  # a window is collecting: wait, don't spin
                due = engine.next_step_due(clock.now())
                wait = 0.002 if due is None else due - clock.now()
                if next_at is not None:
                    wait = min(wait, next_at - t)
                time.sleep(min(0.002, max(0.0, wait)))
        return records

    def _add(self, engine: Any, item: WorkItem, k: int, t0: float, open_: dict[str, RequestRecord]) -> RequestRecord:
        rec = RequestRecord(id=f"r{k}", cls=item.cls, priority=item.priority, send_time=item.arrival,
                            prompt_tokens=item.prompt_len, deadline_ms=item.deadline_ms,
                            deadline_kind=item.deadline_kind)
        params = SamplingParams(max_tokens=item.max_tokens, temperature=0.0, ignore_eos=True)
        try:  # deadlines count from the arrival, not from the step boundary it waited for
            engine.add_request(prompt_ids(item, k), params, now=t0 + item.arrival, request_id=rec.id,
                               priority=item.priority, deadline_ms=item.deadline_ms, deadline_kind=item.deadline_kind)
        except OverloadedError as e:
            rec.status, rec.retry_after_s, rec.end_time, rec.error = 503, e.retry_after_s, item.arrival, str(e)
        except RequestError as e:
            rec.status, rec.end_time, rec.error = 400, item.arrival, str(e)
        else:
            rec.status = 200
            open_[rec.id] = rec
        return rec


def calibrate(live: Live, profile: str, seed: int) -> ProfiledCost:
    """The profile, plus a warm-up live run's host overhead per step and runner speed."""
    from batchserve.config import SchedulerConfig

    cfg = EngineConfig(cache=CacheConfig(block_size=BLOCK_SIZE), scheduler=SchedulerConfig(policy="continuous"))
    live.overheads.clear()
    live.run(cfg, make_workload("short-long", 60, 4.0, seed=seed + 100))
    return calibrated(profile, live.executor, live.overheads)


def side_by_side(sim: ScenarioResult, live: ScenarioResult) -> str:
    """One table: the seed's figure, this machine's simulation and the live run, before -> after."""
    b, a = live.before, live.after
    out = [f"### {live.name}: {live.title}", "", *(f"- live: {s}" for s in live.setup),
           *(f"- simulated: {s}" for s in sim.setup[-3:] if s not in live.setup), "",
           f"| metric | seed: {b} -> {a} | simulated: {b} -> {a} | live: {b} -> {a} | live direction | "
           "sim / live, after |", "|---|---|---|---|---|---|"]
    for rs, rl in zip(sim.rows, live.rows):
        def pair(x: float | None, y: float | None, unit: str = rl.unit) -> str:
            return f"{fmt_cell(x, unit)} -> {fmt_cell(y, unit)}"

        ratio = "-" if not rl.sim_after or rs.sim_after is None else f"{rs.sim_after / rl.sim_after:.2f}"
        out.append(f"| {rl.metric} | {pair(rl.seed_before, rl.seed_after)} | {pair(rs.sim_before, rs.sim_after)} | "
                   f"{pair(rl.sim_before, rl.sim_after)} | {rl.verdict()} | {ratio} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=ModelConfig.model)
    p.add_argument("--profile", default=None, help="a `batchserve profile` JSON of this machine (default: measure)")
    p.add_argument("--size", type=float, default=0.05, help="share of each scenario's seed-scale request count")
    p.add_argument("--mixed-scale", type=float, default=0.25, help="the mixed case's lengths, as a share of the seed's")
    p.add_argument("--only", default=",".join(SCENARIOS), help="scenarios to run, comma-separated")
    p.add_argument("--kv-cache-gb", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="markdown file to write the section to (e.g. BENCHMARKS.md)")
    a = p.parse_args(argv)
    names = [n.strip() for n in a.only.split(",") if n.strip()]
    bad = sorted(set(names) - set(SCENARIOS))
    if bad:
        p.error(f"--only: unknown scenarios {bad} (known: {', '.join(SCENARIOS)})")
    from batchserve.runner.loader import load_model
    from batchserve.runner.model_runner import ModelRunner
    from batchserve.runner.profiler import run_profile, save

    t_start = time.perf_counter()
    mcfg, ccfg = ModelConfig(model=a.model), CacheConfig(block_size=BLOCK_SIZE, kv_cache_gb=a.kv_cache_gb)
    path = a.profile
    if path is None:
        path = "seed_cases_profile.json"
        save(run_profile(EngineConfig(model=mcfg, cache=ccfg)), path)
    loaded = load_model(mcfg)
    runner = ModelRunner(loaded, mcfg, ccfg)
    live = Live(runner, loaded.tokenizer, loaded.config.eos_token_id,
                ProfiledCost(path, num_blocks=runner.num_blocks))
    cost = calibrate(live, path, a.seed)
    print(f"calibrated: host overhead {1e3 * cost.overhead_s:.2f} ms/step, runner {cost.scale:.2f}x the profile on "
          f"decode-only steps, {cost.prompt_scale:.2f}x on steps with prompt tokens",
          flush=True)
    sections = []
    for name in names:
        scale = a.mixed_scale if name == "mixed-granularity" else 1.0
        t = time.perf_counter()
        lv = scenario_result(name, None, a.seed, Backend("live", run=live.run, size=a.size, scale=scale))
        t_live = time.perf_counter() - t
        sm = scenario_result(name, None, a.seed, Backend("sim", cost=cost, size=a.size, scale=scale))
        sections.append(side_by_side(sm, lv))
        print(sections[-1] + f"\n\n(live {t_live:.0f} s)\n", flush=True)
    cpu, _ = cpu_name()
    head = (f"{TITLE}\n\n`python -m benchmarks.seed_cases` — ended {datetime.datetime.now():%Y-%m-%d %H:%M}, "
            f"{cpu}, {os.cpu_count()} cores, {loaded.name}; the scenarios of `batchserve simulate --scenario` (their configs, "
            f"workloads and load rules) at {a.size:g} of their request counts, run live on this engine and "
            f"simulated on this machine's profile (host overhead {1e3 * cost.overhead_s:.2f} ms/step, runner "
            f"{cost.scale:.2f}x the profile on decode-only steps and {cost.prompt_scale:.2f}x on steps with prompt "
            f"tokens, from a warm-up run); each side's loads follow its own measured saturation throughput. {time.perf_counter() - t_start:.0f} s in all.\n")
    text = "\n\n".join([head, *sections]) + "\n"
    if a.out:
        write_section(a.out, TITLE, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
