"""Cascading live on this CPU: one trace through `continuous`, `chunked`, `cascade` (prefill and
decode steps taking turns in one process), `cascade --cascade-workers` (the two stages in two
worker processes, K/V handed across), and under Ray two replicas of one core each and a prefill
worker beside a decode worker (K/V handed across through Ray's object store), all with the same
seats.

    python -m benchmarks.cascade_live [--out BENCHMARKS.md] [--rounds 2]

Each layout is `batchserve serve --policy P --max-num-seqs SEATS` (cascade: `--decode-max-batch
SEATS` too, so that its decode stage has the seats the others have; two Ray replicas SEATS / 2
each; the Ray decode worker SEATS), started one at a time on
the same cores, the order rotating between rounds, and sent (after a 4-request warm-up) the
workload of benchmarks.vs_vllm: the 64-request burst at t = 0, then a Poisson load at `--load`
of the slowest layout's burst throughput (set after a first, burst-only round). Reported per
layout (medians over rounds): output tok/s, TTFT P50 / P99, time per output token P50 / P99 (each
request's mean gap after its first token) and E2E P99, latencies in ms over completed requests.
Reporting around the engine, not part of it.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import statistics
import sys

import numpy as np

from batchserve.bench.arrivals import poisson
from batchserve.bench.client import ClientConfig, run
from batchserve.bench.workload import WorkItem
from benchmarks.foundation import offline_workload
from benchmarks.report_md import publish
from benchmarks.servers import start_batchserve, started
from benchmarks.vs_vllm import VOCAB, measure

TITLE = "## Cascading live on one CPU: cascade, cascade workers and Ray's layouts against continuous and chunked"
LAYOUTS = {
    "continuous": ["--policy", "continuous"],
    "chunked": ["--policy", "chunked"],
    "cascade": ["--policy", "cascade"],
    "cascade-workers": ["--policy", "cascade", "--cascade-workers"],
    "ray-replicas": ["--ray", "--replicas", "2", "--replica-cpus", "1"],
    "ray-prefill-decode": ["--ray", "--prefill-workers", "1", "--decode-workers", "1", "--replica-cpus", "1"],
}


def layout_args(name: str, seats: int) -> list[str]:
    """`serve`'s flags for layout `name` with `seats` running requests in all: each replica its
    share, a cascade's decode stage all of them (a Ray decode worker has --max-num-seqs)."""
    args = LAYOUTS[name]
    replicas = int(args[args.index("--replicas") + 1]) if "--replicas" in args else 1
    args = [*args, "--max-num-seqs", str(seats // replicas)]
    if "cascade" in args:
        args += ["--decode-max-batch", str(seats)]
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="write the section into this Markdown file")
    ray = importlib.util.find_spec("ray") is not None
    p.add_argument("--layouts", default=",".join(n for n in LAYOUTS if ray or "--ray" not in LAYOUTS[n]),
                   help="comma-separated, from: " + ", ".join(LAYOUTS) + " (Ray's where it is installed)")
    p.add_argument("--seats", type=int, default=64, help="--max-num-seqs of every layout")
    p.add_argument("--requests", type=int, default=64, help="burst: requests sent at t = 0")
    p.add_argument("--poisson-requests", type=int, default=64)
    p.add_argument("--load", type=float, default=0.7, help="Poisson rate: this fraction of the slowest burst rate")
    p.add_argument("--rounds", type=int, default=1, help="rounds with the Poisson load (a burst-only one comes first)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    names = a.layouts.split(",")
    if unknown := [n for n in names if n not in LAYOUTS]:
        p.error(f"--layouts: unknown {', '.join(unknown)} (known: {', '.join(LAYOUTS)})")
    burst = [WorkItem(0.0, len(ids), None, ids, m) for ids, m in offline_workload(a.requests, a.seed, VOCAB)]
    pwork = offline_workload(a.poisson_requests, a.seed + 1, VOCAB)
    mean_out = float(np.mean([m for _, m in pwork]))
    arrivals = poisson(len(pwork), 1.0, np.random.default_rng(a.seed + 2))
    rows: list[tuple[int, str, dict]] = []
    rate = None
    for r in range(a.rounds + 1):
        if r == 1:
            rate = a.load * min(res["burst"]["tok_s"] for _, _, res in rows) / mean_out
        pois = None if rate is None else [WorkItem(float(t / rate), len(ids), None, ids, m)
                                          for t, (ids, m) in zip(arrivals, pwork)]
        for name in names[r % len(names):] + names[:r % len(names)]:
            with started(start_batchserve(extra_args=layout_args(name, a.seats)), 600.0) as s:
                run(burst[:4], ClientConfig(s.url, progress=False, extensions=False))
                res = {"burst": measure(burst, s.url, s.proc.pid)}
                if pois is not None:
                    res["poisson"] = measure(pois, s.url, s.proc.pid)
            rows.append((r, name, res))
            print(f"round {r} {name}: burst {res['burst']['tok_s']:.1f} tok/s"
                  + (f", Poisson TPOT P99 {res['poisson']['tpot_p99']:.1f} ms" if pois else ""), file=sys.stderr)

    def med(xs: list) -> float | None:
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else None

    f = lambda x, fmt=".0f": "–" if x is None else format(x, fmt)  # noqa: E731
    with open("/proc/cpuinfo") as fh:
        cpu = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), "?")
    lines = [TITLE, "", f"`{' '.join(['python -m benchmarks.cascade_live', *argv])}` — "
             f"{datetime.datetime.now():%Y-%m-%d %H:%M}, {cpu}, {os.cpu_count()} cores; {a.seats} seats each; "
             f"burst: {len(burst)} requests at t = 0; Poisson: {len(pwork)} requests at {f(rate, '.2f')} req/s "
             f"({a.load} of the slowest burst rate; mean output {mean_out:.0f} tokens); medians over "
             f"{a.rounds + 1} burst and {a.rounds} Poisson runs; latencies in ms.", "",
             "| layout | burst tok/s | burst TTFT P50 / P99 | Poisson tok/s | Poisson TTFT P50 / P99 | "
             "Poisson TPOT P50 / P99 | Poisson E2E P99 |", "|---|---|---|---|---|---|---|"]
    for name in names:
        b = [res["burst"] for _, n, res in rows if n == name]
        q = [res["poisson"] for _, n, res in rows if n == name and "poisson" in res]
        m = lambda xs, k: med([x[k] for x in xs])  # noqa: E731
        lines.append(f"| {name} | {f(m(b, 'tok_s'), '.1f')} | {f(m(b, 'ttft_p50'))} / {f(m(b, 'ttft_p99'))} "
                     f"| {f(m(q, 'tok_s'), '.1f')} | {f(m(q, 'ttft_p50'))} / {f(m(q, 'ttft_p99'))} "
                     f"| {f(m(q, 'tpot_p50'), '.1f')} / {f(m(q, 'tpot_p99'), '.1f')} | {f(m(q, 'e2e_p99'))} |")
    lines.append("")
    return publish("\n".join(lines), a.out, TITLE)


if __name__ == "__main__":
    sys.exit(main())
