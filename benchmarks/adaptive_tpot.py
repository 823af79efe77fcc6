"""Does the adaptive request-level policy keep a TPOT target as well as the best fixed setting?

A request-level member's result is held until its batch ends, so its time per token is the
batch's decode span over its own tokens: a short output batched with a long one misses a TPOT
target that one decode step meets. Per workload, target and load, every (window, cap) point of
the adaptive benchmark's grid runs `static`, and `dynamic` runs once with the same bounds and
the target; all judged by goodput (requests within every target per second of offered traffic).
Simulated on the roofline, deterministic per seed.

    python -m benchmarks.adaptive_tpot [--out BENCHMARKS.md] [--json rows.json] [--before rows.json]
    python -m benchmarks.adaptive_tpot --live [--out BENCHMARKS.md]

`--before`: rows a run of an earlier version wrote with `--json`, shown beside as its column.
`--live`: the short-long mix (`--live-mix`) on this machine's real engine (the default model,
wall clock) at 0.7 of its capacity under 50 ms / 32, with TPOT targets of 2x and 4x its
measured step time alone, on a smaller grid, the order of the configurations rotating from
round to round. `--max-tokens N`: every request asks for N tokens and its output ends at its
EOS (simulated: at its drawn length; live: where the model stops), so no scheduler knows a
length ahead; without it every output runs to its max_tokens.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import multiprocessing
import os
import statistics
import time
from typing import Any

from batchserve.bench.metrics import SLO
from batchserve.scenarios.common import GPU, MODEL, SATURATION_RATE, engine
from batchserve.sim.cost import RooflineCost
from batchserve.sim.runner import simulate
from benchmarks.adaptive import (CAPS, SCALE, WINDOWS_MS, calibrate, eos_title, eos_words, goodput_of, held_out,
                                 live_engine, ratio, workload)
from benchmarks.report_md import write_section
from benchmarks.startup import cpu_name

SECTION = "A TPOT target under request-level batching"
SHARES = (0.3, 0.7, 0.9)  # load: shares of the workload's capacity under the fixed 50 ms / 32 point
CELLS = (  # (workload, TPOT target ms, end-to-end target as a multiple of the calibrated P99, or None)
    ("short-long", 20.0, None), ("short-long", 40.0, None), ("chat", 20.0, None), ("chat", 40.0, None),
    ("short-long", 40.0, 1.0),
)


def compare(mix: str, cap: float, p99: float, tpot_ms: float, e2e_x: float | None, share: float, n: int,
            seeds: list[int], eos_cap: int | None = None) -> dict[str, Any]:
    """One cell: goodput (mean over seeds), attainment and worst P99 of every grid point and of
    `dynamic`, and of token-level `continuous` with as many seats as the largest cap (what the
    same traffic gets where batches need not run whole). `eos_cap`: as `adaptive.workload`'s."""
    cost = RooflineCost(GPU, MODEL)
    e2e_ms = None if e2e_x is None else 100.0 * round(e2e_x * p99 / 100.0)
    slo = SLO(tpot_ms=tpot_ms, e2e_ms=e2e_ms)
    configs: dict[Any, Any] = {(w, c): engine("static", window_ms=w, max_batch=c) for w in WINDOWS_MS for c in CAPS}
    configs["adaptive"] = engine("dynamic", max_batch=max(CAPS), window_max_ms=max(WINDOWS_MS),
                                 slo_tpot_ms=tpot_ms, slo_p99_ms=e2e_ms)
    configs["continuous"] = engine("continuous")
    good: dict[Any, list[float]] = {k: [] for k in configs}
    run_good: dict[Any, list[float]] = {k: [] for k in configs}  # per second of the run: first arrival to last end
    att: dict[Any, list[float]] = {k: [] for k in configs}
    worst = dict.fromkeys(configs, 0.0)
    offered = 0.0
    for seed in seeds:
        items = workload(mix, n, share * cap, seed, eos_cap)
        offered += len(items) / max(items[-1].arrival, 1e-9) / len(seeds)
        for k, cfg in configs.items():
            s = simulate(cfg, cost, items, slo=slo).summary
            good[k].append(goodput_of(s["goodput"]["n_good"], items))
            run_good[k].append(s["goodput_rps"])
            att[k].append(s["goodput"]["n_good"] / len(items))
            worst[k] = max(worst[k], s["latency"]["e2e_ms"]["p99"])
    mean = {k: statistics.fmean(v) for k, v in good.items()}
    fixed = [k for k in configs if k not in ("adaptive", "continuous")]
    best = max(fixed, key=lambda k: (round(mean[k], 6), -worst[k]))
    by_run = {k: statistics.fmean(v) for k, v in run_good.items()}
    run_best = max(fixed, key=lambda k: (round(by_run[k], 6), -worst[k]))
    return {"run_best": list(run_best), "run_best_goodput": by_run[run_best], "run_adaptive_goodput": by_run["adaptive"],
            "mix": mix, "tpot_ms": tpot_ms, "e2e_ms": e2e_ms, "share": share, "rate": offered, "best": list(best),
            "best_goodput": mean[best], "best_attainment": statistics.fmean(att[best]), "best_p99": worst[best],
            "adaptive_goodput": mean["adaptive"], "adaptive_attainment": statistics.fmean(att["adaptive"]),
            "adaptive_p99": worst["adaptive"], "held_out": held_out({k: good[k] for k in fixed}, statistics.fmean),
            "continuous": {"goodput": mean["continuous"], "attainment": statistics.fmean(att["continuous"]),
                           "run_goodput": by_run["continuous"], "p99": worst["continuous"]}}


def run(n: int, seeds: list[int], jobs: int, eos_cap: int | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    cost = RooflineCost(GPU, MODEL)
    cal = {mix: calibrate(cost, mix, n, seeds[0], eos_cap) for mix in dict.fromkeys(m for m, _, _ in CELLS)}
    cells = [(mix, *cal[mix], tpot, e2e_x, share, n, seeds, eos_cap) for mix, tpot, e2e_x in CELLS for share in SHARES]
    t0 = time.perf_counter()
    if jobs > 1:
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            rows = pool.starmap(compare, cells, chunksize=1)
    else:
        rows = [compare(*c) for c in cells]
    return rows, {"calibration": cal, "n": n, "seeds": seeds, "wall_s": time.perf_counter() - t0, "eos_cap": eos_cap}


def _key(r: dict[str, Any]) -> tuple[Any, ...]:
    return r["mix"], r["tpot_ms"], r["e2e_ms"], r["share"]


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any], before: list[dict[str, Any]] | None,
             before_label: str) -> str:
    cal = "; ".join(f"{m}: {c:.1f} req/s, P99 {p:,.0f} ms" for m, (c, p) in meta["calibration"].items())
    old = {_key(r): r for r in before or []}
    token = bool(rows) and "continuous" in rows[0]
    eos_cap = meta.get("eos_cap")
    flag = "" if eos_cap is None else f" --max-tokens {eos_cap}"
    out = [f"## {SECTION}{eos_title(eos_cap)}", "",
           f"Command: `python -m benchmarks.adaptive_tpot{flag}` ({datetime.date.today().isoformat()}; simulated: {GPU} "
           f"roofline, {MODEL}, lengths at scale {SCALE}, {eos_words(eos_cap)}; {meta['n']} requests per cell and seed, seeds "
           f"{', '.join(map(str, meta['seeds']))}). Load: a share of the workload's capacity under the fixed 50 ms / 32 "
           f"point ({cal}; the P99 is at half load and sets the end-to-end target where one is given). Goodput: "
           f"requests within every target per second of offered traffic, the mean over seeds; attainment in "
           f"brackets; \"per second of the run\": over the first arrival to the last answer instead, which charges "
           f"a point for the backlog it leaves when the arrivals stop. Grid and `dynamic` bounds as in the adaptive benchmark (windows "
           f"{', '.join(f'{w:g}' for w in WINDOWS_MS)} ms x caps {', '.join(map(str, CAPS))}); "
           f"\"picked on the other seeds\": the point with the most goodput on the others, judged on the one left out."
           + (f" `continuous`: token level with {max(CAPS)} seats, beside the grid." if token else "")
           + (f" {before_label}: the same command on that version of `dynamic`." if before else ""), ""]
    cols = ["workload", "targets (ms)", "load", "offered req/s", "best fixed (window, cap)", "its goodput",
            "adaptive goodput", "adaptive / best", "adaptive / picked on the other seeds"] + \
        [f"{before_label} / best"] * bool(before) + ["worst P99 E2E, best / adaptive (ms)"] + \
        ["per second of the run: best fixed, adaptive / it"] * ("run_best" in rows[0] if rows else False) + \
        ["`continuous`: goodput, per second of the run, worst P99 (ms)"] * token
    out += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        w, c = r["best"]
        targets = f"TPOT {r['tpot_ms']:g}" + (f", E2E {r['e2e_ms']:,.0f}" if r["e2e_ms"] is not None else "")
        prev = old.get(_key(r))
        cells = [r["mix"], targets, f"{r['share']:g}x", f"{r['rate']:.2f}", f"{w:g} ms, {c}",
                 f"{r['best_goodput']:.2f} ({r['best_attainment']:.0%})",
                 f"{r['adaptive_goodput']:.2f} ({r['adaptive_attainment']:.0%})",
                 ratio(r["adaptive_goodput"], r["best_goodput"]),
                 ratio(r["adaptive_goodput"], r["held_out"]) if r["held_out"] is not None else "–"] + \
            ([ratio(prev["adaptive_goodput"], r["best_goodput"]) if prev else "–"] if before else []) + \
            [f"{r['best_p99']:,.0f} / {r['adaptive_p99']:,.0f}"] + \
            ([f"{r['run_best'][0]:g} ms, {r['run_best'][1]}: {r['run_best_goodput']:.2f}; "
              f"{ratio(r['run_adaptive_goodput'], r['run_best_goodput'])}"
              + (f" ({before_label} {ratio(prev['run_adaptive_goodput'], r['run_best_goodput'])})"
                 if prev and "run_adaptive_goodput" in prev else "")] if "run_best" in r else []) + \
            ([f"{r['continuous']['goodput']:.2f} ({r['continuous']['attainment']:.0%}); "
              f"{r['continuous']['run_goodput']:.2f}; {r['continuous']['p99']:,.0f}"] if token else [])
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


LIVE_GRID = [(w, c) for w in (0.0, 50.0) for c in (4, 16, 32)]


def live(n: int, seed: int, rounds: int, mix: str = "short-long", eos_cap: int | None = None
         ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The `mix` cells on the real engine: capacity under 50 ms / 32, the step time of a batch of
    one (the TPOT of requests run one at a time), then each TPOT target through every live grid
    point and `dynamic`, `rounds` times; medians over the rounds. `eos_cap`: every request asks
    for that many tokens and its output ends at the model's EOS, so no one knows its length
    ahead (None: each asks for its drawn length and runs to it)."""
    engine_run, model = live_engine()

    def one(items: list[Any], sched: dict[str, Any], slo: SLO | None = None) -> dict[str, Any]:
        return engine_run(items, sched, None, slo, ignore_eos=eos_cap is None)

    def wl(k: int, rate: float, s: int = seed) -> list[Any]:
        return workload(mix, k, rate, s, eos_cap)

    one(wl(8, 100.0, seed + 99), dict(policy="static", window_ms=50.0, max_batch=32))  # warm up
    full = one(wl(64, SATURATION_RATE), dict(policy="static", window_ms=50.0, max_batch=32))
    cap = full["throughput_rps"]
    alone = one(wl(16, SATURATION_RATE), dict(policy="static", window_ms=0.0, max_batch=1))
    step_ms = alone["latency"]["tpot_ms"]["p50"]
    ended = full["finish_reasons"].get("stop", 0) / max(1, sum(full["finish_reasons"].values()))
    print(f"live: {mix}: capacity {cap:.2f} req/s, a step alone {step_ms:.1f} ms, {ended:.0%} ended at EOS",
          flush=True)
    items = wl(n, 0.7 * cap)
    rows = []
    t0 = time.perf_counter()
    for x in (2.0, 4.0):
        tpot = round(x * step_ms, 1)
        slo = SLO(tpot_ms=tpot)
        configs: dict[Any, dict[str, Any]] = {k: dict(policy="static", window_ms=k[0], max_batch=k[1])
                                              for k in LIVE_GRID}
        configs["adaptive"] = dict(policy="dynamic", max_batch=max(c for _, c in LIVE_GRID),
                                   window_max_ms=max(w for w, _ in LIVE_GRID), slo_tpot_ms=tpot)
        keys = list(configs)
        runs: dict[Any, list[tuple[float, float, float]]] = {k: [] for k in keys}
        for r in range(rounds):
            shift = r % len(keys)
            for k in keys[shift:] + keys[:shift]:
                s = one(items, configs[k], slo)
                runs[k].append((goodput_of(s["goodput"]["n_good"], items), s["goodput"]["n_good"] / len(items),
                                s["latency"]["e2e_ms"]["p99"]))
                print(f"live round {r + 1} TPOT {tpot:g} ms {k}: goodput {runs[k][-1][0]:.2f} "
                      f"({runs[k][-1][1]:.0%}), P99 {runs[k][-1][2]:,.0f} ms", flush=True)
        med = {k: tuple(statistics.median(v[i] for v in runs[k]) for i in range(3)) for k in keys}
        best = max(LIVE_GRID, key=lambda k: (med[k][0], -med[k][2]))
        rows.append({"mix": mix, "tpot_ms": tpot, "e2e_ms": None, "share": 0.7,
                     "rate": len(items) / max(items[-1].arrival, 1e-9), "best": list(best),
                     "best_goodput": med[best][0], "best_attainment": med[best][1], "best_p99": med[best][2],
                     "adaptive_goodput": med["adaptive"][0], "adaptive_attainment": med["adaptive"][1],
                     "adaptive_p99": med["adaptive"][2],
                     # against the same point's run of that round: how far the noise reaches
                     "rounds": [a / b if b > 0 else math.inf
                                for (a, _, _), (b, _, _) in zip(runs["adaptive"], runs[best])],
                     "held_out": held_out({k: [g for g, _, _ in runs[k]] for k in LIVE_GRID})})
    return rows, {"n": n, "seed": seed, "rounds": rounds, "capacity": cap, "step_ms": step_ms, "mix": mix,
                  "eos_cap": eos_cap, "ended": ended, "wall_s": time.perf_counter() - t0, "model": model}


def live_markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    cpu = cpu_name()
    eos_cap, mix = meta["eos_cap"], meta["mix"]
    cmd = (f"python -m benchmarks.adaptive_tpot --live --live-requests {meta['n']} --rounds {meta['rounds']}"
           + (f" --live-mix {mix}" if mix != "short-long" else "") + (f" --max-tokens {eos_cap}" if eos_cap else ""))
    ends = ("every output runs to its max_tokens" if eos_cap is None else
            f"every request asks for max_tokens {eos_cap} and its output ends at the model's EOS "
            f"({meta['ended']:.0%} did in the capacity run), so no one knows a length ahead")
    out = [f"## {SECTION}, live{eos_title(eos_cap)}", "",
           f"The question above on this engine ({datetime.date.today().isoformat()}; {cpu}, {os.cpu_count()} cores, "
           f"{meta['model']}; command `{cmd}`; {meta['n']} requests of the {mix} mix at scale {SCALE}, seed "
           f"{meta['seed']}, at 0.7 of its capacity under 50 ms / 32 ({meta['capacity']:.2f} req/s); TPOT targets 2x "
           f"and 4x the measured time per token of requests run one at a time ({meta['step_ms']:.1f} ms); {ends}). "
           f"Grid: windows {', '.join(sorted({f'{w:g}' for w, _ in LIVE_GRID}))} ms x caps "
           f"{', '.join(str(c) for c in sorted({c for _, c in LIVE_GRID}))}; `dynamic` with window <= "
           f"{max(w for w, _ in LIVE_GRID):g} ms, cap <= {max(c for _, c in LIVE_GRID)}; medians over the rounds, the "
           f"order rotating. Live timings move about 15 % run to run.", ""]
    cols = ["targets (ms)", "offered req/s", "best fixed (window, cap)", "its goodput", "adaptive goodput",
            "adaptive / best", "the same, round by round", "adaptive / picked on the other rounds",
            "P99 E2E, best / adaptive (ms)"]
    out += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        w, c = r["best"]
        out.append("| " + " | ".join([
            f"TPOT {r['tpot_ms']:g}", f"{r['rate']:.2f}", f"{w:g} ms, {c}",
            f"{r['best_goodput']:.2f} ({r['best_attainment']:.0%})",
            f"{r['adaptive_goodput']:.2f} ({r['adaptive_attainment']:.0%})",
            ratio(r["adaptive_goodput"], r["best_goodput"]), ", ".join(f"{x:.2f}" for x in r["rounds"]),
            ratio(r["adaptive_goodput"], r["held_out"]) if r["held_out"] is not None else "–",
            f"{r['best_p99']:,.0f} / {r['adaptive_p99']:,.0f}"]) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=300, help="requests per cell and seed")
    ap.add_argument("--seeds", default="0,1,2,3,4", help="workload seeds, comma-separated")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="simulated cells run at a time")
    ap.add_argument("--json", default=None, help="also write the rows as JSON to this file")
    ap.add_argument("--before", default=None, help="rows an earlier version wrote with --json, as a column")
    ap.add_argument("--before-label", default="before", help="that column's name")
    ap.add_argument("--out", default=None, help="write the section into this Markdown file")
    ap.add_argument("--live", action="store_true", help="instead: one mix's cells on the real engine")
    ap.add_argument("--live-mix", default="short-long", help="live: the workload mix")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="every request asks for this many; its output ends at its EOS (simulated: its drawn length)")
    ap.add_argument("--live-requests", type=int, default=80, help="live: requests per run")
    ap.add_argument("--rounds", type=int, default=2, help="live: runs of every configuration per target (medians)")
    a = ap.parse_args(argv)
    if a.live:
        rows, meta = live(a.live_requests, int(a.seeds.split(",")[0]), a.rounds, a.live_mix, a.max_tokens)
        text = live_markdown(rows, meta)
        print(text)
        print(f"\n({meta['wall_s']:.0f} s)")
        if a.out:
            write_section(a.out, f"## {SECTION}, live{eos_title(a.max_tokens)}", text)
        return
    rows, meta = run(a.requests, [int(x) for x in a.seeds.split(",")], max(1, a.jobs), a.max_tokens)
    before = None
    if a.before:
        with open(a.before) as f:
            before = json.load(f)
    text = markdown(rows, meta, before, a.before_label)
    print(text)
    print(f"\n({meta['wall_s']:.0f} s)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    if a.out:
        write_section(a.out, f"## {SECTION}{eos_title(a.max_tokens)}", text)


if __name__ == "__main__":
    main()
