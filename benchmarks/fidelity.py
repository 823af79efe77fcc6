"""Fidelity: the simulator against the live engine, on this machine and this model.

    python -m benchmarks.fidelity                          # SmolLM2-135M: profile, 3 rates
    python -m benchmarks.fidelity --profile prof.json --rates 0.5,1,1.5 --out BENCHMARKS.md

1. Profile the model (`batchserve profile`: step time of the runner over prompt tokens,
   decode sequences and context), or load `--profile`.
2. Calibration on a warm-up live run (another seed): the profile times the runner alone,
   while the live engine also schedules, updates and detokenizes every step, so the mean
   of (engine step - runner time) is added to each predicted step; and measured / profiled
   runner time, summed over the steps, scales the profile, should the machine run slower or
   faster now than when it was profiled (~1.0 on a quiet machine). By default (`--warmup
   each`) also a warm-up at each rate just before its run, which prices that run; a third
   table sets both protocols' predictions against the same live runs (`--warmup once`: the
   first warm-up prices them all).
3. Rates: `--rates`, or 30% / 50% / 70% of the simulated saturation throughput.
4. Per rate, the same workload twice: live (this process, wall clock; requests are added to
   the engine between steps at their arrival times, as the server's engine thread adds them;
   ignore_eos, so outputs have the workload's lengths) and simulated (same engine config,
   profiled cost). Throughput and P50 end-to-end latency should agree within 5%, P99
   within 10%; the table says which do.
5. The machine's speed taken out: this CPU's speed drifts by 10-30 % within minutes, more
   than the tolerances, so each live run is also simulated at its own mean runner speed, and
   with its speed replayed window by window (`speed_curve`: measured over predicted runner
   time of the steps in each 2 s). What the replay leaves is the simulator's own error: the
   step model, scheduling and queueing. Its control, a flat step model (every step the run's
   mean) under the same replay, shows how much the replayed speed explains by itself.
Run it on a quiet machine: other load on the CPU slows the live side only.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import random
import statistics
import time
from typing import Any, Callable

from batchserve.bench.metrics import RequestRecord, span_s, summarize
from batchserve.bench.workload import WorkItem, make_workload
from batchserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from batchserve.request import SamplingParams
from batchserve.runner.profiler import run_profile, save
from batchserve.sim.cost import ProfiledCost, has_prompt
from batchserve.sim.runner import simulate
from batchserve.sim.simulator import Simulator, prompt_ids
from benchmarks.report_md import write_section

TOLERANCE = {"throughput_rps": 0.05, "e2e_p50_ms": 0.05, "e2e_p99_ms": 0.10}
WARMUPS = ("once", "each")  # calibrated on one warm-up at a middle load; or also on one per rate
REPLAY_WINDOW_S = 2.0  # the machine's speed replayed per window this long (see `speed_curve`)


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
        self.t0 = time.perf_counter()  # the run's start (live_run sets it)
        self.steps: list[tuple[float, float, float, bool]] = []  # (start - t0, seconds, predicted, prompt)

    def execute(self, batch: Any) -> Any:
        t0 = time.perf_counter()
        out = self.runner.execute(batch)
        self.last = time.perf_counter() - t0
        self.num_steps += 1
        self.num_tokens += batch.num_tokens
        self.busy_time += self.last
        if self.cost is not None:
            p, prompt = self.cost.runner_time(batch), has_prompt(batch)
            self.predicted += p
            if prompt:
                self.prompt_busy += self.last
                self.prompt_predicted += p
            self.steps.append((t0 - self.t0, self.last, p, prompt))
        return out


def live_run(engine: Any, items: list[WorkItem]) -> tuple[list[RequestRecord], list[float]]:
    """Drive `engine` (on its wall clock) with `items` at their arrival times. Returns the
    records (times in seconds from the start) and each model step's host overhead."""
    runner = engine.executor
    vocab = runner.cfg.vocab_size
    recs: dict[str, RequestRecord] = {}
    order: list[RequestRecord] = []
    overheads: list[float] = []
    t0 = runner.t0 = time.perf_counter()
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


def speed_curve(steps: list[tuple[float, float, float, bool]], price: Callable[[float, bool], float],
                window_s: float = REPLAY_WINDOW_S) -> list[float]:
    """The machine's speed over a live run (`TimedExecutor.steps`), window by window: measured
    runner time over `price(profile prediction, has prompt)` summed over the steps that started
    in each `window_s`. A window without steps keeps the one before it."""
    n = int(max((t for t, *_ in steps), default=0.0) // window_s) + 1
    meas, pred = [0.0] * n, [0.0] * n
    for t, sec, p, prompt in steps:
        k = int(t // window_s)
        meas[k] += sec
        pred[k] += price(p, prompt)
    out, last = [], 1.0
    for m, q in zip(meas, pred):
        last = m / q if q > 0 else last
        out.append(last)
    return out


def speed_of(timed: TimedExecutor, own: ProfiledCost) -> list[float]:
    """The live run `timed`'s `speed_curve` against `own`, the profile calibrated on it."""
    return speed_curve(timed.steps, lambda p, prompt: p * (own.prompt_scale if prompt else own.scale))


class ReplayedSpeed(ProfiledCost):
    """A calibrated profile whose runner time is multiplied by a live run's `speed_curve`: the
    step starting at simulated time t (seconds from the run's start, as the live run counts) is
    priced at the speed the machine ran at in t's window. `clock` is the simulator's. With
    `flat`, every step's runner time is that constant instead of the profile's prediction: the
    control that shows what the replayed speed alone explains. With `jitter` > 0, each step's
    runner time is also multiplied by its own draw from a lognormal of mean 1 and that
    coefficient of variation (`seed` picks the draws): the step-to-step noise a window's mean
    leaves out, so that one curve gives many runs, as the machine would."""

    def __init__(self, base: ProfiledCost, curve: list[float], clock: Any, flat: float | None = None,
                 window_s: float = REPLAY_WINDOW_S, jitter: float = 0.0, seed: int = 0) -> None:
        super().__init__(base.path, num_blocks=base._num_blocks, overhead_s=base.overhead_s, scale=base.scale,
                         prompt_scale=base.prompt_scale)
        self.curve, self.clock, self.flat, self.window_s = curve, clock, flat, window_s
        self.sigma = math.sqrt(math.log1p(jitter ** 2))  # of the log: CV^2 = exp(sigma^2) - 1
        self.rng = random.Random(seed)

    def step_time(self, batch: Any) -> float:
        k = min(int(self.clock.now() // self.window_s), len(self.curve) - 1)
        runner = self.flat if self.flat is not None else super().step_time(batch) - self.overhead_s
        if self.sigma > 0:
            runner *= self.rng.lognormvariate(-self.sigma ** 2 / 2, self.sigma)
        return runner * self.curve[k] + self.overhead_s


def simulate_replayed(config: EngineConfig, own: ProfiledCost, curve: list[float], items: list[WorkItem],
                      slo_ms: float | None = None, flat: float | None = None, jitter: float = 0.0,
                      seed: int = 0) -> dict[str, Any]:
    """The simulator's summary of `items` under `config`, priced by `own` (a profile calibrated
    on a live run) at that run's speed `curve` (`ReplayedSpeed`, with its `jitter` and `seed`)."""
    sim = Simulator(config, own, slo_ms=slo_ms)
    sim.executor.cost = ReplayedSpeed(own, curve, sim.clock, flat=flat, jitter=jitter, seed=seed)
    return sim.run(items).summary


def replayed(config: EngineConfig, own: ProfiledCost, timed: TimedExecutor, items: list[WorkItem],
             flat: bool = False) -> dict[str, float]:
    """The simulator on `items` with the machine's speed replayed from the live run `timed`
    made of them; `own` is the profile calibrated on that run. With `flat`, the step model is
    the run's mean runner time per step (see `ReplayedSpeed`)."""
    c = timed.busy_time / max(1, timed.num_steps) if flat else None
    curve = speed_curve(timed.steps, lambda p, prompt: c) if flat else speed_of(timed, own)
    return {**_numbers(simulate_replayed(config, own, curve, items, flat=c)),
            "speed_min": min(curve), "speed_max": max(curve)}


def run_fidelity(config: EngineConfig, profile: str, n: int, rates: list[float] | None = None, seed: int = 0,
                 workload: str = "chat", scale: float | None = None, same_run: bool = False,
                 warmup: str = "each") -> list[dict[str, Any]]:
    """Live vs simulated at each rate; one row per rate with both sides' numbers and the
    relative errors. The engine (model load) is built once and reused between rates.
    Calibration comes from a warm-up run at a middle load (`warmup="once"`), or also from
    one at each rate just before its run, on another seed (`"each"`, the default: the
    prediction `sim` is then that one's, and `ahead` holds both, so one run compares the two
    protocols on the same live runs; a warm-up nearer in time and load prices the run
    better on a machine whose speed drifts); with `same_run`, from each rate's own live run
    instead (no per-rate warm-up), which takes a machine whose speed drifts (a shared CI
    box) out of the comparison and leaves the scheduling and queueing to be checked. Every
    row also has the prediction at the run's own mean speed (`own`), with its speed replayed
    (`replayed`) and the replay's flat-model control (`flat`)."""
    if warmup not in WARMUPS:
        raise ValueError(f"warmup: {warmup!r} is not one of {', '.join(WARMUPS)}")
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
    once, rows = cost, []
    for i, rate in enumerate(rates):
        wl = items(rate, seed)
        ahead = {"once": once}
        if warmup == "each" and not same_run:
            timed.reset()
            _, over = live_run(live, items(rate, seed + 101 + i))
            cost = ahead["each"] = calibrated(profile, timed, over)
        timed.reset()
        recs, over = live_run(live, wl)
        own = calibrated(profile, timed, over)
        if same_run:
            cost = own
        got = _numbers(summarize(recs, span_s(recs)))
        pred = {k: _numbers(simulate(config, c, wl).summary) for k, c in ahead.items()}
        want = pred[warmup] if not same_run else _numbers(simulate(config, cost, wl).summary)
        err = {k: abs(want[k] - got[k]) / got[k] for k in got}
        at_own = want if same_run else _numbers(simulate(config, own, wl).summary)
        rows.append({"rate": rate, "live": got, "sim": want, "rel_error": err, "ahead": pred,
                     "overhead_ms": 1e3 * cost.overhead_s,
                     "runner_scale": cost.scale, "prompt_scale": cost.prompt_scale,
                     "own": {"runner_scale": own.scale, "prompt_scale": own.prompt_scale, "sim": at_own},
                     "replayed": replayed(config, own, timed, wl), "flat": replayed(config, own, timed, wl, True)})
    return rows


def _verdict(sim: dict[str, float], live: dict[str, float]) -> str:
    """yes / NO per `TOLERANCE` key: `sim` within its tolerance of `live`."""
    return " ".join("yes" if abs(sim[k] - live[k]) <= TOLERANCE[k] * live[k] else "NO" for k in TOLERANCE)


def format_rows(rows: list[dict[str, Any]]) -> str:
    within = "/".join(f"{100 * v:g}" for v in TOLERANCE.values())
    out = [f"| rate | req/s live / sim | E2E P50 ms live / sim | E2E P99 ms live / sim | within {within}% |",
           "|---|---|---|---|---|"]
    for r in rows:
        lv, sm = r["live"], r["sim"]
        out.append(f"| {r['rate']:g} | {lv['throughput_rps']:.2f} / {sm['throughput_rps']:.2f} | "
                   f"{lv['e2e_p50_ms']:.0f} / {sm['e2e_p50_ms']:.0f} | "
                   f"{lv['e2e_p99_ms']:.0f} / {sm['e2e_p99_ms']:.0f} | {_verdict(sm, lv)} |")
    out += ["", "The same live runs with the machine's speed taken out: the simulator at each run's own mean runner"
            f" speed, and with that run's speed replayed per {REPLAY_WINDOW_S:g} s window, on the profile's step"
            " model and (the control) on a flat one, every step the run's mean.", "",
            "| rate | runner / profile, decodes / prompt steps: warm-up → this run; in its windows "
            "| E2E P50 ms: live / mean speed / replayed / flat, replayed "
            f"| E2E P99 ms: the same | within {within}%: replayed; flat |", "|---|---|---|---|---|"]
    for r in rows:
        lv, o, rp, fl = r["live"], r["own"], r["replayed"], r["flat"]

        def cell(k: str) -> str:
            return f"{lv[k]:.0f} / {o['sim'][k]:.0f} / {rp[k]:.0f} / {fl[k]:.0f}"

        out.append(f"| {r['rate']:g} | {r['runner_scale']:.2f} / {r['prompt_scale']:.2f} → "
                   f"{o['runner_scale']:.2f} / {o['prompt_scale']:.2f}; {rp['speed_min']:.2f}–{rp['speed_max']:.2f}x "
                   f"| {cell('e2e_p50_ms')} | "
                   f"{cell('e2e_p99_ms')} | {_verdict(rp, lv)}; {_verdict(fl, lv)} |")
    if all("each" in r["ahead"] for r in rows):
        out += ["", "Predicted ahead by the two warm-up protocols, on the same live runs: calibrated once, on a warm-up"
                " at a middle load before all the runs, or on a warm-up at each run's rate just before it"
                " (another seed).", "",
                "| rate | E2E P50 error: once / each | E2E P99 error: once / each | req/s error: once / each "
                f"| within {within}%: once; each |", "|---|---|---|---|---|"]
        for r in rows:
            lv, a = r["live"], r["ahead"]

            def err(k: str) -> str:
                return " / ".join(f"{100 * (a[w][k] - lv[k]) / lv[k]:+.1f}%" for w in WARMUPS)

            out.append(f"| {r['rate']:g} | {err('e2e_p50_ms')} | {err('e2e_p99_ms')} | {err('throughput_rps')} "
                       f"| {_verdict(a['once'], lv)}; {_verdict(a['each'], lv)} |")
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
    ap.add_argument("--warmup", choices=WARMUPS, default="each",
                    help="calibrate on one warm-up at a middle load, or also on one at each rate (default)")
    ap.add_argument("--out", default=None, help="markdown file to add the table to (e.g. BENCHMARKS.md)")
    a = ap.parse_args(argv)
    cfg = EngineConfig(model=ModelConfig(model=a.model), cache=CacheConfig(kv_cache_gb=a.kv_cache_gb),
                       scheduler=SchedulerConfig(max_num_seqs=a.max_num_seqs))
    path = a.profile
    if path is None:
        path = "fidelity_profile.json"
        save(run_profile(dataclasses.replace(cfg)), path)
    rates = [float(x) for x in a.rates.split(",")] if a.rates else None
    rows = run_fidelity(cfg, path, a.requests, rates, workload=a.workload, scale=a.scale, warmup=a.warmup)
    table = format_rows(rows)
    which = "the first rate's own warm-up run" if a.warmup == "each" else "a warm-up run"
    text = (f"## Simulator fidelity\n\nCommand: `python -m benchmarks.fidelity` — {a.model}, {a.workload} "
            f"workload, {a.requests} requests per rate, profile `{path}`; from {which}: host overhead "
            f"{rows[0]['overhead_ms']:.2f} ms/step, runner {rows[0]['runner_scale']:.2f}x the profile on decode-only "
            f"steps, {rows[0]['prompt_scale']:.2f}x on steps with prompt tokens."
            f"\n\n{table}\n")
    print(text)
    if a.out:
        write_section(a.out, "## Simulator fidelity", text)


if __name__ == "__main__":
    main()
