"""Result files, tables and plots for `bench` (and `simulate`, which writes the same).

A report directory holds, per offered rate R: `records_rR.jsonl` (one RequestRecord a line),
`timeline_rR.json` (polled /metrics), `latency_cdf_rR.png`, `timeline_rR.png`; and once:
`summary.json` (meta + per-rate summaries, pointing at those files), `sweep.png` and
`table.md`. `compare_reports` overlays several summary.json files in one table and plot set.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from batchserve.bench import plots
from batchserve.bench.metrics import RequestRecord
from batchserve.bench.search import search_line


@dataclass
class RateRun:
    """One load level's results."""

    rate: float
    records: list[RequestRecord]
    summary: dict[str, Any]
    timeline: list[dict[str, Any]] = field(default_factory=list)


def _tag(rate: float) -> str:
    return f"r{rate:g}"


def save_records(records: list[RequestRecord], path: str) -> None:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r.to_dict()) + "\n")


def load_records(path: str) -> list[RequestRecord]:
    with open(path) as f:
        return [RequestRecord.from_dict(json.loads(line)) for line in f if line.strip()]


def write_report(out_dir: str, meta: dict[str, Any], runs: list[RateRun], plot: bool = True) -> str:
    """Write records, timelines, summary.json, table.md and (if `plot`) the PNGs; return
    the summary.json path. `meta` should carry a `label` (used in comparisons)."""
    os.makedirs(out_dir, exist_ok=True)
    entries = []
    label = str(meta.get("label", "run"))
    for run in sorted(runs, key=lambda r: r.rate):
        tag = _tag(run.rate)
        save_records(run.records, os.path.join(out_dir, f"records_{tag}.jsonl"))
        with open(os.path.join(out_dir, f"timeline_{tag}.json"), "w") as f:
            json.dump(run.timeline, f)
        entries.append({"rate": run.rate, "records": f"records_{tag}.jsonl", "timeline": f"timeline_{tag}.json",
                        "summary": run.summary})
        if plot:
            by_cls: dict[str, list[RequestRecord]] = {}
            for r in run.records:
                by_cls.setdefault(r.cls, []).append(r)
            groups = {"all": run.records, **by_cls} if len(by_cls) > 1 else by_cls
            plots.plot_cdfs(groups, os.path.join(out_dir, f"latency_cdf_{tag}.png"),
                            f"{label}: latency CDFs at {run.rate:g} req/s")
            plots.plot_timeline(run.timeline, os.path.join(out_dir, f"timeline_{tag}.png"),
                                f"{label}: server state at {run.rate:g} req/s")
    path = os.path.join(out_dir, "summary.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, "runs": entries}, f, indent=1)
    slo = meta.get("slo_ms")
    if plot:
        plots.plot_sweep({label: [(e["rate"], e["summary"]) for e in entries]}, os.path.join(out_dir, "sweep.png"),
                         f"{label}: latency and throughput vs load", slo, per_class=True)
    rows = [(label, e["rate"], e["summary"]) for e in entries]
    with open(os.path.join(out_dir, "table.md"), "w") as f:
        f.write(markdown_table(rows) + "\n\n" + class_table(rows) + "\n\n" + slo_text(meta) + "\n")
    return path


def _targets(t: dict[str, float]) -> str:
    return ", ".join(f"{k} <= {v:g}" for k, v in t.items()) or "none"


def slo_text(meta: dict[str, Any]) -> str:
    """The SLO the goodput columns were judged by, and a rate search's answer if there was one."""
    lines = [f"Goodput: requests/s that completed and met every target of their SLO and their deadline "
             f"(or --slo-ms {_f(meta.get('slo_ms'), 0)} without one); attainment = good / all requests, "
             f"failures included. Global SLO: {_targets(meta.get('slo') or {})}."]
    lines += [f"Class {c} SLO: {_targets(t)}." for c, t in (meta.get("class_slo") or {}).items()]
    if meta.get("search"):
        sr = meta["search"]
        lines.append(search_line(sr) + " (" + ", ".join(f"{p['rate']:.3g}: {100 * p['attainment']:.1f}%"
                                                       for p in sr["probes"]) + ").")
    return "\n".join(lines)


def load_report(path: str) -> tuple[dict[str, Any], list[RateRun]]:
    """Read a summary.json written by write_report, with its records and timelines."""
    with open(path) as f:
        doc = json.load(f)
    base = os.path.dirname(os.path.abspath(path))
    runs = []
    for e in doc["runs"]:
        recs = load_records(os.path.join(base, e["records"])) if e.get("records") else []
        tl_path = os.path.join(base, e.get("timeline") or "")
        timeline = json.load(open(tl_path)) if e.get("timeline") and os.path.exists(tl_path) else []
        runs.append(RateRun(float(e["rate"]), recs, e["summary"], timeline))
    return doc["meta"], runs


def _f(v: Any, nd: int = 1) -> str:
    return "-" if v is None else f"{v:.{nd}f}" if isinstance(v, float) else str(v)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def markdown_table(rows: list[tuple[str, float, dict[str, Any]]]) -> str:
    """One line per (label, rate, summary): throughput, goodput, latency percentiles, failures."""
    head = ("| run | rate | req/s | tok/s | goodput/s | attain | TTFT P50 | TTFT P99 | TPOT P50 | TPOT P99 | "
            "E2E P50 | E2E P90 | E2E P99 | ok | rejected | timeout | disconn | errors |")
    lines = [head, "|" + "|".join("---" for _ in range(18)) + "|"]
    for label, rate, s in rows:
        lat = s["latency"]
        lines.append("| " + " | ".join([
            label, f"{rate:g}", _f(s["throughput_rps"], 2), _f(s["output_tokens_per_s"]), _f(s["goodput_rps"], 2),
            _pct(s.get("goodput_frac")), _f(lat["ttft_ms"]["p50"], 0), _f(lat["ttft_ms"]["p99"], 0),
            _f(lat["tpot_ms"]["p50"], 0),
            _f(lat["tpot_ms"]["p99"], 0), _f(lat["e2e_ms"]["p50"], 0), _f(lat["e2e_ms"]["p90"], 0),
            _f(lat["e2e_ms"]["p99"], 0), f"{s['n_ok']}/{s['n_requests']}", str(s["n_rejected"]),
            str(s["n_timeout"]), str(s["n_disconnects"]), str(s["n_errors"])]) + " |")
    return "\n".join(lines) + "\n\nLatencies in ms, over completed requests; P = linear-interpolated percentile."


def class_table(rows: list[tuple[str, float, dict[str, Any]]]) -> str:
    """Per class (priority level): completed, goodput, attainment and the SLO it is against,
    TTFT / E2E P99, deadline misses."""
    lines = ["| run | rate | class | priority | ok | goodput/s | attain | SLO | TTFT P99 | E2E P50 | E2E P99 "
             "| deadline missed |", "|" + "|".join("---" for _ in range(12)) + "|"]
    for label, rate, s in rows:
        gp = s.get("goodput", {}).get("per_class", {})
        for cls, c in s.get("per_class", {}).items():
            lat = c["latency"]
            miss = c.get("deadline_miss_rate")
            slo = ", ".join(f"{k.removesuffix('_ms')} {v:g}" for k, v in gp.get(cls, {}).get("slo", {}).items())
            lines.append("| " + " | ".join([
                label, f"{rate:g}", cls, ",".join(map(str, c.get("priority", []))), f"{c['n_ok']}/{c['n_requests']}",
                _f(c["goodput_rps"], 2), _pct(c.get("goodput_frac")), slo or "-", _f(lat["ttft_ms"]["p99"], 0),
                _f(lat["e2e_ms"]["p50"], 0),
                _f(lat["e2e_ms"]["p99"], 0), "-" if miss is None else f"{100 * miss:.1f}%"]) + " |")
    return "\n".join(lines)


def compare_reports(paths: list[str], out_dir: str, labels: list[str] | None = None) -> str:
    """Overlay several runs: `compare.md` (the table) and `compare_sweep.png` /
    `compare_cdf.png` in out_dir. Returns the markdown. Labels default to each run's
    meta label, made unique with its directory name."""
    os.makedirs(out_dir, exist_ok=True)
    loaded = [load_report(p) for p in paths]
    names = labels or [str(m.get("label") or os.path.basename(os.path.dirname(os.path.abspath(p))))
                       for p, (m, _) in zip(paths, loaded)]
    dup = {n for n in names if names.count(n) > 1}
    names = [f"{n} ({os.path.basename(os.path.dirname(os.path.abspath(p)))})" if n in dup else n
             for n, p in zip(names, paths)]  # two runs with one label: keep both, distinguishably
    rows = [(n, r.rate, r.summary) for n, (_, runs) in zip(names, loaded) for r in runs]
    slo = next((m.get("slo_ms") for m, _ in loaded if m.get("slo_ms") is not None), None)
    plots.plot_sweep({n: [(r.rate, r.summary) for r in runs] for n, (_, runs) in zip(names, loaded)},
                     os.path.join(out_dir, "compare_sweep.png"), "comparison: latency and throughput vs load", slo)
    top = {f"{n} @ {max(runs, key=lambda r: r.rate).rate:g}/s": max(runs, key=lambda r: r.rate).records
           for n, (_, runs) in zip(names, loaded) if runs}
    plots.plot_cdfs(top, os.path.join(out_dir, "compare_cdf.png"), "comparison: latency CDFs at each run's top rate")
    md = markdown_table(rows) + "\n\n" + class_table(rows) + "\n"
    with open(os.path.join(out_dir, "compare.md"), "w") as f:
        f.write(md)
    return md
