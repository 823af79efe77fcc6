"""`batchserve simulate`: build the cost model and engine config, run, sweep, write results.

Outputs (with `--out DIR`) are the files `bench` writes, through bench's report module:
`records_rR.jsonl` (one RequestRecord per request, virtual times), `timeline_rR.json` (queue
depth, running batch, KV usage, window and cap, named as the server's gauges), `summary.json`,
`table.md` and the PNG plots; a sweep over a scheduler field writes one such directory per
value plus `sweep.json`.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Sequence

from batchserve.bench.metrics import SLO, parse_slo_args, unmatched_classes
from batchserve.bench.search import RateSearch, find_max_rate, one_burst, search_line
from batchserve.bench.workload import (MIXES, WorkItem, class_slos, make_workload, mix_classes, offered_rate,
                                       parse_arrival_args)
from batchserve.config import CacheConfig, ConfigError, EngineConfig, SchedulerConfig
from batchserve.sim.cost import CostModel, make_cost_model
from batchserve.sim.simulator import SimResult, Simulator

SWEEP_ALIASES = {"window": "window_ms", "max-batch": "max_batch", "batch": "max_batch",
                 "chunk": "chunk_size", "chunk-size": "chunk_size", "max-num-seqs": "max_num_seqs"}
DEFAULT_REQUESTS = 1000
DEFAULT_RATE = 10.0  # req/s of a mix, or of a trace given another arrival process
TOKEN_TIMES_LIMIT = 20_000  # above this many requests per-token times are not kept (memory)


def simulate(config: EngineConfig, cost: CostModel, items: Sequence[WorkItem], slo_ms: float | None = None,
             token_times: bool | None = None, **kw: Any) -> SimResult:
    """One run on a fresh engine. Per-token times are kept for small runs only."""
    keep = len(items) <= TOKEN_TIMES_LIMIT if token_times is None else token_times
    return Simulator(config, cost, slo_ms=slo_ms, token_times=keep, **kw).run(items)


@dataclass(frozen=True)
class SweepSpec:
    field: str  # "rate" or a SchedulerConfig field
    values: tuple[float, ...]

    @staticmethod
    def parse(text: str) -> "SweepSpec":
        """`rate=1,2,4`, `window_ms=10,50,100`, `max_batch=8,16,32`, `chunk_size=256,512`."""
        name, sep, vals = text.partition("=")
        name = SWEEP_ALIASES.get(name.strip(), name.strip().replace("-", "_"))
        fields = {f.name: f for f in dataclasses.fields(SchedulerConfig)}
        if not sep or (name != "rate" and (name not in fields or fields[name].type not in ("int", "float"))):
            raise ConfigError(f"--sweep: expected rate=... or a numeric scheduler field=..., got {text!r}")
        try:
            values = tuple(float(v) for v in vals.split(",") if v.strip())
        except ValueError:
            raise ConfigError(f"--sweep {text!r}: values must be numbers") from None
        if not values:
            raise ConfigError(f"--sweep {text!r}: no values")
        if name != "rate" and fields[name].type == "int":
            values = tuple(int(v) for v in values)
        return SweepSpec(name, values)


def sweep(spec: SweepSpec, config: EngineConfig, cost: CostModel, workload: dict[str, Any], slo_ms: float | None,
          slo: SLO | None = None, class_slo: dict[str, SLO] | None = None, target: float = 0.99
          ) -> tuple[list[dict[str, Any]], dict[str, Any] | None, list[SimResult]]:
    """Run every value; the best is, among runs that meet the SLO (`criterion`: completed >=
    99% of their requests, P99 end to end within `slo_ms` when set, attainment >= `target`
    when `slo` or `class_slo` sets targets), the one with the most goodput (a rate sweep:
    the highest rate that still meets it)."""
    judged = slo is not None or bool(class_slo)
    rows, results = [], []
    for v in spec.values:
        wl = dict(workload)
        cfg = config
        if spec.field == "rate":
            wl["rate"] = v
        else:
            cfg = dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, **{spec.field: v}))
        res = simulate(cfg, cost, make_workload(**wl), slo_ms=slo_ms, slo=slo, class_slo=class_slo)
        results.append(res)
        s = res.summary
        p99 = s["latency"]["e2e_ms"]["p99"]
        done = s["n_ok"] / max(1, s["n_requests"])
        rows.append({spec.field: v, "rate": wl["rate"], "throughput_rps": s["throughput_rps"],
                     "goodput_rps": s["goodput_rps"], "attainment": s["goodput_frac"],
                     "output_tokens_per_s": s["output_tokens_per_s"],
                     "e2e_p50_ms": s["latency"]["e2e_ms"]["p50"], "e2e_p99_ms": p99,
                     "ttft_p99_ms": s["latency"]["ttft_ms"]["p99"], "completed": done,
                     "meets_slo": done >= 0.99 and (slo_ms is None or (p99 is not None and p99 <= slo_ms))
                     and (not judged or (s["goodput_frac"] or 0.0) >= target)})
    ok = [r for r in rows if r["meets_slo"]]
    key = (lambda r: r["rate"]) if spec.field == "rate" else (lambda r: (r["goodput_rps"], -r["e2e_p99_ms"]))
    return rows, (max(ok, key=key) if ok else None), results


def find_max_goodput(config: EngineConfig, cost: CostModel, workload: dict[str, Any], target: float,
                     slo_ms: float | None = None, slo: SLO | None = None, class_slo: dict[str, SLO] | None = None,
                     **search_kw: Any) -> tuple[RateSearch, dict[float, SimResult]]:
    """`bench.search.find_max_rate` over simulated runs of `workload` (make_workload's
    arguments; its "rate" is where the search starts), judged by the SLOs given: the same
    search and the same attainment `bench --find-max-goodput` uses. Returns the search and
    every run by rate."""
    runs: dict[float, SimResult] = {}

    def attainment_at(rate: float) -> float:
        res = simulate(config, cost, make_workload(**{**workload, "rate": rate}), slo_ms=slo_ms, slo=slo,
                       class_slo=class_slo)
        runs[rate] = res
        return res.summary.get("goodput_frac") or 0.0

    return find_max_rate(attainment_at, target, workload["rate"], **search_kw), runs


def format_summary(s: dict[str, Any], title: str = "") -> str:
    """The headline numbers of a summary as a few text lines."""
    lat = s["latency"]

    def d(name: str) -> str:
        x = lat[name]
        return "-" if x["p50"] is None else f"{x['p50']:.0f} / {x['p90']:.0f} / {x['p99']:.0f}"

    lines = [title] if title else []
    lines += [f"requests {s['n_requests']}  ok {s['n_ok']}  rejected {s['n_rejected']}  timeout {s['n_timeout']}"
              f"  errors {s['n_errors']}   span {s['duration_s']:.1f} s (virtual)",
              f"throughput {s['throughput_rps']:.2f} req/s  {s['output_tokens_per_s']:.0f} tok/s  "
              f"goodput {s['goodput_rps']:.2f} req/s  attainment {100 * (s['goodput_frac'] or 0):.1f}%",
              f"TTFT ms p50/p90/p99 {d('ttft_ms')}   TPOT {d('tpot_ms')}   E2E {d('e2e_ms')}"]
    for cls, c in s["per_class"].items():
        if len(s["per_class"]) > 1:
            e = c["latency"]["e2e_ms"]
            p = "-" if e["p50"] is None else f"{e['p50']:.0f} / {e['p99']:.0f}"
            lines.append(f"  {cls:<10} n={c['n_requests']:<6} ok={c['n_ok']:<6} E2E p50/p99 {p} ms  "
                         f"timeouts {c['n_timeout']} rejected {c['n_rejected']}  goodput {c['goodput_rps']:.2f}"
                         f" req/s ({100 * (c['goodput_frac'] or 0):.1f}%)")
    return "\n".join(lines)


def padding_note(stats: dict[str, Any], paid: bool = False) -> str:
    """What a request-level policy's padding figure is: counted only, or (`pay_padding`) also costed."""
    share = f"padding: {100 * stats['padding_fraction']:.0f}% of a padded batch's tokens"
    if paid:
        return (f"{share} were padding; paid: every step was costed with the padding rows a padded engine "
                "would compute (pay_padding)")
    return (f"{share} would be padding; accounted only: the steps were simulated (and costed) unpadded, so the "
            "numbers above are better than a padded implementation's (--pay-padding costs them)")


def criterion(slo_ms: float | None, judged: bool, target: float) -> str:
    """What `sweep` asks of a run to meet the SLO, in words."""
    parts = ["99% completed"] + ([f"E2E P99 <= {slo_ms:.0f} ms"] if slo_ms is not None else []) + \
        ([f"attainment >= {100 * target:g}%"] if judged else [])
    return ", ".join(parts)


def format_sweep(spec: SweepSpec, rows: list[dict[str, Any]], best: dict[str, Any] | None, meets: str) -> str:
    """The sweep as a table; `meets`: `criterion`'s words."""
    out = [f"| {spec.field} | req/s | goodput | tok/s | E2E p50 ms | E2E p99 ms | meets SLO ({meets}) |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        p50 = "-" if r["e2e_p50_ms"] is None else f"{r['e2e_p50_ms']:.0f}"
        p99 = "-" if r["e2e_p99_ms"] is None else f"{r['e2e_p99_ms']:.0f}"
        mark = " **best**" if r is best else ""
        out.append(f"| {r[spec.field]:g} | {r['throughput_rps']:.2f} | {r['goodput_rps']:.2f} | "
                   f"{r['output_tokens_per_s']:.0f} | {p50} | {p99} | {'yes' if r['meets_slo'] else 'no'}{mark} |")
    out.append(f"best {spec.field}: {best[spec.field]:g}" if best else f"no setting meets the SLO ({meets})")
    return "\n".join(out)


def write_outputs(out_dir: str, runs: list[tuple[float, SimResult]], meta: dict[str, Any],
                  plot: bool = True) -> str:
    """bench's report files for simulated runs (one per rate): records_rR.jsonl,
    timeline_rR.json, summary.json, table.md and the PNGs. Returns summary.json's path."""
    from batchserve.bench.report import RateRun, write_report

    return write_report(out_dir, meta, [RateRun(rate, r.records, {**r.summary, "engine": r.engine_stats},
                                                r.timeline) for rate, r in runs], plot=plot)


def run_cli(a: Any, config: EngineConfig) -> int:
    """The body of `batchserve simulate` (argparse namespace from cli.py)."""
    if a.scenario:
        from batchserve.scenarios import run_scenario

        print(run_scenario(a.scenario, requests=a.requests, seed=a.seed, out_dir=a.out))
        return 0
    if a.profile and a.hardware:
        raise ConfigError("--hardware and --profile: give one or the other")
    kv_gb = a.kv_cache_gb if a.kv_cache_gb != CacheConfig.kv_cache_gb else None  # only when asked for
    cost = make_cost_model(a.hardware, a.profile, a.model, 4 if a.dtype == "float32" else 2, a.max_model_len,
                           **({"kv_cache_gb": kv_gb} if a.profile else {}))
    slo = a.slo_ms if a.slo_ms is not None else config.scheduler.slo_p99_ms
    glob, given = parse_slo_args(a.slo or [])
    per = {**class_slos(mix_classes(a.trace or a.workload)), **given}
    # an explicit --slo replaces the engine's P99 target as goodput's E2E limit (--sweep still ranks by it)
    limit = None if a.slo and a.slo_ms is None else slo
    if not 0 < a.target_attainment <= 100:
        raise ConfigError(f"--target-attainment is a percentage in (0, 100], got {a.target_attainment:g}")
    for flag, v in (("--rate", a.rate), ("--scale", a.scale), ("--time-scale", a.time_scale)):
        if v is not None and not (v > 0 and math.isfinite(v)):
            raise ConfigError(f"{flag} must be a finite number > 0, got {v:g}")
    if a.max_tokens is not None and a.max_tokens < 1:
        raise ConfigError(f"--max-tokens must be >= 1, got {a.max_tokens}")
    if a.requests is not None and a.requests < 0:
        raise ConfigError(f"--requests must be >= 0 (0: the whole trace), got {a.requests}")
    if a.time_scale is not None and (a.rate is not None or a.find_max_goodput):
        raise ConfigError("--time-scale replays a trace's own timing scaled: not with --rate or --find-max-goodput")
    arrival_kw: dict[str, Any] = parse_arrival_args(a.arrival_args)
    if a.burstiness is not None:
        arrival_kw["burstiness"] = a.burstiness
    name = a.trace or a.workload
    # a trace replays its own timing unless a rate is asked for (or searched from)
    own_timing = a.time_scale is not None or (a.rate is None and name not in MIXES and a.arrival in (None, "replay")
                                              and not a.find_max_goodput)
    rate = 0.0 if own_timing else a.rate if a.rate is not None else DEFAULT_RATE
    workload = {"name_or_file": name, "n": a.requests or DEFAULT_REQUESTS, "rate": rate, "seed": a.seed,
                "arrival": a.arrival, "scale": a.scale, "trace_format": a.trace_format, "time_scale": a.time_scale,
                "max_tokens": a.max_tokens, **arrival_kw}
    meta = {"label": f"sim {config.scheduler.policy}", "cost": cost.describe(), "workload": workload["name_or_file"],
            "requests": workload["n"], "seed": a.seed, "arrival": a.arrival, "arrival_args": arrival_kw,
            "scale": a.scale, "max_tokens": a.max_tokens, "slo_ms": limit, "slo": glob.targets() if glob else {},
            "class_slo": {k: v.targets() for k, v in per.items()}, "policy": config.scheduler.policy,
            "scheduler": dataclasses.asdict(config.scheduler), "block_size": config.cache.block_size}
    print(f"{cost.name}: {cost.num_blocks(config.cache.block_size)} KV blocks of {config.cache.block_size} "
          f"tokens; policy {config.scheduler.policy}", file=sys.stderr)
    if a.find_max_goodput:
        found, runs = find_max_goodput(config, cost, workload, a.target_attainment / 100.0, limit, glob, per)
        best = runs.get(found.best) if found.best is not None else None
        meta["search"] = {"target_attainment": found.target, "best_rate": found.best, "bracketed": found.bracketed,
                          "goodput_rps": best.summary["goodput_rps"] if best else None,
                          "best_was_burst": best is not None and one_burst(best.records),
                          "probes": [{"rate": r, "attainment": x} for r, x in found.probes]}
        print(search_line(meta["search"]))
        if best is not None:
            print(format_summary(best.summary, f"at {found.best:.3g} req/s"))
        if a.out:
            print(f"wrote {write_outputs(a.out, sorted(runs.items()), meta)}", file=sys.stderr)
        return 0
    if a.sweep:
        spec = SweepSpec.parse(a.sweep)
        target = a.target_attainment / 100.0
        rows, best, results = sweep(spec, config, cost, workload, slo, glob, per, target)
        print(format_sweep(spec, rows, best, criterion(slo, glob is not None or bool(per), target)))
        if a.out:
            if spec.field == "rate":
                write_outputs(a.out, list(zip(spec.values, results)), meta)
            else:
                for v, res in zip(spec.values, results):
                    offered = offered_rate([r.send_time for r in res.records])
                    write_outputs(os.path.join(a.out, f"{spec.field}_{v:g}"), [(offered, res)],
                                  {**meta, "label": f"{meta['label']} {spec.field}={v:g}"})
            os.makedirs(a.out, exist_ok=True)
            with open(os.path.join(a.out, "sweep.json"), "w") as f:
                json.dump({"field": spec.field, "slo_ms": slo, "rows": rows, "best": best, "meta": meta},
                          f, indent=1, sort_keys=True)
            print(f"wrote {a.out}/", file=sys.stderr)
        return 0
    items = make_workload(**workload)
    if (warn := unmatched_classes(given, (w.cls for w in items))) is not None:
        print(f"warning: {warn}", file=sys.stderr)
    res = simulate(config, cost, items, slo_ms=limit, token_times=a.token_times, slo=glob, class_slo=per)
    offered = float(f"{offered_rate([w.arrival for w in items]):.3g}")
    at = (f"time scale {a.time_scale:g}" if a.time_scale is not None else "its own timing" if own_timing
          else f"{rate:g} req/s") + (f" ({offered:.3g} req/s offered)" if own_timing else "")
    print(format_summary(res.summary, f"{workload['name_or_file']} x {len(items)} at {at}, "
                                      f"policy {config.scheduler.policy}, {cost.name}"))
    busy = res.busy_s / max(res.summary["duration_s"], 1e-9)
    print(f"[{res.num_steps} steps, GPU busy {100 * busy:.0f}%, simulated in {res.wall_s:.2f} s]", file=sys.stderr)
    if res.engine_stats.get("padding_tokens"):
        print(padding_note(res.engine_stats, config.scheduler.pay_padding))
    if a.out:
        print(f"wrote {write_outputs(a.out, [(offered if own_timing else rate, res)], meta)} and the records, "
              "table and plots",
              file=sys.stderr)
    return 0
