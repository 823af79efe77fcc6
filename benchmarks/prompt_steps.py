"""Steps with prompt tokens against their profile: live, and the same batches replayed.

    python -m benchmarks.prompt_steps [--profile prof.json] [--requests 120] [--scale 0.5] [--share 0.5]
    python -m benchmarks.prompt_steps --mix-shares 0.3,0.5,0.7,0.5,0.7,0.3   # composition only

The fidelity benchmark's warm-up measures how fast the runner runs against the profile, apart
for decode-only steps and steps with prompt tokens. This takes the second apart. One live run
(benchmarks.fidelity's driver, the chat workload at `--share` of the simulated capacity) logs
every step: its batch, measured time, the profile's prediction, and the idle time before it.
Then, in the same process, the logged batches run again in the live order: back to back; with
the live idle gaps slept; with them busy-waited; and each prompt batch once warm, repeated, as
the profiler times it. Last, a second live run after every page of the KV cache has been written
once (first-touch page faults out of the steps). Each line: measured / predicted, summed over
the steps with prompt tokens, and over the decode-only ones.

`--mix-shares` asks instead whether a prompt step's ratio follows its composition: one live run
per share, each step with prompt tokens set against the machine's speed at that moment (`mix`:
measured / predicted over the decode-only steps within `MIX_WINDOW_S` of it), which takes out
the drift that moves every kind of step together, then summed by how many prompts share the
step, how many decodes ride on it and how many prompt tokens it computes; per run and pooled.
"""
from __future__ import annotations

import argparse
import bisect
import copy
import dataclasses
import math
import time
from typing import Any, Callable

import torch

from batchserve.bench.workload import make_workload
from batchserve.config import CacheConfig, EngineConfig
from batchserve.runner.profiler import run_profile, save, time_step
from batchserve.sim.cost import ProfiledCost, has_prompt, step_rows
from batchserve.sim.runner import simulate
from benchmarks.fidelity import TimedExecutor, live_run


class LoggedExecutor(TimedExecutor):
    """TimedExecutor that also keeps each step: (batch, seconds, predicted, has prompt, idle before)."""

    def reset(self) -> None:
        super().reset()
        self.log: list[tuple[Any, float, float, bool, float]] = []
        self.end: float | None = None

    def execute(self, batch: Any) -> Any:
        start = time.perf_counter()
        idle = 0.0 if self.end is None else start - self.end
        out = super().execute(batch)
        self.end = time.perf_counter()
        self.log.append((copy.deepcopy(batch), self.last, self.cost.runner_time(batch), has_prompt(batch), idle))
        return out


def ratios(log: list, times: list[float]) -> tuple[float, float]:
    """Measured / predicted over the steps with prompt tokens, and over the decode-only ones."""
    out = []
    for prompt in (True, False):
        sel = [(t, e[2]) for t, e in zip(times, log) if e[3] == prompt]
        pred = sum(p for _, p in sel)
        out.append(sum(t for t, _ in sel) / pred if pred else float("nan"))
    return out[0], out[1]


MIX_WINDOW_S = 1.0  # `mix`: the machine's speed at a step, from the decode-only steps this close to it
MIX_BUCKETS = {"prompts": [(1, 1), (2, math.inf)], "decodes": [(0, 0), (1, 3), (4, 7), (8, 15), (16, math.inf)],
               "prompt tokens": [(1, 64), (65, 128), (129, 256), (257, math.inf)]}
MixStep = tuple[float, int, int, int, float, float]  # (start s, prompts, prompt tokens, decodes, measured s, predicted s)


def mix(runs: list[list[MixStep]], window: float = MIX_WINDOW_S) -> dict[str, list]:
    """Steps with prompt tokens against the local speed, by composition. Each run: its steps
    in order (`MixStep`). A step's local speed is measured / predicted summed over its own
    run's decode-only steps within `window` of its start (at least 5, else the step is left
    out). Returns, per `MIX_BUCKETS` key, (lo, hi, steps, sum measured / sum of local speed x
    predicted) for each bucket with steps."""
    rows = []
    for steps in runs:
        dec = [s for s in steps if s[2] == 0]
        starts = [s[0] for s in dec]
        for t, prompts, toks, decodes, meas, pred in steps:
            near = dec[bisect.bisect_left(starts, t - window):bisect.bisect_right(starts, t + window)]
            if toks and len(near) >= 5:
                rows.append((prompts, decodes, toks, meas, pred * sum(s[4] for s in near) / sum(s[5] for s in near)))
    out: dict[str, list] = {}
    for col, (key, buckets) in enumerate(MIX_BUCKETS.items()):
        sels = [(lo, hi, [r for r in rows if lo <= r[col] <= hi]) for lo, hi in buckets]
        out[key] = [(lo, hi, len(sel), sum(r[3] for r in sel) / sum(r[4] for r in sel)) for lo, hi, sel in sels if sel]
    return out


def format_mix(name: str, m: dict[str, list]) -> str:
    def b(lo: float, hi: float) -> str:
        return f"{lo}" if lo == hi else f"{lo}+" if hi == math.inf else f"{lo}-{hi}"
    return f"  {name}: " + "; ".join(f"{k} " + " ".join(f"{b(lo, hi)}: {r:.3f} ({n})" for lo, hi, n, r in v)
                                      for k, v in m.items())


def mix_steps(logged: "LoggedExecutor") -> list[MixStep]:
    """The logged run as `mix` reads it."""
    out = []
    for (start, secs, pred, _), entry in zip(logged.steps, logged.log):
        prefills, decode_ctx = step_rows(entry[0])
        out.append((start, len(prefills), sum(n for _, n in prefills), len(decode_ctx), secs, pred))
    return out


def replay(runner: Any, log: list, gap: Callable[[float], None] | None) -> list[float]:
    """The logged batches in order, `gap` spending each step's idle time before it (None: none)."""
    ts = []
    for batch, _, _, _, idle in log:
        if gap is not None and idle > 0:
            gap(idle)
        t0 = time.perf_counter()
        runner.execute(batch)
        ts.append(time.perf_counter() - t0)
    return ts


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=None, help="use this profile instead of measuring one")
    ap.add_argument("--requests", type=int, default=120, help="requests per live run")
    ap.add_argument("--scale", type=float, default=0.5, help="the chat workload's length scale")
    ap.add_argument("--share", type=float, default=0.5, help="arrival rate as a share of the simulated capacity")
    ap.add_argument("--mix-shares", default=None, help="instead: one live run per share, prompt steps by composition")
    a = ap.parse_args(argv)
    from batchserve.engine.engine import LLMEngine

    cfg = EngineConfig(cache=CacheConfig(kv_cache_gb=1.0))
    path = a.profile or "prompt_steps_profile.json"
    if a.profile is None:
        save(run_profile(dataclasses.replace(cfg)), path)
    engine = LLMEngine.from_config(cfg)
    runner = engine.executor
    logged = engine.executor = LoggedExecutor(runner, ProfiledCost(path, num_blocks=runner.num_blocks))

    def items(rate: float, seed: int) -> list:
        return make_workload("chat", a.requests, rate, seed=seed, scale=a.scale)

    sat = simulate(cfg, logged.cost, items(1e4, 0)).summary["throughput_rps"]
    rate = a.share * sat
    live_run(engine, items(rate, 100))  # warm-up
    if a.mix_shares:
        print("steps with prompt tokens, measured / (profile x the decode-only steps' speed within "
              f"{MIX_WINDOW_S:g} s), by composition (steps in brackets):")
        runs = []
        for share in [float(x) for x in a.mix_shares.split(",")]:
            logged.reset()
            live_run(engine, items(share * sat, 0))
            runs.append(mix_steps(logged))
            print(format_mix(f"{share:g} of capacity ({share * sat:.2f} req/s)", mix(runs[-1:])), flush=True)
        print(format_mix("pooled", mix(runs)))
        return
    logged.reset()
    live_run(engine, items(rate, 0))
    log = list(logged.log)
    n_prompt = sum(1 for e in log if e[3])
    print(f"{len(log)} steps ({n_prompt} with prompt tokens) at {rate:.2f} req/s; measured / profile, "
          "steps with prompt tokens | decode-only steps:")
    rows = [("live", [e[1] for e in log])]
    rows.append(("replayed back to back", replay(runner, log, None)))
    rows.append(("replayed, live idle gaps slept", replay(runner, log, time.sleep)))
    rows.append(("replayed, live idle gaps busy-waited", replay(runner, log, busy)))
    for name, ts in rows:
        p, d = ratios(log, ts)
        print(f"  {name}: {p:.3f} | {d:.3f}", flush=True)
    prompts = [e for e in log if e[3]]
    w = sum(time_step(runner, e[0], 3) for e in prompts) / sum(e[2] for e in prompts)
    print(f"  each prompt batch warmed and repeated (as profiled): {w:.3f} | -", flush=True)
    with torch.inference_mode():  # every page of the KV cache written once
        for k, v in runner.kv_caches:
            k.zero_()
            v.zero_()
    logged.reset()
    live_run(engine, items(rate, 0))
    p, d = ratios(logged.log, [e[1] for e in logged.log])
    print(f"  live again, the KV cache written once first: {p:.3f} | {d:.3f}", flush=True)


if __name__ == "__main__":
    main()
