"""Adaptive against fixed points on this machine's measured speed swings, simulated.

    python -m benchmarks.adaptive_curves --regime day --cap-at-1 8 --slo-ms 2000
    python -m benchmarks.adaptive_curves --regime "on/off bursts" --cap 16 --speeds 0.6,0.8,1.0

`benchmarks.adaptive_paired --json` keeps every live run's speed curve (runner time against
the profile per 2 s window, relative to the run's mean) and calibration. Here each kept curve
is replayed (`benchmarks.fidelity.ReplayedSpeed`) at several overall speeds s (runner time vs
profile, decodes; prompts in the run's proportion), and every configuration of the paired
grid is simulated on it: one case per curve and speed, each a deterministic test of the
controller on a speed swing that happened. The load is `--cap` req/s x the regime's share,
or, with `--cap-at-1 C`, C / s x that share (the capacity moves with the speed, so a day
stays a day at every s). Per case the controller's goodput over the best fixed point's;
pooled, the sums over all cases; and the tail: in how many cases the controller's P99 end to
end is no worse than that best fixed point's, and the median of its P99 over that point's.

With `--jitter CV --draws K`, every curve and speed is also simulated K times, each step's
time drawn around its window's (`ReplayedSpeed`'s jitter): K cases instead of one. A
deterministic replay is one draw of a process whose batch decisions can tip on a few
milliseconds; the spread between draws (the standard deviation of goodput over their mean,
per curve and speed, the median over them) says how far one live run of a configuration can
land from its own mean.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import tempfile
from multiprocessing import Pool
from typing import Any

from batchserve.config import CacheConfig, EngineConfig, SchedulerConfig
from batchserve.sim.cost import ProfiledCost
from benchmarks.adaptive import REGIMES, goodput_of, regime_items
from benchmarks.adaptive_paired import best_fixed, configs
from benchmarks.fidelity import simulate_replayed

DEFAULT_CURVES = os.path.join(os.path.dirname(__file__), "data", "speed_curves.json")


def case(args: tuple[str, dict[str, Any], float, str, float, bool, float, int, float, int]) \
        -> dict[str, tuple[float, float]]:
    """Every configuration's (goodput, P99 end to end in ms) on one curve at overall speed s,
    with step jitter `cv` drawn from `seed`."""
    profile, row, s, regime, cap, scaled, slo_ms, n, cv, seed = args
    cal = row["calibration"]
    own = ProfiledCost(profile, kv_cache_gb=0.5, overhead_s=cal["overhead_s"], scale=s,
                       prompt_scale=cal["prompt_scale"] * s / cal["scale"])
    items = regime_items(regime, cap / s if scaled else cap, n, 0)
    out = {}
    for name, kw in configs().items():
        cfg = EngineConfig(cache=CacheConfig(kv_cache_gb=0.5, prefix_caching=False),
                           scheduler=SchedulerConfig(slo_p99_ms=slo_ms, **kw))
        summary = simulate_replayed(cfg, own, row["curve"], items, slo_ms, jitter=cv, seed=seed)
        out[name] = goodput_of(summary["goodput"]["n_good"], items), summary["latency"]["e2e_ms"]["p99"]
    return out


def run(profile: str, curves: list[dict[str, Any]], speeds: list[float], regime: str, cap: float, scaled: bool,
        slo_ms: float, n: int, procs: int, cv: float = 0.0, draws: int = 1) -> dict[str, Any]:
    """One regime under one SLO over every curve x speed (x draw, with jitter): how often and by
    how much the controller trails the best fixed point, the pooled ratio, and the spread."""
    jobs = [(profile, row, s, regime, cap, scaled, slo_ms, n, cv, d)
            for row, s, d in itertools.product(curves, speeds, range(draws))]
    with Pool(procs) as pool:
        both = pool.map(case, jobs)
    cases = [{k: g for k, (g, _) in c.items()} for c in both]
    bests = [best_fixed(c) for c in cases]
    ratios = [c["adaptive"] / c[b] if c[b] > 0 else 1.0 for c, b in zip(cases, bests)]
    tails = sorted(t["adaptive"][1] / t[b][1] for t, b in zip(both, bests))
    pooled = {k: sum(c[k] for c in cases) for k in cases[0]}
    best = best_fixed(pooled)
    groups = [cases[i:i + draws] for i in range(0, len(cases), draws)]  # one curve and speed, every draw
    return {"regime": regime, "load": f"{cap:g} / s" if scaled else f"{cap:g}", "slo_ms": slo_ms, "cases": len(cases),
            "at_least": sum(r >= 0.999 for r in ratios), "worst": min(ratios),
            "pooled": pooled["adaptive"] / pooled[best], "pooled_best": best,
            "p99_no_worse": sum(r <= 1.001 for r in tails), "p99_median": tails[len(tails) // 2],
            "spread": (spread(groups, "adaptive"), spread(groups, best)) if draws > 1 else None}


def spread(groups: list[list[dict[str, float]]], name: str) -> float:
    """The median over `groups` (the draws of one curve and speed) of `name`'s goodput's
    standard deviation over its mean."""
    cvs = sorted(statistics.pstdev(g) / m if (m := statistics.fmean(g)) > 0 else 0.0
                 for g in ([c[name] for c in grp] for grp in groups))
    return cvs[len(cvs) // 2]


def markdown(rows: list[dict[str, Any]]) -> list[str]:
    jittered = any(r["spread"] for r in rows)
    head = ["regime", "load (req/s x share)", "SLO (ms)", "cases", "adaptive >= best fixed", "worst case",
            "pooled: adaptive / best (which)", "P99 no worse than the best's", "P99 / best's, median"] + \
        ["goodput's spread between draws: adaptive / that best"] * jittered
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        out.append(f"| {r['regime']} | {r['load']} | {r['slo_ms']:,.0f} | {r['cases']} | {r['at_least']} | "
                   f"{r['worst']:.3f}x | **{r['pooled']:.3f}x** ({r['pooled_best']}) | {r['p99_no_worse']} | "
                   f"{r['p99_median']:.3f}x |" + (f" {r['spread'][0]:.1%} / {r['spread'][1]:.1%} |" if jittered else ""))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--curves", default=DEFAULT_CURVES, help="speed curves with their profile (default: the kept set)")
    ap.add_argument("--regime", action="append", choices=list(REGIMES), help="load regime (repeatable; default day)")
    load = ap.add_mutually_exclusive_group(required=True)
    load.add_argument("--cap", type=float, help="capacity in req/s that the regime's load is a share of")
    load.add_argument("--cap-at-1", type=float, help="that capacity at speed 1, divided by each speed")
    ap.add_argument("--slo-ms", default="2000", help="end-to-end SLOs, comma-separated")
    ap.add_argument("--speeds", default="0.6,0.8,1.0", help="runner time vs profile, comma-separated")
    ap.add_argument("--requests", type=int, default=160)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--jitter", type=float, default=0.0, help="each step's time drawn with this coefficient of variation")
    ap.add_argument("--draws", type=int, default=1, help="with --jitter: runs per curve and speed")
    a = ap.parse_args(argv)
    with open(a.curves) as f:
        data = json.load(f)
    speeds = [float(x) for x in a.speeds.split(",")]
    with tempfile.NamedTemporaryFile("w", suffix=".json") as profile:  # ProfiledCost reads a file
        json.dump(data["profile"], profile)
        profile.flush()
        rows = [run(profile.name, data["rows"], speeds, reg, a.cap if a.cap is not None else a.cap_at_1,
                    a.cap is None, float(slo), a.requests, a.procs, a.jitter, a.draws)
                for slo in a.slo_ms.split(",") for reg in a.regime or ["day"]]
    print("\n".join(markdown(rows)))


if __name__ == "__main__":
    main()
