"""Adaptive against fixed points, live, with the machine's speed held equal by replay.

    python -m benchmarks.adaptive_paired --cap 10.66 --slo-ms 2000 --rounds 2
    python -m benchmarks.adaptive_paired --profile prof.json --regime "on/off bursts"

A live cell of `benchmarks.adaptive --live` runs each configuration in its own minute, and
this CPU's speed moves by 10-30 % from one minute to the next, so a cell near a tie is
decided by when each configuration ran. Here every configuration's live run is logged step
by step (`benchmarks.fidelity.TimedExecutor`), its speed against the profile measured per
2 s window (`speed_curve`), and every configuration simulated under that same speed
(`ReplayedSpeed`). Each row then gives:
- live: that run's goodput and P99;
- replayed, itself: the simulator on that run's speed; against live, the replay's fidelity
  for this policy;
- replayed, all: each configuration on that one speed curve; the comparison with the
  machine's minute taken out.
`--cap` is the capacity the load is a share of (as `benchmarks.adaptive` calibrates it under
50 ms / 32); the profile is `batchserve profile`'s (measured here when none is given).
"""
from __future__ import annotations

import argparse
import json
from typing import Any

from batchserve.bench.metrics import summarize, span_s
from batchserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from batchserve.sim.cost import ProfiledCost
from benchmarks.adaptive import LIVE_GRID, REGIMES, goodput_of, ratio, regime_items
from benchmarks.fidelity import TimedExecutor, calibrated, live_run, simulate_replayed, speed_of


def configs() -> dict[str, dict[str, Any]]:
    out = {"adaptive": dict(policy="dynamic", max_batch=max(c for _, c in LIVE_GRID),
                            window_max_ms=max(w for w, _ in LIVE_GRID))}
    out.update({f"{w:g} ms / {c}": dict(policy="static", window_ms=w, max_batch=c) for w, c in LIVE_GRID})
    return out


def run(profile: str, cap: float, slo_ms: float, regime: str, n: int, rounds: int, seed: int) -> list[dict[str, Any]]:
    from batchserve.engine.engine import LLMEngine
    from batchserve.runner.loader import load_model
    from batchserve.runner.model_runner import ModelRunner

    mcfg = ModelConfig()
    loaded = load_model(mcfg)
    runner = ModelRunner(loaded, mcfg, CacheConfig(kv_cache_gb=0.5))
    timed = TimedExecutor(runner, ProfiledCost(profile, num_blocks=runner.num_blocks))
    grid = configs()

    def engine_config(name: str) -> EngineConfig:
        return EngineConfig(cache=CacheConfig(num_blocks=runner.num_blocks, prefix_caching=False),
                            scheduler=SchedulerConfig(slo_p99_ms=slo_ms, **grid[name]))

    def score(summary: dict[str, Any]) -> tuple[float, float]:
        return goodput_of(summary["goodput"]["n_good"], items), summary["latency"]["e2e_ms"]["p99"]

    items = regime_items(regime, cap, n, seed)
    live_run(LLMEngine(engine_config("adaptive"), timed, loaded.tokenizer, None), regime_items(regime, cap, 40, seed + 9))
    rows = []
    for r in range(rounds):
        names = list(grid)[r % len(grid):] + list(grid)[:r % len(grid)]  # the order rotates
        for name in names:
            timed.reset()
            recs, over = live_run(LLMEngine(engine_config(name), timed, loaded.tokenizer, None), items)
            own = calibrated(profile, timed, over)
            curve = speed_of(timed, own)
            replayed = {other: score(simulate_replayed(engine_config(other), own, curve, items, slo_ms))
                        for other in grid}
            rows.append({"round": r + 1, "ran": name, "live": score(summarize(recs, span_s(recs), slo_ms)),
                         "replayed": replayed, "calibration": {"overhead_s": own.overhead_s, "scale": own.scale,
                                         "prompt_scale": own.prompt_scale}, "curve": curve})
            print(format_row(rows[-1]), flush=True)
    return rows


def best_fixed(goodput: dict[str, float]) -> str:
    """The fixed point with the most goodput."""
    return max((k for k in goodput if k != "adaptive"), key=lambda k: goodput[k])


def format_row(row: dict[str, Any]) -> str:
    rep, curve = {k: g for k, (g, _) in row["replayed"].items()}, row["curve"]
    return (f"| {row['round']} | {row['ran']} | {row['live'][0]:.2f} / {row['live'][1]:,.0f} | "
            f"{row['calibration']['scale']:.2f} ({min(curve):.2f}–{max(curve):.2f}) | "
            f"{rep[row['ran']]:.2f} | " + " | ".join(f"{rep[k]:.2f}" for k in configs()) +
            f" | {ratio(rep['adaptive'], rep[best_fixed(rep)])} |")


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    names = list(configs())
    head = ["round", "ran live", "live goodput / P99 ms", "runner time vs profile, decodes (2 s windows vs that mean)",
            "replayed, itself"] + [f"replayed: {k}" for k in names] + ["adaptive / best fixed, replayed"]
    pooled = {k: sum(r["replayed"][k][0] for r in rows) for k in names}
    best = best_fixed(pooled)
    # on the fixed points' own curves only: the adaptive run's curve also carries any error of the
    # profile on its own batch shapes, which replaying it would charge to the fixed points
    theirs = {k: sum(r["replayed"][k][0] for r in rows if r["ran"] != "adaptive") for k in names}
    their_best = best_fixed(theirs)
    live = {k: sum(r["live"][0] for r in rows if r["ran"] == k) for k in names}
    live_best = best_fixed(live)
    return "\n".join([
        f"`python -m benchmarks.adaptive_paired --cap {meta['cap']:g} --slo-ms {meta['slo_ms']:g} --regime "
        f"\"{meta['regime']}\" --rounds {meta['rounds']}`: {meta['n']} requests, seed {meta['seed']}, goodput in "
        "requests within the SLO per second of offered traffic.", "",
        "| " + " | ".join(head) + " |", "|" + "---|" * len(head), *(format_row(r) for r in rows), "",
        f"Pooled over every speed curve: adaptive {pooled['adaptive']:.2f} against {pooled[best]:.2f} for {best} "
        f"(**{ratio(pooled['adaptive'], pooled[best])}**); on the fixed points' runs' curves only: "
        f"{theirs['adaptive']:.2f} against {theirs[their_best]:.2f} for {their_best} "
        f"({ratio(theirs['adaptive'], theirs[their_best])}); live, each in its own minute: adaptive "
        f"{live['adaptive']:.2f} against {live[live_best]:.2f} for {live_best} "
        f"({ratio(live['adaptive'], live[live_best])})."])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=None, help="a `batchserve profile` JSON file (default: measure one)")
    ap.add_argument("--cap", type=float, required=True, help="capacity in req/s that the regime's load is a share of")
    ap.add_argument("--slo-ms", type=float, required=True, help="end-to-end SLO")
    ap.add_argument("--regime", default="day", choices=list(REGIMES))
    ap.add_argument("--requests", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write every row, with its calibration and speed curve, here")
    a = ap.parse_args(argv)
    path = a.profile
    if path is None:
        from batchserve.runner.profiler import run_profile, save
        path = "fidelity_profile.json"
        save(run_profile(EngineConfig(cache=CacheConfig(kv_cache_gb=0.5))), path)
    rows = run(path, a.cap, a.slo_ms, a.regime, a.requests, a.rounds, a.seed)
    if a.json:  # each curve with its calibration and the profile replays that run in the simulator
        with open(a.json, "w") as f:
            json.dump({"profile": path, "cap": a.cap, "slo_ms": a.slo_ms, "regime": a.regime,
                       "requests": a.requests, "seed": a.seed, "rows": rows}, f, indent=1)
    print()
    print(markdown(rows, {"cap": a.cap, "slo_ms": a.slo_ms, "regime": a.regime, "n": a.requests,
                          "rounds": a.rounds, "seed": a.seed}))


if __name__ == "__main__":
    main()
