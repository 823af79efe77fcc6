"""Is the adaptive request-level policy as good as the best fixed setting, regime by regime?

For each load regime (night, day, a surge, on/off bursts, one trace through all of them, a
replayed BurstGPT-shaped trace), every
(window, cap) point of a grid runs the fixed `static` policy, and `dynamic` runs once with the
same bounds; all judged by goodput: requests that finish within the end-to-end SLO per second of
offered traffic (an error or a 503 is a miss). The best grid point is chosen per regime with
hindsight, which no deployed fixed setting has, and also as a grid searched offline would
choose it: on the other seeds, judged on the one left out. The adaptive policy gets one
configuration for every regime. Simulated (the real scheduler on a roofline), so each figure is
deterministic per seed; a seed draws the arrivals and lengths, and for the trace regime the
trace itself (seed 0: the sample in the package, seed s: the sample generator's draw for s).

    python -m benchmarks.adaptive [--out BENCHMARKS.md]          # simulated, every regime
    python -m benchmarks.adaptive --max-tokens 512               # ... outputs ending at EOS
    python -m benchmarks.adaptive --live [--out BENCHMARKS.md]   # day and bursts on this machine
    python -m benchmarks.adaptive --live --live-regimes "day,on/off bursts,BurstGPT replay"
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import multiprocessing
import os
import statistics
import tempfile
import time
from typing import Any, Callable, Sequence

import numpy as np

from batchserve.bench.metrics import SLO
from batchserve.config import SchedulerConfig
from batchserve.bench.workload import WorkItem, make_workload
from batchserve.scenarios.common import GPU, MODEL, SATURATION_RATE, engine, rate_of
from batchserve.sim.cost import RooflineCost
from batchserve.sim.runner import simulate
from benchmarks.make_trace_samples import burstgpt
from benchmarks.report_md import write_section
from benchmarks.startup import cpu_name

WINDOWS_MS = (0.0, 10.0, 25.0, 50.0, 100.0, 200.0)
CAPS = (4, 8, 16, 32, 64, 128)
SCALE = 0.25  # chat mix lengths (prompt ~50 / output ~50 tokens), as the seed's adaptive-window case
SECTION = "Adaptive batching against every fixed setting"
DEFAULT_K = SchedulerConfig.overdue_factor  # `dynamic` without a factor runs at this one


REGIMES = {  # name -> (workload, share of its capacity, arrival process and its parameters)
    "night": ("chat", 0.06, {}),
    "day": ("chat", 0.9, {}),
    "surge 1x-3x-1x": ("chat", 0.5, {"arrival": "step", "factors": (1.0, 3.0, 1.0)}),
    "on/off bursts": ("chat", 0.6, {"arrival": "onoff", "on_s": 2.0, "off_s": 6.0}),
    "night-day-surge-night": ("chat", 0.63, {"arrival": "piecewise",  # phases: (quarters, share)
                                              "phases": [(1, 0.06), (1, 0.9), (1, 1.5), (1, 0.06)]}),
    "BurstGPT replay": ("burstgpt", 0.7, {}),
}


def workload(name: str, n: int, rate: float, seed: int, eos_cap: int | None = None, **kw: Any) -> list[WorkItem]:
    """A workload at SCALE; `eos_cap`: every request asks for that many tokens and its drawn
    length is where its output ends (None: it asks for its length)."""
    return make_workload(name, n, rate, seed=seed, scale=SCALE, max_tokens=eos_cap, **kw)


def calibrate(cost: Any, name: str, n: int, seed: int, eos_cap: int | None = None) -> tuple[float, float]:
    """(capacity, P99) of a workload under the fixed 50 ms / 32 point: its saturation rate, and
    its P99 end-to-end latency at half that rate (ms, rounded to 100 ms)."""
    fixed = engine("static", window_ms=50.0, max_batch=32)
    cap = rate_of(simulate(fixed, cost, workload(name, max(64, n // 2), SATURATION_RATE, seed, eos_cap)))
    half = simulate(fixed, cost, workload(name, n, cap / 2, seed, eos_cap))
    return cap, 100.0 * round(half.summary["latency"]["e2e_ms"]["p99"] / 100.0)


TRACE_DRAWS = {"burstgpt": lambda path, rng: burstgpt(path, 400, rng)}  # trace sample -> its generator


def trace_draw(mix: str, seed: int, directory: str) -> str:
    """The trace file, written in `directory`, that seed `seed` replays for the trace sample
    `mix`: the sample generator's draw for that seed, which for seed 0 is the sample in the
    package byte for byte. One sample is one draw: three seeds over it would be one run three
    times."""
    path = os.path.join(directory, f"{mix}_{seed}.csv")
    TRACE_DRAWS[mix](path, np.random.default_rng(seed))
    return path


def regime_items(name: str, cap: float, n: int, seed: int, eos_cap: int | None = None) -> list[WorkItem]:
    mix, share, kw = REGIMES[name]
    if mix in TRACE_DRAWS and seed != 0:
        with tempfile.TemporaryDirectory(prefix="batchserve-trace-") as d:
            return _regime_items(trace_draw(mix, seed, d), share, kw, cap, n, seed, eos_cap)
    return _regime_items(mix, share, kw, cap, n, seed, eos_cap)


def _regime_items(mix: str, share: float, kw: dict[str, Any], cap: float, n: int, seed: int,
                  eos_cap: int | None = None) -> list[WorkItem]:
    kw = dict(kw)
    if kw.get("arrival") == "step":
        kw["step_s"] = n / (share * cap) / 3
    if kw.get("arrival") == "piecewise":  # phases in quarters of the run's expected length
        q = n / (share * cap) / len(kw["phases"])
        kw["phases"] = [(d * q, f / share) for d, f in kw["phases"]]
    return workload(mix, n if share > 0.1 else max(50, n // 8), share * cap, seed, eos_cap, **kw)


def compare(name: str, cap: float, slo_ms: float, n: int, seeds: list[int],
            factors: Sequence[float] = (), eos_cap: int | None = None) -> dict[str, Any]:
    """One regime under one SLO: goodput (mean over seeds) and worst P99 of every grid point
    and of `dynamic`; the best grid point is the one with the most goodput, and the one picked
    on the other seeds (with more than one). `factors`: `dynamic` again at each of these
    overdue factors (its default, 2, is the `dynamic` above); `eos_cap`: as `workload`'s. Beside
    them, token-level `continuous` with as many seats as the largest cap: what the same traffic
    gets where request-level batching is not a constraint."""
    cost = RooflineCost(GPU, MODEL)
    slo = SLO(e2e_ms=slo_ms)
    configs = {(w, c): engine("static", window_ms=w, max_batch=c) for w in WINDOWS_MS for c in CAPS}
    configs["adaptive"] = dynamic = engine("dynamic", max_batch=max(CAPS), window_max_ms=max(WINDOWS_MS),
                                           slo_p99_ms=slo_ms)
    configs["continuous"] = engine("continuous")  # the token-level reference, max(CAPS) seats
    for f in factors:
        configs[("k", f)] = dataclasses.replace(
            dynamic, scheduler=dataclasses.replace(dynamic.scheduler, overdue_factor=f))
    good: dict[Any, list[float]] = {k: [] for k in configs}
    p99 = dict.fromkeys(configs, 0.0)
    offered = 0.0
    for seed in seeds:
        items = regime_items(name, cap, n, seed, eos_cap)
        offered += len(items) / max(items[-1].arrival, 1e-9) / len(seeds)
        for k, cfg in configs.items():
            res = simulate(cfg, cost, items, slo=slo)
            good[k].append(goodput_of(res.summary["goodput"]["n_good"], items))
            p99[k] = max(p99[k], res.summary["latency"]["e2e_ms"]["p99"])
    ad, token = good.pop("adaptive"), good.pop("continuous")
    by_factor = {f: (statistics.fmean(good.pop(("k", f))), p99[("k", f)]) for f in factors}
    mean = {k: statistics.fmean(v) for k, v in good.items()}
    best = max(mean, key=lambda k: (round(mean[k], 6), -p99[k]))
    return {"regime": name, "rate": offered, "slo_ms": slo_ms, "best": best, "best_goodput": mean[best],
            "best_p99": p99[best], "default": (mean[(50.0, 32)], p99[(50.0, 32)]),
            "adaptive_goodput": statistics.fmean(ad), "adaptive_p99": p99["adaptive"],
            "held_out": held_out(good, statistics.fmean), "factors": by_factor,
            "continuous": (statistics.fmean(token), p99["continuous"])}


def run(n: int, seeds: list[int], tightness: list[float], jobs: int = 1,
        factors: Sequence[float] = (), eos_cap: int | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every regime under SLOs of each `tightness` x its workload's calibrated P99, `jobs`
    cells at a time (the simulator is deterministic: the same figures in any order)."""
    cost = RooflineCost(GPU, MODEL)
    cal = {mix: calibrate(cost, mix, n, seeds[0], eos_cap) for mix in sorted({m for m, _, _ in REGIMES.values()})}
    t0 = time.perf_counter()
    cells = [(name, cal[mix][0], k * cal[mix][1], n, seeds, factors, eos_cap)
             for k in tightness for name, (mix, _, _) in REGIMES.items()]
    if jobs > 1:
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            rows = pool.starmap(compare, cells, chunksize=1)
    else:
        rows = [compare(*c) for c in cells]
    meta = {"calibration": cal, "n": n, "seeds": seeds, "tightness": tightness, "wall_s": time.perf_counter() - t0,
            "factors": list(factors), "eos_cap": eos_cap}
    return rows, meta


def factor_flag(meta: dict[str, Any]) -> str:
    """The command's --overdue-factors, where the run had them."""
    return f" --overdue-factors {','.join(f'{k:g}' for k in meta['factors'])}" if meta.get("factors") else ""


def factor_section(rows: list[dict[str, Any]], meta: dict[str, Any], p99: str) -> list[str]:
    """With overdue factors in `meta`, their paragraph and table (none without)."""
    if not meta.get("factors"):
        return []
    return ["", "The overdue factor k (`--overdue-factor`: a request held back as late goes first once it has "
            f"waited k times its target), the same runs: goodput over the best fixed point's, and {p99} (ms).", "",
            *factor_table(rows)]


def factor_table(rows: list[dict[str, Any]]) -> list[str]:
    """Per regime and SLO, `dynamic` at each overdue factor: goodput over the best fixed
    point's, and its worst P99."""
    ks = sorted({DEFAULT_K, *rows[0]["factors"]})
    out = ["| regime | SLO (ms) | best fixed: goodput, P99 (ms) | " +
           " | ".join(f"k = {k:g}" + " (default)" * (k == DEFAULT_K) for k in ks) + " |", "|" + "---|" * (3 + len(ks))]
    for r in rows:
        at = {**r["factors"], DEFAULT_K: (r["adaptive_goodput"], r["adaptive_p99"])}
        out.append(f"| {r['regime']} | {r['slo_ms']:,.0f} | {r['best_goodput']:.2f}, {r['best_p99']:,.0f} | " +
                   " | ".join(f"{ratio(at[k][0], r['best_goodput'])}, {at[k][1]:,.0f}" for k in ks) + " |")
    return out


def eos_title(eos_cap: int | None) -> str:
    """A section's title suffix where outputs end at EOS under a max_tokens bound."""
    return "" if eos_cap is None else ", outputs ending at EOS"


def eos_words(eos_cap: int | None) -> str:
    """How the run sets output lengths, for a section's method line."""
    if eos_cap is None:
        return "every request asks for its drawn output length and runs to it"
    return (f"every request asks for max_tokens {eos_cap} and its output ends at its drawn length (its EOS), "
            "which no scheduler knows ahead")


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    day = datetime.date.today().isoformat()
    cal = "; ".join(f"{m}: {c:.1f} req/s, P99 {p:,.0f} ms" for m, (c, p) in meta["calibration"].items())
    eos_cap = meta.get("eos_cap")
    flags = factor_flag(meta) + ("" if eos_cap is None else f" --max-tokens {eos_cap}")
    out = [f"## {SECTION}{eos_title(eos_cap)}", "",
           f"Command: `python -m benchmarks.adaptive{flags}` ({day}; simulated: {GPU} roofline, {MODEL}, lengths at "
           f"scale {SCALE}, {eos_words(eos_cap)}; {meta['n']} requests per regime and seed, seeds "
           f"{', '.join(map(str, meta['seeds']))}). "
           f"Load is a share of the workload's capacity under the fixed 50 ms / 32 point, and the SLO is end to "
           f"end, {' or '.join(f'{k:g}x' for k in meta['tightness'])} that point's P99 at half load ({cal}). Goodput: requests within the SLO per second of "
           f"offered traffic, the mean over seeds. Grid: `static` at windows "
           f"{', '.join(f'{w:g}' for w in WINDOWS_MS)} ms x caps {', '.join(map(str, CAPS))}, the best point "
           f"picked per regime with hindsight, and (\"picked on the other seeds\") for each seed the point with "
           f"the most goodput on the others, judged on that seed: the mean; `dynamic` has one setting for all: window <= {max(WINDOWS_MS):g} "
           f"ms, cap <= {max(CAPS)}, the same SLO. `continuous`: token level with {max(CAPS)} seats, what the same "
           "traffic gets where batches need not run whole.", "",
           *table(rows, slo=True, p99="worst P99 E2E, best / adaptive (ms)", over="seeds")]
    return "\n".join(out + factor_section(rows, meta, "the worst P99 end to end over the seeds"))


def ratio(a: float, b: float, fmt: str = "{:.3f}x") -> str:
    """a / b in `fmt`; with nothing to divide by, "–" where a is nothing too, else "inf"."""
    return fmt.format(a / b) if b > 0 else "–" if a <= 0 else "inf"


def table(rows: list[dict[str, Any]], slo: bool, p99: str, over: str = "rounds") -> list[str]:
    """The comparison's rows, one per regime (and SLO, with `slo`); `over`: what the held-out
    pick leaves out, rounds or seeds."""
    rounds = "round_goodputs" in rows[0] if rows else False
    held = bool(rows) and rows[0].get("held_out") is not None
    token = bool(rows) and "continuous" in rows[0]
    cols = ["regime"] + ["SLO (ms)"] * slo + ["offered req/s", "best fixed (window, cap)", "its goodput",
                                              "adaptive goodput", "adaptive / best"] + \
        ["the same, round by round"] * rounds + [f"adaptive / best picked on the other {over}"] * held + \
        [p99, "50 ms / 32 goodput"] + ["`continuous` goodput, worst P99 (ms)"] * token
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        w, c = r["best"]
        cells = [r["regime"]] + [f"{r['slo_ms']:,.0f}"] * slo + [
            f"{r['rate']:.2f}", f"{w:g} ms, {c}", f"{r['best_goodput']:.2f}", f"{r['adaptive_goodput']:.2f}",
            ratio(r["adaptive_goodput"], r["best_goodput"])] + \
            [", ".join(ratio(a, b, "{:.2f}") for a, b in r.get("round_goodputs", []))] * rounds + \
            ([f"{ratio(r['adaptive_goodput'], r['held_out'])} ({r['held_out']:.2f})"] if held else []) + [
            f"{r['best_p99']:,.0f} / {r['adaptive_p99']:,.0f}", f"{r['default'][0]:.2f}"] + \
            ([f"{r['continuous'][0]:.2f}, {r['continuous'][1]:,.0f}"] if token else [])
        out.append("| " + " | ".join(cells) + " |")
    return out


LIVE_GRID = [(w, c) for w in (0.0, 50.0) for c in (16, 32)]
LIVE_REGIMES = ("day", "on/off bursts")


def live(n: int, seed: int, tightness: list[float], rounds: int = 1, regimes: Sequence[str] = LIVE_REGIMES,
         factors: Sequence[float] = ()) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The same comparison on this machine's real engine (the default model, wall clock), on a
    smaller grid: each regime's workload's capacity and P99 at half load calibrated live as in
    `calibrate`, then under an SLO of each `tightness` x that P99, each of `regimes` through every
    grid point and `dynamic` in one process over one loaded model, `rounds` times, the order
    rotating from cell to cell and round to round so that no configuration always runs first or
    last; medians over the rounds, and each round's ratio of the adaptive run to the best point's
    run of that round."""
    one, model = live_engine()

    fixed = dict(policy="static", window_ms=50.0, max_batch=32)
    one(workload("chat", 8, 100.0, seed + 99), fixed, None)  # warm the kernels
    calib: dict[str, tuple[float, float]] = {}  # workload -> (capacity, P99 at half load)
    for mix in dict.fromkeys(REGIMES[name][0] for name in regimes):
        cap = one(workload(mix, 64, SATURATION_RATE, seed), fixed, None)["throughput_rps"]
        calib[mix] = cap, one(workload(mix, n // 2, cap / 2, seed), fixed, None)["latency"]["e2e_ms"]["p99"]
        print(f"live: {mix}: capacity {cap:.2f} req/s, P99 at half load {calib[mix][1]:,.0f} ms", flush=True)
    configs: dict[Any, dict[str, Any]] = {k: dict(policy="static", window_ms=k[0], max_batch=k[1]) for k in LIVE_GRID}
    # run_one hands every configuration slo_ms as slo_p99_ms: dynamic's target, ignored by static
    configs["adaptive"] = dict(policy="dynamic", max_batch=max(c for _, c in LIVE_GRID),
                               window_max_ms=max(w for w, _ in LIVE_GRID))
    for f in factors:
        configs[("k", f)] = dict(configs["adaptive"], overdue_factor=f)
    keys = list(configs)
    # one cell per (SLO, regime): its SLO, its arrivals, and each configuration's (goodput, P99) runs
    cells = [(100.0 * round(t * calib[mix][1] / 100.0), name, regime_items(name, calib[mix][0], n, seed))
             for t in tightness for name in regimes for mix in [REGIMES[name][0]]]
    runs: list[dict[Any, list[tuple[float, float]]]] = [{k: [] for k in keys} for _ in cells]
    t0 = time.perf_counter()
    for r in range(rounds):
        for i, (slo_ms, name, items) in enumerate(cells):
            shift = (i + r) % len(keys)
            for k in keys[shift:] + keys[:shift]:
                s = one(items, configs[k], slo_ms)
                runs[i][k].append((goodput_of(s["goodput"]["n_good"], items), s["latency"]["e2e_ms"]["p99"]))
                print(f"live round {r + 1} {name} SLO {slo_ms:,.0f} {k}: goodput {runs[i][k][-1][0]:.2f}, "
                      f"P99 {runs[i][k][-1][1]:,.0f} ms", flush=True)
    rows = []
    for (slo_ms, name, items), cell in zip(cells, runs):
        score = {k: (statistics.median(g for g, _ in v), statistics.median(p for _, p in v)) for k, v in cell.items()}
        ad = score.pop("adaptive")
        by_factor = {f: score.pop(("k", f)) for f in factors}
        best = max(score, key=lambda k: (score[k][0], -score[k][1]))
        rows.append({"regime": name, "rate": len(items) / max(items[-1].arrival, 1e-9), "slo_ms": slo_ms,
                     "best": best, "best_goodput": score[best][0], "best_p99": score[best][1],
                     "default": score[(50.0, 32)], "adaptive_goodput": ad[0], "adaptive_p99": ad[1],
                     # round by round, against the same point's run of that round: how far the noise reaches
                     "round_goodputs": [(a, b) for (a, _), (b, _) in zip(cell["adaptive"], cell[best])],
                     "held_out": held_out({k: [g for g, _ in v] for k, v in cell.items() if k in score}),
                     "factors": by_factor})
    return rows, {"calibration": calib, "regimes": list(regimes), "tightness": tightness, "n": n, "seed": seed,
                  "rounds": rounds, "wall_s": time.perf_counter() - t0, "model": model, "factors": list(factors)}


def live_engine() -> tuple[Callable[..., dict[str, Any]], str]:
    """The default model, loaded once, and a function that drives a fresh engine over it through
    a workload on the wall clock: one(items, sched, slo_ms, slo=None, ignore_eos=True) -> the run's
    summary (sched: SchedulerConfig fields; slo_ms, slo: the targets its goodput judges;
    ignore_eos off: outputs end at the model's EOS). Also the model's name."""
    from batchserve.config import CacheConfig, ModelConfig
    from batchserve.runner.loader import load_model
    from batchserve.runner.model_runner import ModelRunner
    from benchmarks.policies import run_one

    mcfg, ccfg = ModelConfig(), CacheConfig(kv_cache_gb=0.5)
    loaded = load_model(mcfg)
    runner = ModelRunner(loaded, mcfg, ccfg)
    eos = loaded.config.eos_token_id

    def one(items: list[WorkItem], sched: dict[str, Any], slo_ms: float | None,
            slo: SLO | None = None, ignore_eos: bool = True) -> dict[str, Any]:
        return run_one(runner, loaded.tokenizer, eos, items, sched, ccfg.block_size, False, slo_ms, slo,
                       ignore_eos)["summary"]
    return one, loaded.name


def held_out(goodputs: dict[Any, list[float]], avg: Callable[[list[float]], float] = statistics.median) -> float | None:
    """The goodput of a fixed point searched offline: in each round (or seed), the point with
    the most `avg` goodput over the other rounds, judged by its run in that one; the `avg` over
    the rounds (None with one round). Picking the best of several noisy runs in hindsight
    flatters it by the noise it was picked on; a point picked ahead of a run has no such luck."""
    rounds = len(next(iter(goodputs.values())))
    if rounds < 2:
        return None
    out = []
    for r in range(rounds):
        pick = max(goodputs, key=lambda k: avg([g for i, g in enumerate(goodputs[k]) if i != r]))
        out.append(goodputs[pick][r])
    return avg(out)


def goodput_of(n_good: int, items: list[WorkItem]) -> float:
    """Requests within the SLO per second of offered traffic (first to last arrival)."""
    return n_good / max(items[-1].arrival - items[0].arrival, 1e-9)


def live_markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    cpu = cpu_name()
    regimes = "" if tuple(meta["regimes"]) == LIVE_REGIMES else f" --live-regimes \"{','.join(meta['regimes'])}\""
    calib = "; ".join(f"{mix} {cap:.2f} req/s, {p99:,.0f} ms" for mix, (cap, p99) in meta["calibration"].items())
    out = [f"## {SECTION}, live", "", f"The question above on this engine ({datetime.date.today().isoformat()}; {cpu}, {os.cpu_count()} cores, "
           f"{meta['model']}; command `python -m benchmarks.adaptive --live --live-requests {meta['n']} --tightness "
           f"{','.join(f'{k:g}' for k in meta['tightness'])} --rounds {meta['rounds']}{regimes}{factor_flag(meta)}`; "
           f"{meta['rounds']} run(s) per configuration and cell, the order rotating, medians; "
           f"{meta['n']} requests, seed {meta['seed']}): per workload, its capacity under 50 ms / 32 and its P99 at "
           f"half load ({calib}); the SLO is end to end, "
           f"{' or '.join(f'{k:g}x' for k in meta['tightness'])} that P99. Grid: windows "
           f"{', '.join(sorted({f'{w:g}' for w, _ in LIVE_GRID}))} ms x caps "
           f"{', '.join(str(c) for c in sorted({c for _, c in LIVE_GRID}))}; `dynamic` with window <= "
           f"{max(w for w, _ in LIVE_GRID):g} ms, cap <= {max(c for _, c in LIVE_GRID)}. Live timings move about 15 % run to run" +
           (", and a point picked as the best of several runs gains the luck it was picked on; "
            "\"picked on the other rounds\" is the point with the most goodput over the other rounds, "
            "judged by its run in each round (median), as a setting searched offline would be." if meta["rounds"] > 1
            else "."), "",
           *table(rows, slo=True, p99="P99 E2E best / adaptive (ms)")]
    return "\n".join(out + factor_section(rows, meta, "the median P99 end to end over the rounds"))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1000, help="requests per regime and seed")
    ap.add_argument("--seeds", default="0,1,2,3,4,5,6,7,8,9", help="workload seeds, comma-separated")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="simulated cells run at a time")
    ap.add_argument("--overdue-factors", default="", help="also run dynamic at these overdue factors, comma-separated")
    ap.add_argument("--tightness", default="2,1,0.5", help="SLOs as multiples of the calibrated P99, comma-separated")
    ap.add_argument("--live", action="store_true", help="instead: the live regimes on the real engine")
    ap.add_argument("--live-regimes", default=",".join(LIVE_REGIMES), help="live: regimes, comma-separated")
    ap.add_argument("--live-requests", type=int, default=80, help="requests per live run")
    ap.add_argument("--rounds", type=int, default=1, help="live: runs of every configuration per cell (medians)")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="simulated: every request asks for this many; its drawn length is where its output ends")
    ap.add_argument("--out", default=None, help="write the section into this Markdown file")
    a = ap.parse_args(argv)
    factors = [float(x) for x in a.overdue_factors.split(",") if x and float(x) != DEFAULT_K]
    if a.live and a.max_tokens is not None:
        ap.error("--max-tokens: simulated runs only")
    if a.live:
        regimes = a.live_regimes.split(",")
        if unknown := [r for r in regimes if r not in REGIMES]:
            ap.error(f"--live-regimes: unknown {', '.join(unknown)} (known: {', '.join(REGIMES)})")
        rows, meta = live(a.live_requests, int(a.seeds.split(",")[0]), [float(x) for x in a.tightness.split(",")],
                          a.rounds, regimes, factors)
        text, heading = live_markdown(rows, meta), f"## {SECTION}, live"
    else:
        rows, meta = run(a.requests, [int(x) for x in a.seeds.split(",")], [float(x) for x in a.tightness.split(",")],
                         max(1, a.jobs), factors, a.max_tokens)
        text, heading = markdown(rows, meta), f"## {SECTION}{eos_title(a.max_tokens)}"
    print(text)
    print(f"\n({meta['wall_s']:.0f} s)")
    if a.out:
        write_section(a.out, heading, text)


if __name__ == "__main__":
    main()
