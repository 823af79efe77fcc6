"""PNG plots of bench / simulate results (matplotlib, no display needed).

Figures are built with `matplotlib.figure.Figure` and saved through its Agg canvas, so no
pyplot global state and no GUI backend are involved.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from batchserve.bench.metrics import RequestRecord

# Timeline panels: a sample joins a panel when its name contains one of the keys.
TIMELINE_PANELS: dict[str, tuple[str, ...]] = {
    "queue depth": ("queue_depth", "queue_len", "num_requests_waiting", "waiting"),
    "batch size": ("batch_size", "max_batch", "num_requests_running", "running"),
    "window (s)": ("window",),
    "KV usage": ("kv_cache_usage", "kv_usage", "cache_usage", "kv_util"),
}


def _cdf(ax: Any, values_ms: Sequence[float], label: str, style: str = "-") -> None:
    if not values_ms:
        return
    xs = np.sort(np.asarray(values_ms))
    ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), style, label=f"{label} (n={len(xs)})", drawstyle="steps-post")


def plot_cdfs(groups: Mapping[str, Sequence[RequestRecord]], path: str, title: str) -> None:
    """TTFT, TPOT and E2E CDFs of completed requests, one line per group (class or run)."""
    fig = Figure(figsize=(15, 4.2))
    axes = fig.subplots(1, 3)
    metrics = [("TTFT", lambda r: r.ttft), ("TPOT", lambda r: r.tpot), ("E2E", lambda r: r.e2e)]
    for ax, (name, get) in zip(axes, metrics):
        for label, recs in groups.items():
            vals = [get(r) * 1000 for r in recs if r.ok and get(r) is not None]
            _cdf(ax, vals, label)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=8, loc="lower right")
        else:
            ax.text(0.5, 0.5, "no completed requests", ha="center", transform=ax.transAxes)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def _lat(summary: dict[str, Any], metric: str, q: str, cls: str | None = None) -> float:
    part = summary if cls is None else summary["per_class"].get(cls, {})
    v = part.get("latency", {}).get(metric, {}).get(q)
    return math.nan if v is None else v


def plot_sweep(series: Mapping[str, Sequence[tuple[float, dict[str, Any]]]], path: str, title: str,
               slo_ms: float | None = None, per_class: bool = False) -> None:
    """P99 latency and throughput vs offered request rate; one line per series (run label),
    plus one per class when `per_class`. `series`: label -> [(rate, summary), ...]."""
    fig = Figure(figsize=(15, 4.2))
    ax_lat, ax_tput, ax_tok = fig.subplots(1, 3)
    colors = iter(["C0", "C1", "C2", "C3", "C4", "C5", "C6", "C7", "C8", "C9"] * 4)
    max_rate = 0.0
    for label, pts in series.items():
        pts = sorted(pts, key=lambda p: p[0])
        rates = [r for r, _ in pts]
        max_rate = max(max_rate, *rates) if rates else max_rate
        c = next(colors)
        ax_lat.plot(rates, [_lat(s, "e2e_ms", "p99") for _, s in pts], "o-", color=c, label=f"{label} E2E P99")
        ax_lat.plot(rates, [_lat(s, "ttft_ms", "p99") for _, s in pts], "s--", color=c, label=f"{label} TTFT P99")
        if per_class:
            classes = sorted({k for _, s in pts for k in s.get("per_class", {})})
            for k, cls in enumerate(classes if len(classes) > 1 else []):
                ax_lat.plot(rates, [_lat(s, "e2e_ms", "p99", cls) for _, s in pts], ":", marker=".",
                            color=f"C{(k + 3) % 10}", label=f"{cls} E2E P99")
        ax_tput.plot(rates, [s["throughput_rps"] for _, s in pts], "o-", color=c, label=f"{label} throughput")
        ax_tput.plot(rates, [s["goodput_rps"] for _, s in pts], "^--", color=c, label=f"{label} goodput")
        ax_tok.plot(rates, [s["output_tokens_per_s"] for _, s in pts], "o-", color=c, label=label)
    if slo_ms is not None:
        ax_lat.axhline(slo_ms, color="red", linestyle="-.", label=f"SLO {slo_ms:g} ms")
    if max_rate > 0:
        ax_tput.plot([0, max_rate], [0, max_rate], color="gray", linewidth=0.8, label="offered")
    for ax, ylabel in ((ax_lat, "latency (ms)"), (ax_tput, "requests/s"), (ax_tok, "output tokens/s")):
        ax.set_xlabel("offered rate (requests/s)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
        if ax.has_data():
            ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def timeline_series(timeline: Sequence[dict[str, Any]]) -> dict[str, dict[str, tuple[list[float], list[float]]]]:
    """panel -> sample name -> (times, values), from polled /metrics points. Each sample goes
    to the first panel whose keys it matches; cumulative samples (_sum, _count, _total) are
    not levels and are left out, except that a batch-size histogram's _sum/_count deltas
    between polls give the mean batch size of the steps run in that interval."""
    out: dict[str, dict[str, tuple[list[float], list[float]]]] = {p: {} for p in TIMELINE_PANELS}
    prev: dict[str, float] = {}
    prev_t = 0.0
    for point in timeline:
        vals = point["values"]
        for name, v in vals.items():
            base = name.split("{", 1)[0]
            if base.endswith("batch_size_sum") and base[:-4] + "_count" in vals:
                cnt = base[:-4] + "_count"
                steps = vals[cnt] - prev.get(cnt, vals[cnt])
                if steps > 0:
                    ts, vs = out["batch size"].setdefault(f"{base[:-4]} (mean per step)", ([], []))
                    ts.append(prev_t)  # drawn steps-post: across the interval it describes
                    vs.append((v - prev[name]) / steps)
            if base.endswith(("_sum", "_count", "_total")):
                continue
            for panel, keys in TIMELINE_PANELS.items():
                if any(k in base for k in keys):
                    ts, vs = out[panel].setdefault(name, ([], []))
                    ts.append(point["t"])
                    vs.append(v)
                    break
        prev, prev_t = vals, point["t"]
    return out


def plot_timeline(timeline: Sequence[dict[str, Any]], path: str, title: str) -> None:
    """Queue depth, batch size, window and KV usage over the run, as the server reported them."""
    series = timeline_series(timeline)
    fig = Figure(figsize=(11, 9))
    axes = fig.subplots(len(series), 1, sharex=True)
    for ax, (panel, lines) in zip(axes, series.items()):
        for name, (ts, vs) in sorted(lines.items())[:8]:  # a legend past 8 lines is unreadable
            style = "--" if "max_" in name else "-"  # a cap, not a level
            ax.plot(ts, vs, style, drawstyle="steps-post", label=name)
        ax.set_ylabel(panel)
        ax.grid(alpha=0.3)
        if lines:
            ax.legend(fontsize=7, loc="upper right")
        else:
            ax.text(0.5, 0.5, "not reported by the server", ha="center", va="center", transform=ax.transAxes)
    axes[-1].set_xlabel("time since start (s)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
