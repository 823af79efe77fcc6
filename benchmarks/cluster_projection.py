"""The simulated multi-GPU projection: `serve --ray`'s layouts (replicas with each routing,
xP+yD disaggregated splits, and independent single GPUs) at several cluster-wide rates, on
`batchserve.sim.cluster.ClusterSimulator` with the roofline cost model, as one Markdown table
with the statements read off it.

    python -m benchmarks.cluster_projection --out BENCHMARKS.md   # the 8-GPU projection

This is reporting around the simulator, not part of it: the simulator stays in the package,
the layouts, tables and sentences live here with the other benchmark scripts.
"""
from __future__ import annotations

import argparse
import datetime
import sys
import time
from dataclasses import dataclass
from typing import Any, Sequence

from batchserve.bench.metrics import span_s, summarize
from batchserve.bench.workload import make_workload
from batchserve.config import EngineConfig, SchedulerConfig
from batchserve.sim.cluster import (LINK_BYTES_PER_S, LINK_LATENCY_S, ROUTINGS, STEADY_FROM, ClusterResult,
                                    ClusterSimulator, kv_bytes_per_token)
from batchserve.sim.cost import CostModel, RooflineCost
from batchserve.sim.hardware import GPUS, MODELS
from benchmarks.report_md import write_section


@dataclass(frozen=True)
class Layout:
    """One way to use the GPUs. `independent` = K > 0: K single engines, each fed its own
    workload of n / K requests at rate / K (a different seed each), their records pooled: K
    GPUs with no router at all, each taking a fixed share of the traffic."""

    label: str
    replicas: int = 1
    prefill: int = 0
    decode: int = 0
    routing: str = "rank"
    independent: int = 0


def default_layouts(gpus: int, routings: Sequence[str] = ("rank", "random")) -> list[Layout]:
    out = [Layout(f"{gpus} x 1 GPU at rate/{gpus}", independent=gpus)]
    out += [Layout(f"{gpus} replicas, {r}", replicas=gpus, routing=r) for r in routings]
    splits = [(gpus // 2, gpus - gpus // 2), (gpus // 4, gpus - gpus // 4), (gpus - gpus // 4, gpus // 4)]
    seen = set()
    for p, d in splits:
        if p >= 1 and d >= 1 and (p, d) not in seen:
            seen.add((p, d))
            out.append(Layout(f"{p}P+{d}D", prefill=p, decode=d))
    return out


def run_layout(layout: Layout, config: EngineConfig, cost: CostModel, workload: dict[str, Any], rate: float,
               slo_ms: float | None, seed: int = 0, **kw: Any) -> ClusterResult:
    if layout.independent:
        return run_independent(layout.independent, config, cost, workload, rate, slo_ms, seed)
    items = make_workload(**{**workload, "rate": rate})
    sim = ClusterSimulator(config, cost, replicas=layout.replicas, prefill=layout.prefill, decode=layout.decode,
                           routing=layout.routing, seed=seed, slo_ms=slo_ms, token_times=False, **kw)
    return sim.run(items)


def run_independent(k: int, config: EngineConfig, cost: CostModel, workload: dict[str, Any], rate: float,
                    slo_ms: float | None, seed: int = 0) -> ClusterResult:
    """K one-engine runs at rate / K, n / K requests each, summarized as one: statistically
    what random placement gives (a Poisson stream split at random is K Poisson streams)."""
    n = max(1, workload["n"] // k)
    runs = []
    for j in range(k):
        seed_j = workload.get("seed", 0) + 1000 * (j + 1)
        items = make_workload(**{**workload, "n": n, "rate": rate / k, "seed": seed_j})
        runs.append(ClusterSimulator(config, cost, replicas=1, seed=seed, slo_ms=slo_ms, token_times=False).run(items))
    records = [r for res in runs for r in res.records]
    duration = max(span_s(res.records) for res in runs)  # each run starts at its first arrival
    engines = [dict(e, key=j) for j, res in enumerate(runs) for e in res.engines]
    return ClusterResult(records, summarize(records, duration, slo_ms), engines, runs[0].handoff,
                         {"max": 0, "mean": 0.0}, sum(res.wall_s for res in runs),
                         max(res.arrival_window_s for res in runs), sum(res.sustained_tok_s for res in runs))


def row_of(layout: Layout, rate: float, res: ClusterResult) -> dict[str, Any]:
    s, lat = res.summary, res.summary["latency"]
    busy = [e["busy_arriving"] for e in res.engines]
    return {"rate": rate, "layout": layout.label, "independent": layout.independent,
            "tok_s": s["output_tokens_per_s"], "sustained_tok_s": res.sustained_tok_s,
            "goodput_rps": s["goodput_rps"], "goodput_frac": s["goodput_frac"],
            "n_ok": s["n_ok"], "n_requests": s["n_requests"],
            **{f"{m}_{q}": lat[f"{m}_ms"][q] for m in ("ttft", "tpot", "e2e") for q in ("p50", "p99")},
            "busy_min": min(busy), "busy_max": max(busy),
            "busy_prefill": _mean([e["busy_arriving"] for e in res.engines if e["role"] == "prefill"]),
            "busy_decode": _mean([e["busy_arriving"] for e in res.engines if e["role"] == "decode"]),
            "handoff_gb": res.handoff["bytes"] / 1e9, "handoff_s": res.handoff["seconds"],
            "handoff_ms": res.handoff["mean_ms"],
            "link_gbytes_s": max((e["handoff_bytes"] for e in res.engines), default=0) / 1e9
            / max(res.arrival_window_s, 1e-9),
            "imbalance_max": res.imbalance["max"], "wall_s": res.wall_s}


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _ms(x: float | None) -> str:
    return "-" if x is None else (f"{x:.1f}" if x < 100 else f"{x:.0f}")


def format_table(rows: list[dict[str, Any]]) -> str:
    out = ["| rate req/s | layout | output tok/s steady / run | within SLO | TTFT p50 / p99 ms | TPOT p50 / p99 ms "
           "| E2E p50 / p99 ms | busy % | hand-off |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["busy_prefill"] is not None:
            busy = f"P {100 * r['busy_prefill']:.0f} / D {100 * r['busy_decode']:.0f}"
        else:
            lo, hi = f"{100 * r['busy_min']:.0f}", f"{100 * r['busy_max']:.0f}"
            busy = lo if lo == hi else f"{lo}-{hi}"
        hand = f"{r['handoff_gb']:.1f} GB, {r['handoff_ms']:.2f} ms each" if r["handoff_gb"] else "-"
        out.append(f"| {r['rate']:g} | {r['layout']} | {r['sustained_tok_s']:.0f} / {r['tok_s']:.0f} | "
                   f"{100 * r['goodput_frac']:.1f}% | "
                   f"{_ms(r['ttft_p50'])} / {_ms(r['ttft_p99'])} | {_ms(r['tpot_p50'])} / {_ms(r['tpot_p99'])} | "
                   f"{_ms(r['e2e_p50'])} / {_ms(r['e2e_p99'])} | {busy} | {hand} |")
    return "\n".join(out)


def observations(rows: list[dict[str, Any]], gpus: int, slo_ms: float, link_bytes_per_s: float) -> list[str]:
    """Statements read off the rows: routing, the best layout per rate, what disaggregation
    changes against rank-routed replicas, and the hand-off traffic."""
    by = {(r["rate"], r["layout"]): r for r in rows}
    rates = sorted({r["rate"] for r in rows})
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    rank_l, rand_l = f"{gpus} replicas, rank", f"{gpus} replicas, random"
    cluster = [lay for lay in layouts if (rates[0], lay) in by and not by[rates[0], lay]["independent"]]
    disagg = [lay for lay in layouts if "P+" in lay]
    notes = []
    top = rates[-1]
    if (top, rank_l) in by and (top, rand_l) in by:
        a, b = by[top, rank_l], by[top, rand_l]
        notes.append(f"Routing: at {top:g} req/s rank gives TTFT P99 {_ms(a['ttft_p99'])} ms, TPOT P99 "
                     f"{_ms(a['tpot_p99'])} ms and E2E P99 {_ms(a['e2e_p99'])} ms against {_ms(b['ttft_p99'])} / "
                     f"{_ms(b['tpot_p99'])} / {_ms(b['e2e_p99'])} ms for random placement; the widest queue spread "
                     f"between replicas at an arrival was {a['imbalance_max']} vs {b['imbalance_max']} requests.")
    best = []
    for rate in rates:
        cands = [by[rate, lay] for lay in cluster if (rate, lay) in by]
        if cands:  # the best, and whatever is within noise of it
            top_frac = max(r["goodput_frac"] for r in cands)
            top_tok = max(r["sustained_tok_s"] for r in cands if r["goodput_frac"] >= top_frac - 0.005)
            near = [r for r in cands
                    if r["goodput_frac"] >= top_frac - 0.005 and r["sustained_tok_s"] >= 0.99 * top_tok]
            best.append(f"{rate:g} req/s: {' & '.join(r['layout'] for r in near)} "
                        f"({100 * top_frac:.1f}% within, {top_tok:.0f} tok/s)")
    if best:
        notes.append(f"Best share within the SLO (E2E <= {slo_ms:.0f} ms), then steady throughput, ties within "
                     "0.5 points and 1% listed together — " + "; ".join(best) + ".")
    for lay in disagg:
        wins = [rate for rate in rates if (rate, lay) in by and (rate, rank_l) in by
                and by[rate, lay]["tpot_p99"] is not None and by[rate, rank_l]["tpot_p99"] is not None
                and by[rate, lay]["tpot_p99"] < by[rate, rank_l]["tpot_p99"]]
        if not wins:
            notes.append(f"{lay}: TPOT P99 is never below the rank-routed replicas' at the rates tried.")
            continue
        d, b = by[wins[-1], lay], by[wins[-1], rank_l]
        notes.append(f"{lay}: lower TPOT P99 than rank-routed replicas at {', '.join(f'{r:g}' for r in wins)} req/s "
                     f"(at {wins[-1]:g}: {_ms(d['tpot_p99'])} vs {_ms(b['tpot_p99'])} ms), with TTFT P99 "
                     f"{_ms(d['ttft_p99'])} vs {_ms(b['ttft_p99'])} ms and steady throughput "
                     f"{d['sustained_tok_s']:.0f} vs "
                     f"{b['sustained_tok_s']:.0f} tok/s.")
    hand = [r for r in rows if r["handoff_gb"]]
    if hand:
        per_req = max(r["handoff_gb"] * 1e9 / r["n_requests"] for r in hand)
        link = max(r["link_gbytes_s"] for r in hand)
        notes.append(f"Hand-off: {per_req / 1e6:.0f} MB of K/V per request on average, "
                     f"{max(r['handoff_ms'] for r in hand):.2f} ms each; the busiest prefill worker's link "
                     f"carried {link:.1f} GB/s on average while requests arrived, "
                     f"{100 * link * 1e9 / link_bytes_per_s:.0f}% of its {link_bytes_per_s / 1e9:g} GB/s.")
    return notes


def project(config: EngineConfig, cost: CostModel, workload: dict[str, Any], rates: Sequence[float],
            layouts: Sequence[Layout], slo_ms: float, seed: int = 0, seconds: float = 10.0, log: Any = None,
            **kw: Any) -> list[dict[str, Any]]:
    """Every layout at every rate. With workload["n"] 0, each point gets rate x seconds requests."""
    rows = []
    for rate in rates:
        wl = {**workload, "n": workload["n"] or max(1, round(rate * seconds))}
        for lay in layouts:
            res = run_layout(lay, config, cost, wl, rate, slo_ms, seed, **kw)
            rows.append(row_of(lay, rate, res))
            if log is not None:
                print(f"  {rate:g} req/s  {lay.label:<24} {res.wall_s:5.1f} s", file=log, flush=True)
    return rows


def report(a: argparse.Namespace, argv: Sequence[str] | None, config: EngineConfig, cost: RooflineCost,
           rates: list[float], rows: list[dict[str, Any]], table: str) -> str:
    """The markdown section: command, date, assumptions, table, observations."""
    sc = config.scheduler
    cmd = " ".join(["python -m benchmarks.cluster_projection", *(argv if argv is not None else sys.argv[1:])])
    kv = kv_bytes_per_token(cost)
    link = a.link_gbps * 1e9 / 8
    lines = [
        f"## Ray: simulated projection on {a.gpus} GPUs", "",
        f"`{cmd}` ({datetime.date.today().isoformat()}; the real engine and scheduler on a virtual clock, "
        "`batchserve/sim/cluster.py`)", "",
        f"- GPU and model: {cost.name}. Step times come from the roofline model in `sim/cost.py`; its efficiency "
        "factors and 2 ms per-step overhead are assumptions (`sim/hardware.py`), not measurements. "
        f"{cost.num_blocks(config.cache.block_size)} KV blocks of {config.cache.block_size} tokens per GPU.",
        f"- Engine: policy `{sc.policy}`, max_num_seqs {sc.max_num_seqs}, max_num_batched_tokens "
        f"{sc.max_num_batched_tokens}; prefill workers hold at most {min(sc.max_num_seqs, sc.prefill_max_batch)} "
        "requests, as `serve --ray` configures them.",
        f"- Hand-off (xP+yD rows): prompt tokens x {kv} B ({kv // 1024} KiB: fp16 K and V, all layers) over "
        f"a {a.link_gbps:g} Gb/s ({link / 1e9:g} GB/s) link, plus {a.link_latency_us:g} µs per request; it "
        "adds to the gap between the first and second token. TTFT is the prefill worker's first token.",
        f"- Workload: `{a.workload}`{'' if a.scale is None else f' at scale {a.scale:g}'}, Poisson arrivals, "
        f"seed {a.seed}, "
        + (f"{a.requests} requests per point. " if a.requests else
           f"rate x {a.seconds:g} s of arrivals per point ({', '.join(str(round(r * a.seconds)) for r in rates)} "
           "requests). ")
        + f"The `{a.gpus} x 1 GPU` row is {a.gpus} separate single-engine runs, each with 1/{a.gpus} of the "
        f"requests at rate/{a.gpus}, pooled: no router, each GPU a fixed share of the traffic (statistically the "
        "same as random placement).",
        f"- Output tok/s: *steady* counts tokens delivered from {STEADY_FROM:.0%} into the arrivals to the last "
        "arrival (no warm-up, no drain); *run* is bench's figure, first arrival to last token. *Within SLO*: "
        f"share of requests that completed with E2E <= {a.slo_ms:.0f} ms (bench's goodput). Busy %: each "
        "engine's share of time in steps while requests arrive (min-max over replicas; P / D: mean over "
        "prefill / decode workers); an engine with any running request is always stepping, so for whole "
        "engines and decode workers this reads near 100% long before they saturate.",
        "- Routing: `distributed.routing.rank` on each engine's exact queue at the arrival instant (the live "
        "router's stats are up to 0.5 s old); disaggregated layouts route both stages with it.",
        "", table, "", "Read off the table:", "",
        *[f"- {n}" for n in observations(rows, a.gpus, a.slo_ms, link)], ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.cluster_projection",
                                 description="Simulated multi-GPU projection: replicas vs disaggregated "
                                             "prefill/decode.")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--hardware", default="h100" if "h100" in GPUS else "a100-80gb")
    ap.add_argument("--model", default="llama-3-8b" if "llama-3-8b" in MODELS else "llama-2-7b")
    ap.add_argument("--workload", default="chat")
    ap.add_argument("--scale", type=float, default=None, help="multiply every length (default: the mix's own)")
    ap.add_argument("--seconds", type=float, default=10.0, help="arrivals per point: rate x this many seconds")
    ap.add_argument("--requests", type=int, default=0, help="a fixed request count per point instead")
    ap.add_argument("--rates", default="200,400,550,700", help="cluster-wide request rates (req/s)")
    ap.add_argument("--routings", default="rank,random", help=f"replica routings to compare, of {ROUTINGS}")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--prefill-max-batch", type=int, default=SchedulerConfig.prefill_max_batch)
    ap.add_argument("--link-gbps", type=float, default=8 * LINK_BYTES_PER_S / 1e9, help="hand-off link, Gbit/s")
    ap.add_argument("--link-latency-us", type=float, default=LINK_LATENCY_S * 1e6)
    ap.add_argument("--slo-ms", type=float, default=6000.0, help="end-to-end target for goodput")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="markdown file whose section this run replaces (or appends), e.g. BENCHMARKS.md")
    a = ap.parse_args(argv)

    cost = RooflineCost(a.hardware, a.model)
    config = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=a.max_num_seqs, prefill_max_batch=a.prefill_max_batch))
    rates = [float(x) for x in a.rates.split(",") if x.strip()]
    layouts = default_layouts(a.gpus, [r.strip() for r in a.routings.split(",") if r.strip()])
    workload = {"name_or_file": a.workload, "n": a.requests, "seed": a.seed, "scale": a.scale}
    link = {"link_bytes_per_s": a.link_gbps * 1e9 / 8, "link_latency_s": a.link_latency_us * 1e-6}
    t0 = time.perf_counter()
    rows = project(config, cost, workload, rates, layouts, a.slo_ms, a.seed, a.seconds, log=sys.stderr, **link)
    table = format_table(rows)
    print(table)
    print(f"[simulated in {time.perf_counter() - t0:.0f} s]", file=sys.stderr)
    if a.out:
        text = report(a, argv, config, cost, rates, rows, table)
        write_section(a.out, text.split("\n", 1)[0], text.rstrip() + "\n\n")  # replaces its section
        print(f"wrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
