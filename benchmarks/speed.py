"""How fast the simulator runs, and what the scheduler costs per step.

    python -m benchmarks.speed                     # 100,000 chat requests, A100-80GB / Llama-2-7B
    python -m benchmarks.speed --requests 5000     # a quick look

Part 1, the end-to-end run: the chat mix, Poisson arrivals at `--rate`, the engine's default
policy (or `--policy`) with `--max-num-seqs` on the roofline model; reports wall time, steps and wall microseconds per
step. Part 2, the per-step cost at fixed batch sizes: a workload that keeps exactly B requests
decoding (all arrive at t=0, long outputs, max_num_seqs=B), timed over `--steps` steps after a
warm-up; reports microseconds per scheduled step (schedule + predicted execute + update, the
engine's whole step) and per sequence, at B = 64 and 256: the least and the median of `--repeats`
runs.
"""
from __future__ import annotations

import argparse
import time

from batchserve.bench.workload import make_workload
from batchserve.config import CacheConfig, EngineConfig, SchedulerConfig
from batchserve.request import SamplingParams
from batchserve.sim.cost import RooflineCost
from batchserve.sim.simulator import Simulator


def end_to_end(n: int, rate: float, max_num_seqs: int, seed: int = 0,
               policy: str = SchedulerConfig.policy) -> dict[str, float]:
    cost = RooflineCost("a100-80gb", "llama-2-7b")
    t0 = time.perf_counter()
    items = make_workload("chat", n, rate, seed=seed)
    t_wl = time.perf_counter() - t0
    cfg = EngineConfig(cache=CacheConfig(block_size=16),
                       scheduler=SchedulerConfig(policy=policy, max_num_seqs=max_num_seqs,
                                                 max_num_batched_tokens=4096))
    res = Simulator(cfg, cost, token_times=False, timeline_dt=1.0).run(items)
    s = res.summary
    return {"requests": n, "workload_s": t_wl, "wall_s": res.wall_s, "steps": res.num_steps,
            "us_per_step": 1e6 * res.wall_s / res.num_steps, "virtual_s": s["duration_s"],
            "throughput_rps": s["throughput_rps"], "e2e_p99_ms": s["latency"]["e2e_ms"]["p99"],
            "mean_seqs_per_step": res.engine_stats["tokens_computed"] / res.num_steps}


def per_step(batch: int, steps: int, policy: str = SchedulerConfig.policy) -> dict[str, float]:
    """Wall time of engine.step at a steady decode batch of `batch` sequences."""
    cost = RooflineCost("a100-80gb", "llama-2-7b")
    cfg = EngineConfig(cache=CacheConfig(block_size=16),
                       scheduler=SchedulerConfig(policy=policy, max_num_seqs=batch,
                                                 max_num_batched_tokens=max(4096, batch * 64)))
    sim = Simulator(cfg, cost, token_times=False)
    eng = sim.engine
    out_len = steps + 200
    for i in range(batch):
        ids = [1000 + (i * 31 + k) % 20000 for k in range(64)]
        eng.add_request(ids, SamplingParams(max_tokens=out_len, ignore_eos=True), now=0.0, request_id=f"s{i}")
    now = 0.0
    for _ in range(20):  # prefill and warm-up
        eng.step(now=now)
        now += sim.executor.last_step_time
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step(now=now)
        now += sim.executor.last_step_time
    dt = time.perf_counter() - t0
    for i in range(batch):
        eng.abort(f"s{i}", now)
    eng.step(now=now)
    return {"batch": batch, "us_per_step": 1e6 * dt / steps, "us_per_seq": 1e6 * dt / steps / batch}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--rate", type=float, default=15.0, help="chat requests/s (A100/7B at 256 seqs saturates near 19)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--policy", default=SchedulerConfig.policy)
    ap.add_argument("--steps", type=int, default=300, help="timed steps per batch size")
    ap.add_argument("--repeats", type=int, default=5,
                    help="measure each batch size this many times, alternating, and report the least and the median "
                         "(noise only adds time; the speed of some machines moves a lot from second to second)")
    ap.add_argument("--skip-e2e", action="store_true")
    a = ap.parse_args(argv)
    runs: dict[int, list[float]] = {64: [], 256: []}
    for _ in range(max(1, a.repeats)):
        for b in runs:
            runs[b].append(per_step(b, a.steps, a.policy)["us_per_step"])
    for b, us in runs.items():
        us.sort()
        print(f"batch {b}: {us[0]:.0f} us per scheduled step ({us[0] / b:.1f} us per sequence), the least of "
              f"{len(us)} runs; median {us[len(us) // 2]:.0f} us ({us[len(us) // 2] / b:.1f} us per sequence); all: "
              + ", ".join(f"{u:.0f}" for u in us))
    if not a.skip_e2e:
        r = end_to_end(a.requests, a.rate, a.max_num_seqs, policy=a.policy)
        print(f"{r['requests']} chat requests at {a.rate:g} req/s, {a.policy}, max_num_seqs {a.max_num_seqs}: "
              f"{r['wall_s']:.1f} s wall (+{r['workload_s']:.1f} s building the workload) for "
              f"{r['virtual_s']:.0f} s simulated; {r['steps']} steps, {r['us_per_step']:.0f} us/step, "
              f"{r['mean_seqs_per_step']:.0f} tokens/step; {r['throughput_rps']:.1f} req/s, "
              f"P99 E2E {r['e2e_p99_ms']:.0f} ms")


if __name__ == "__main__":
    main()
