"""Steps with prompt tokens against their profile: live, and the same batches replayed.

    python -m benchmarks.prompt_steps [--profile prof.json] [--requests 120] [--scale 0.5] [--share 0.5]

The fidelity benchmark's warm-up measures how fast the runner runs against the profile, apart
for decode-only steps and steps with prompt tokens. This takes the second apart. One live run
(benchmarks.fidelity's driver, the chat workload at `--share` of the simulated capacity) logs
every step: its batch, measured time, the profile's prediction, and the idle time before it.
Then, in the same process, the logged batches run again in the live order: back to back; with
the live idle gaps slept; with them busy-waited; and each prompt batch once warm, repeated, as
the profiler times it. Last, a second live run after every page of the KV cache has been written
once (first-touch page faults out of the steps). Each line: measured / predicted, summed over
the steps with prompt tokens, and over the decode-only ones.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import time
from typing import Any, Callable

import torch

from batchserve.bench.workload import make_workload
from batchserve.config import CacheConfig, EngineConfig
from batchserve.runner.profiler import run_profile, save, time_step
from batchserve.sim.cost import ProfiledCost, has_prompt
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

    rate = a.share * simulate(cfg, logged.cost, items(1e4, 0)).summary["throughput_rps"]
    live_run(engine, items(rate, 100))  # warm-up
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
