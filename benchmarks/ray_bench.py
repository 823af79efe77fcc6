"""1 vs 2 replicas, and disaggregated vs not, served over HTTP and load-tested with `bench`.

    python -m benchmarks.ray_bench --out BENCHMARKS.md           # about 6 minutes here
    python -m benchmarks.ray_bench --out /tmp/r.md --quick       # a smoke run

Each layout is started as `batchserve serve ...` on a free port and gets the same open-loop
workload; the section written to --out compares them (and the hand-off cost, read from
/metrics). All layouts share the machine's cores: on 2 cores two one-thread replicas compete
with the HTTP process exactly as one two-thread engine does.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import sys
import tempfile

import httpx

from batchserve.bench.cli import run_sweep
from batchserve.bench.client import ClientConfig
from benchmarks.report_md import publish
from benchmarks.standard import running_server

LAYOUTS = (
    ("1 engine, 2 threads (no Ray)", ["--threads", "2"]),
    ("Ray: 1 replica x 2 threads", ["--ray", "--replicas", "1", "--replica-cpus", "2"]),
    ("Ray: 2 replicas x 1 thread", ["--ray", "--replicas", "2", "--replica-cpus", "1"]),
    ("Ray: 1 prefill + 1 decode worker x 1 thread", ["--ray", "--prefill-workers", "1", "--decode-workers", "1",
                                                    "--replica-cpus", "1"]),
)
TITLE = "## Ray: 1 vs 2 replicas, disaggregated vs not (live, HTTP)"


def scrape(url: str) -> dict[str, float]:
    """The router's hand-off counters from /metrics (empty without Ray)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for name in ("kv_handoffs_total", "kv_handoff_tokens_total", "kv_handoff_seconds_total",
                 "kv_handoff_copy_seconds_total"):
        m = re.search(rf"^batchserve:{name} ([0-9.e+-]+)$", text, re.M)
        if m:
            out[name] = float(m.group(1))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="markdown file whose Ray section is replaced (e.g. BENCHMARKS.md)")
    p.add_argument("--workload", default="chat")
    p.add_argument("--rates", default="1.0,3.0")
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--scale", type=float, default=0.25)
    p.add_argument("--max-duration", type=float, default=150.0)
    p.add_argument("--work-dir", default=None)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    if a.quick:
        a.rates, a.requests, a.scale, a.max_duration = "2", 6, 0.05, 60.0
    rates = [float(r) for r in a.rates.split(",")]
    work = a.work_dir or tempfile.mkdtemp(prefix="ray_bench_")
    os.makedirs(work, exist_ok=True)
    rows = []
    kv_per_token = ""
    for label, args in LAYOUTS:
        slug = re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")
        log_path = os.path.join(work, slug + ".log")
        with running_server(["--kv-cache-gb", "0.5", *args], log_path) as url:
            cfg = ClientConfig(url, max_duration_s=a.max_duration, progress=False)
            summary_path = run_sweep(cfg, a.workload, a.requests, rates, os.path.join(work, slug), label=label,
                                     scale=a.scale, plot=False)
            handoff = scrape(url)
        with open(log_path) as f:  # the server's "KV cache: ... = T tokens (G GiB, dtype" line
            m = re.search(r"KV cache: \d+ blocks x \d+ tokens = (\d+) tokens \(([\d.]+) GiB, (\w+)", f.read())
        if m:
            kv_per_token = f"{float(m[2]) * 2**30 / int(m[1]) / 1024:.0f} KB of {m[3]} K/V each for this model"
        with open(summary_path) as f:
            runs = json.load(f)["runs"]
        for run in runs:
            rows.append((label, run["rate"], run["summary"], handoff))
    lines = [TITLE, "", f"`python -m benchmarks.ray_bench {' '.join(argv or sys.argv[1:])}` — "
             f"{datetime.date.today().isoformat()}, {platform.machine()}, {os.cpu_count()} cores; workload "
             f"`{a.workload}` (scale {a.scale}), {a.requests} requests per rate, open-loop Poisson, greedy, "
             "outputs to full length. Latencies in seconds over completed requests.", "",
             "| layout | rate (req/s) | done | out tok/s | TTFT P50 | TTFT P99 | TPOT P50 (ms) | TPOT P99 (ms) | E2E P99 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for label, rate, s, _ in rows:
        lat = s["latency"]
        lines.append(f"| {label} | {rate:g} | {s['n_ok']}/{s['n_requests']} | {s['output_tokens_per_s']:.1f} | "
                     f"{_s(lat['ttft_ms'], 'p50')} | {_s(lat['ttft_ms'], 'p99')} | {_ms(lat['tpot_ms'], 'p50')} | "
                     f"{_ms(lat['tpot_ms'], 'p99')} | {_s(lat['e2e_ms'], 'p99')} |")
    for label, _, _, h in rows[-1:]:
        if h.get("kv_handoff_tokens_total"):
            n, tok = h["kv_handoffs_total"], h["kv_handoff_tokens_total"]
            lines += ["", f"Hand-off ({label}, all rates): {n:.0f} requests, {tok:.0f} prompt tokens "
                      f"({kv_per_token or 'K/V'}). Copying (export + import): "
                      f"**{1e3 * h['kv_handoff_copy_seconds_total'] / tok:.3f} ms per prompt token**; first token "
                      f"out of the prefill worker to adopted by the decode worker: "
                      f"**{1e3 * h['kv_handoff_seconds_total'] / n:.1f} ms per request** "
                      f"({1e3 * h['kv_handoff_seconds_total'] / tok:.2f} ms per prompt token; this includes the Ray "
                      "calls and waiting for the decode worker's current step to end)."]
    text = "\n".join(lines) + "\n"
    return publish(text, a.out, TITLE)


def _s(d: dict, key: str) -> str:  # ms -> s
    v = d.get(key)
    return "-" if v is None else f"{v / 1e3:.2f}"


def _ms(d: dict, key: str) -> str:
    v = d.get(key)
    return "-" if v is None else f"{v:.0f}"


if __name__ == "__main__":
    sys.exit(main())
