"""Where cascading pays: continuous batching on one and on two devices against the `cascade`
policy on two (a prefill device and a decode device, `batchserve.sim.cascade`), on the
simulated roofline of the seed's case studies (A100-80GB SXM, Llama-2-7B FP16, 16-token
blocks, 4,096 tokens a step), over prompt/output mixes and the mixed-step interference
factor f of `batchserve.sim.cost` (f = 1: the plain roofline; f > 1: a mixed step is slower
than the roofline says by f - 1 of its decodes' own step).

    python -m benchmarks.cascade                       # the full sweep, a Markdown table
    python -m benchmarks.cascade --requests 300 --mixes chat --interference 1,2

Layouts, all with 128 decode seats except the last continuous one:

    continuous x1     one device, 128 seats                    (half the hardware: the reference)
    continuous x2     two replicas, 64 seats each, requests routed between them (equal seats)
    continuous x2     two replicas, 128 seats each             (equal hardware, each device full)
    cascade 1P+1D     a prefill device (64 prompts a step) and a decode device with 128 seats

Throughput is output tokens/s with the whole workload queued at once ("devices busy": each
device's share of that run spent in steps; cascade: prefill / decode); TTFT and TPOT P99 are
at a Poisson load of `--load` times the least saturation rate of the two-device layouts at
f = 1 (a rate every two-device layout carries, so the latencies compare service, not
overload). The cascade's devices never run a mixed step, so f leaves it unchanged.

Reporting around the simulator, not part of it; it prints, and writes nothing.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from batchserve.bench.workload import RequestClass, WorkItem, make_workload
from batchserve.config import CacheConfig, EngineConfig, SchedulerConfig
from batchserve.scenarios.common import GPU, MODEL, SATURATION_RATE
from batchserve.sim.cascade import CascadeSimulator
from batchserve.sim.cluster import ClusterSimulator
from batchserve.sim.cost import RooflineCost
from batchserve.sim.simulator import Simulator

MIXES: dict[str, str | tuple[RequestClass, ...]] = {
    "short-long": "short-long",  # the seed's 4.4.3 mix: 90 % 64 in / 32 out, 10 % 64 / 512
    "chat": (RequestClass("chat", 1.0, 200, 200, cv=0.3),),
    "prompt-heavy": (RequestClass("rag", 1.0, 1500, 100, cv=0.3),),
    "decode-heavy": (RequestClass("story", 1.0, 100, 800, cv=0.3),),
}
SEATS = 128
TOKENS = 4096


def config(policy: str, seats: int, **sched: Any) -> EngineConfig:
    s = SchedulerConfig(policy=policy, max_num_seqs=seats, max_num_batched_tokens=TOKENS, **sched)
    return EngineConfig(cache=CacheConfig(block_size=16), scheduler=s)


Run = tuple[dict[str, Any], list[float]]  # bench's summary, each device's share of the run spent in steps


@dataclass(frozen=True)
class Layout:
    label: str
    seats: str
    run: Callable[[RooflineCost, Sequence[WorkItem]], Run]
    mixes_steps: bool = True  # whether f changes it


def _one(cost: RooflineCost, items: Sequence[WorkItem]) -> Run:
    res = Simulator(config("continuous", SEATS), cost).run(items)
    return res.summary, [res.busy_s / res.summary["duration_s"]]


def _two(seats: int) -> Callable[[RooflineCost, Sequence[WorkItem]], Run]:
    def run(cost: RooflineCost, items: Sequence[WorkItem]) -> Run:
        res = ClusterSimulator(config("continuous", seats), cost, replicas=2, seed=0).run(items)
        return res.summary, [e["busy_frac"] for e in res.engines]
    return run


def _cascade(cost: RooflineCost, items: Sequence[WorkItem]) -> Run:
    cfg = config("cascade", SEATS, prefill_max_batch=64, decode_max_batch=SEATS)
    res = CascadeSimulator(cfg, cost, cost).run(items)
    return res.summary, [res.stages["prefill"]["busy_frac"], res.stages["decode"]["busy_frac"]]


LAYOUTS = (Layout("continuous x1", "128", _one), Layout("continuous x2", "2 x 64", _two(SEATS // 2)),
           Layout("continuous x2", "2 x 128", _two(SEATS)),
           Layout("cascade 1P+1D", "128 decode", _cascade, mixes_steps=False))
EQUAL_SEATS, FULL, CASCADE = 1, 2, 3  # indices into LAYOUTS


def workload(mix: str, n: int, rate: float, seed: int) -> list[WorkItem]:
    return make_workload(MIXES[mix], n, rate, seed=seed)


def sweep(mixes: Sequence[str], factors: Sequence[float], n: int, load: float, seed: int,
          log: Any = sys.stderr) -> list[dict[str, Any]]:
    """One row per mix, f and layout: saturation tok/s, and TTFT / TPOT P99 at the load."""
    rows: list[dict[str, Any]] = []
    for mix in mixes:
        sat_items = workload(mix, n, SATURATION_RATE, seed)
        sat: dict[tuple[int, float], Run] = {}
        for f in factors:
            cost = RooflineCost(GPU, MODEL, interference=f)
            for k, lay in enumerate(LAYOUTS):
                if not lay.mixes_steps and f != factors[0]:
                    sat[k, f] = sat[k, factors[0]]
                    continue
                sat[k, f] = lay.run(cost, sat_items)
        base = factors[0]
        rate = load * min(sat[k, base][0]["throughput_rps"] for k in range(1, len(LAYOUTS)))
        load_items = workload(mix, n, rate, seed)
        lat: dict[tuple[int, float], Run] = {}
        for f in factors:
            cost = RooflineCost(GPU, MODEL, interference=f)
            for k, lay in enumerate(LAYOUTS):
                if not lay.mixes_steps and f != base:
                    lat[k, f] = lat[k, base]
                    continue
                lat[k, f] = lay.run(cost, load_items)
            for k, lay in enumerate(LAYOUTS):
                (s, busy), (ls, _) = sat[k, f], lat[k, f]
                rows.append({"mix": mix, "f": f, "layout": lay.label, "seats": lay.seats, "rate": rate,
                             "tok_s": s["output_tokens_per_s"], "busy": busy,
                             "failed": s["n_requests"] - s["n_ok"] + ls["n_requests"] - ls["n_ok"],
                             "ttft_p99": ls["latency"]["ttft_ms"]["p99"], "tpot_p99": ls["latency"]["tpot_ms"]["p99"]})
        print(f"[{mix}: done, load {rate:.1f} req/s]", file=log, flush=True)
    return rows


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def format_table(rows: list[dict[str, Any]]) -> str:
    out = ["| mix | f | layout | seats | output tok/s (saturation) | x continuous x2, 2 x 64 | devices busy "
           "| load (req/s) | TTFT P99 (ms) | TPOT P99 (ms) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rows):
        ref = rows[i - i % len(LAYOUTS) + EQUAL_SEATS]["tok_s"]
        busy = " / ".join(f"{b:.0%}" for b in r["busy"])
        out.append(f"| {r['mix']} | {r['f']:g} | {r['layout']} | {r['seats']} | {r['tok_s']:,.0f} | "
                   f"{r['tok_s'] / ref:.2f} | {busy} | {r['rate']:.1f} | {_ms(r['ttft_p99'])} | "
                   f"{_ms(r['tpot_p99'])} |")
    return "\n".join(out)


def verdict(rows: list[dict[str, Any]]) -> list[str]:
    """Where cascade beats the two-replica layouts, and by how much, read off the rows."""
    groups = [rows[i:i + len(LAYOUTS)] for i in range(0, len(rows), len(LAYOUTS))]
    lines: list[str] = []
    for name, k in (("2 x 64 seats (equal seats)", EQUAL_SEATS), ("2 x 128 seats (each device full)", FULL)):
        tput, tpot, ttft = [], [], []
        for g in groups:
            c, o = g[CASCADE], g[k]
            where = f"{c['mix']} f={c['f']:g}"
            if c["tok_s"] > 1.02 * o["tok_s"]:
                tput.append(f"{where} ({c['tok_s'] / o['tok_s']:.2f}x)")
            if c["tpot_p99"] and o["tpot_p99"] and c["tpot_p99"] < 0.98 * o["tpot_p99"]:
                tpot.append(f"{where} ({o['tpot_p99'] / c['tpot_p99']:.2f}x lower)")
            if c["ttft_p99"] and o["ttft_p99"] and c["ttft_p99"] < 0.98 * o["ttft_p99"]:
                ttft.append(f"{where} ({o['ttft_p99'] / c['ttft_p99']:.2f}x lower)")
        lines.append(f"- Against continuous x2 at {name}: cascade has more throughput at saturation in "
                     f"{_list(tput)}; a lower TPOT P99 in {_list(tpot)}; a lower TTFT P99 in {_list(ttft)}.")
    lost = [g[CASCADE] for g in groups if g[CASCADE]["tok_s"] < 0.98 * g[EQUAL_SEATS]["tok_s"]]
    if lost:
        lines.append("- Cascade has less throughput than equal-seat replicas in "
                     + _list([f"{c['mix']} f={c['f']:g}" for c in lost])
                     + " (its devices' busy shares in the table say which stage held it back).")
    failed = [f"{r['layout']} ({r['seats']}) {r['mix']} f={r['f']:g}: {r['failed']}" for r in rows if r["failed"]]
    if failed:
        lines.append(f"- Requests that did not complete (left out of the latencies): {_list(failed)}.")
    return lines


def _list(xs: list[str]) -> str:
    return ", ".join(xs) if xs else "none"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.cascade",
                                 description="Simulated: continuous on 1 and 2 devices vs cascade on 2.")
    ap.add_argument("--requests", type=int, default=800, help="requests per run")
    ap.add_argument("--mixes", default=",".join(MIXES), help=f"of {sorted(MIXES)}")
    ap.add_argument("--interference", default="1,1.5,2", help="mixed-step factors f to sweep (>= 1)")
    ap.add_argument("--load", type=float, default=0.7, help="latency runs' load, share of the two-device capacity")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    mixes = [m.strip() for m in a.mixes.split(",") if m.strip()]
    for m in mixes:
        if m not in MIXES:
            ap.error(f"--mixes: unknown {m!r}; choose from {sorted(MIXES)}")
    factors = [float(x) for x in a.interference.split(",") if x.strip()]
    t0 = time.perf_counter()
    rows = sweep(mixes, factors, a.requests, a.load, a.seed)
    print(f"Simulated roofline: {RooflineCost(GPU, MODEL).name}; {a.requests} requests per run, seed {a.seed}; "
          f"mixes (prompt / output means): short-long 64/32 and 64/512 (9:1), chat 200/200, "
          f"prompt-heavy 1500/100, decode-heavy 100/800.\n")
    print(format_table(rows))
    print()
    print("\n".join(verdict(rows)))
    print(f"\n[simulated in {time.perf_counter() - t0:.0f} s]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
