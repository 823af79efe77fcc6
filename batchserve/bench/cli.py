"""`batchserve bench`: sweep request rates against an OpenAI-compatible URL, or compare runs.

    batchserve bench --url http://127.0.0.1:8000 --workload chat --requests 50 --rates 0.5,1,2 --out bench_out
    batchserve bench --compare bench_a/summary.json bench_b/summary.json --out cmp
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from typing import Any

import httpx

from batchserve.bench.client import ClientConfig, run
from batchserve.bench.metrics import summarize
from batchserve.bench.report import RateRun, compare_reports, markdown_table, write_report
from batchserve.bench.workload import MIXES, make_workload


def add_bench_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    """Register the `bench` subcommand on a subparsers object."""
    b = sub.add_parser("bench", parents=parents, help="load-test an OpenAI-compatible server; reports and plots",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("--url", help="server base URL, e.g. http://127.0.0.1:8000")
    b.add_argument("--workload", default="chat", help=f"a mix {sorted(MIXES)} or a JSONL trace file")
    b.add_argument("--requests", type=int, default=100, help="requests per rate (0: the whole trace)")
    b.add_argument("--rates", default=None, help="comma-separated request rates (req/s) to sweep "
                   "(default 1; for a trace: its own timing)")
    b.add_argument("--arrival", default=None, help="poisson | gamma | step | ramp | onoff | replay "
                   "(default: poisson, or replay for a trace)")
    b.add_argument("--burstiness", type=float, default=None, help="gamma arrivals: CV^2 of the gaps")
    b.add_argument("--arrival-args", default=None, help='JSON of more arrival parameters, e.g. \'{"step_s": 5}\'')
    b.add_argument("--scale", type=float, default=None, help="multiply every length (default: the mix's)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--out", default="bench_out", help="output directory")
    b.add_argument("--slo-ms", type=float, default=None, help="end-to-end SLO for requests without a deadline")
    b.add_argument("--model", default=None, help="model name to send (default: the server's first /v1/models id)")
    b.add_argument("--tokenizer", default=None, help="build text prompts of exact length with this model's "
                   "tokenizer (alias, GGUF file or HF dir); default: random token ids")
    b.add_argument("--label", default=None, help="this run's name in comparisons (default: the URL)")
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--no-ignore-eos", action="store_true", help="don't ask for full-length outputs")
    b.add_argument("--no-extensions", action="store_true", help="don't send priority / deadline fields")
    b.add_argument("--timeout", type=float, default=300.0, help="per-request timeout (s)")
    b.add_argument("--max-duration", type=float, default=None, help="cut each rate's run off after this (s)")
    b.add_argument("--no-progress", action="store_true")
    b.add_argument("--no-plots", action="store_true")
    b.add_argument("--compare", nargs="+", metavar="SUMMARY_JSON", help="overlay earlier runs instead of running")
    b.set_defaults(func=cmd_bench)


def load_tokenizer(model: str) -> Any:
    """A transformers tokenizer for an alias, GGUF file or HF directory."""
    from transformers import AutoTokenizer

    from batchserve.runner.loader import resolve_model_path

    path = resolve_model_path(model)
    if os.path.isdir(path):
        return AutoTokenizer.from_pretrained(path)
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def _arrival_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    kw: dict[str, Any] = json.loads(a.arrival_args) if a.arrival_args else {}
    if a.burstiness is not None:
        kw["burstiness"] = a.burstiness
    return kw


def _check_reachable(url: str) -> str | None:
    try:
        httpx.get(url.rstrip("/") + "/v1/models", timeout=10.0)
    except httpx.HTTPError as e:
        return f"cannot reach {url}: {type(e).__name__}: {e}"
    return None


def run_sweep(cfg: ClientConfig, workload: str, requests: int, rates: list[float], out: str, *,
              label: str, seed: int = 0, arrival: str | None = None, arrival_kwargs: dict[str, Any] | None = None,
              scale: float | None = None, tokenizer: Any = None, slo_ms: float | None = None,
              plot: bool = True, meta: dict[str, Any] | None = None) -> str:
    """Run the workload at every rate in turn against cfg.url and write the report in `out`;
    return its summary.json path."""
    runs: list[RateRun] = []
    model = cfg.model
    for rate in rates:
        items = make_workload(workload, requests, rate, seed=seed, arrival=arrival, tokenizer=tokenizer,
                              scale=scale, **(arrival_kwargs or {}))
        print(f"{label}: {workload} at {rate:g} req/s: {len(items)} requests over {items[-1].arrival:.1f} s",
              file=sys.stderr)
        res = run(items, cfg)
        model = model or res.model
        summary = summarize(res.records, res.duration_s, slo_ms)
        runs.append(RateRun(rate, res.records, summary, res.timeline))
        print(markdown_table([(label, rate, summary)]).split("\n\n")[0], file=sys.stderr)
    info = {"label": label, "url": cfg.url, "model": model, "workload": workload, "arrival": arrival,
            "arrival_args": arrival_kwargs or {}, "requests": requests, "seed": seed, "scale": scale,
            "slo_ms": slo_ms, "created": datetime.datetime.now().isoformat(timespec="seconds"), **(meta or {})}
    return write_report(out, info, runs, plot=plot)


def sweep(a: argparse.Namespace) -> str:
    """`bench` flags -> run_sweep."""
    is_trace = a.workload not in MIXES
    rates = [float(r) for r in a.rates.split(",")] if a.rates else [0.0 if is_trace else 1.0]
    cfg = ClientConfig(a.url, model=a.model, temperature=a.temperature, ignore_eos=not a.no_ignore_eos,
                       extensions=not a.no_extensions, request_timeout_s=a.timeout,
                       max_duration_s=a.max_duration, progress=not a.no_progress)
    return run_sweep(cfg, a.workload, a.requests, rates, a.out, label=a.label or a.url, seed=a.seed,
                     arrival=a.arrival, arrival_kwargs=_arrival_kwargs(a), scale=a.scale,
                     tokenizer=load_tokenizer(a.tokenizer) if a.tokenizer else None, slo_ms=a.slo_ms,
                     plot=not a.no_plots, meta={"tokenizer": a.tokenizer})


def cmd_bench(a: argparse.Namespace) -> int:
    if a.compare:
        print(compare_reports(a.compare, a.out))
        print(f"wrote {os.path.join(a.out, 'compare.md')} and plots", file=sys.stderr)
        return 0
    if not a.url:
        print("error: bench needs --url (or --compare)", file=sys.stderr)
        return 2
    if not a.url.startswith(("http://", "https://")):
        a.url = "http://" + a.url
    err = _check_reachable(a.url)
    if err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    path = sweep(a)
    with open(os.path.join(os.path.dirname(path), "table.md")) as f:
        print(f.read())
    print(f"wrote {path}, records, table.md and plots in {a.out}", file=sys.stderr)
    return 0
