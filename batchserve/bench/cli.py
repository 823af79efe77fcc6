"""`batchserve bench`: sweep request rates against an OpenAI-compatible URL, or compare runs.

    batchserve bench --url http://127.0.0.1:8000 --workload chat --requests 50 --rates 0.5,1,2 --out bench_out
    batchserve bench --url ... --workload chat --slo ttft_ms=500,tpot_ms=50 --find-max-goodput --out search
    batchserve bench --compare bench_a/summary.json bench_b/summary.json --out cmp

`--slo` sets the targets of SLO attainment and goodput (`bench.metrics`): `key=ms,...` for
every request, `CLASS:key=ms,...` for one class (it wins over the workload's own class SLO,
which wins over the global one). `--find-max-goodput` searches (`bench.search`) for the
highest rate whose attainment stays at `--target-attainment`, starting from the first rate.
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
from typing import TYPE_CHECKING, Any

import httpx

from batchserve.bench.metrics import SLO, parse_slo_args, summarize, unmatched_classes
from batchserve.bench.traces import FORMATS as TRACE_FORMATS
from batchserve.bench.traces import SAMPLES as TRACE_SAMPLES
from batchserve.bench.workload import MIXES, class_slos, make_workload, mix_classes, offered_rate, parse_arrival_args

if TYPE_CHECKING:
    from batchserve.bench.client import ClientConfig

# The client (aiohttp), the report (matplotlib) and the search are imported by the commands that
# use them: every `batchserve` command builds this subcommand's parser, `serve` included.


def add_bench_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    """Register the `bench` subcommand on a subparsers object."""
    b = sub.add_parser("bench", parents=parents, help="load-test an OpenAI-compatible server; reports and plots",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("--url", help="server base URL, e.g. http://127.0.0.1:8000")
    b.add_argument("--workload", default="chat", help=f"a mix {sorted(MIXES)}, or a trace file (as --trace)")
    b.add_argument("--trace", default=None, metavar="FILE|SAMPLE", help="replay a trace file or bundled sample "
                   "(burstgpt, azure-code, azure-conv, mooncake) instead of --workload")
    b.add_argument("--trace-format", default=None, choices=TRACE_FORMATS, help="the trace's format (default: sniffed)")
    b.add_argument("--time-scale", type=float, default=None,
                   help="multiply the trace's timestamps (0.1: ten times faster); instead of --rates")
    b.add_argument("--requests", type=int, default=100, help="requests per rate (0: the whole trace)")
    b.add_argument("--rates", default=None, help="comma-separated request rates (req/s) to sweep "
                   "(default 1; for a trace: its own timing)")
    b.add_argument("--arrival", default=None, help="poisson | gamma | step | ramp | piecewise | onoff | replay "
                   "(default: poisson, or replay for a trace)")
    b.add_argument("--burstiness", type=float, default=None, help="gamma arrivals: CV^2 of the gaps")
    b.add_argument("--arrival-args", default=None, help='JSON of more arrival parameters, e.g. \'{"step_s": 5}\'')
    b.add_argument("--scale", type=float, default=None, help="multiply every length (default: the mix's)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--out", default="bench_out", help="output directory")
    b.add_argument("--slo-ms", type=float, default=None, help="end-to-end SLO for requests without a deadline")
    b.add_argument("--slo", action="append", default=None, metavar="[CLASS:]KEY=MS,...",
                   help="SLO targets ttft_ms, tpot_ms, e2e_ms for goodput; CLASS: for one class; repeatable")
    b.add_argument("--find-max-goodput", action="store_true",
                   help="search for the highest rate keeping --target-attainment (from the first --rates)")
    b.add_argument("--target-attainment", type=float, default=99.0, help="percent of requests meeting the SLO")
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


def parse_rates(text: str) -> list[float]:
    """`--rates`: comma-separated request rates, each a finite number > 0."""
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        rates = []
    if not rates or not all(math.isfinite(r) and r > 0 for r in rates):
        raise ValueError(f"--rates: expected comma-separated rates > 0 (req/s), got {text!r}")
    return rates


def _arrival_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    kw: dict[str, Any] = parse_arrival_args(a.arrival_args)
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
              slo: SLO | None = None, class_slo: dict[str, SLO] | None = None, plot: bool = True,
              meta: dict[str, Any] | None = None, search_target: float | None = None,
              trace_format: str | None = None, time_scale: float | None = None) -> str:
    """Run the workload at every rate in turn against cfg.url and write the report in `out`;
    return its summary.json path. Requests of a class are judged by `class_slo` (over the
    workload's own class SLOs) or else `slo`. With `search_target` (attainment in (0, 1]) the
    rates are not swept: `find_max_rate` starts at rates[0], and the report's meta gets the
    search's probes and answer under "search". `trace_format` and `time_scale` are
    make_workload's, for a trace."""
    from batchserve.bench.client import run
    from batchserve.bench.report import RateRun, markdown_table, write_report
    from batchserve.bench.search import find_max_rate, one_burst, search_line

    runs: list[RateRun] = []
    model = cfg.model
    per_class = {**class_slos(mix_classes(workload)), **(class_slo or {})}

    def run_at(rate: float) -> dict[str, Any]:
        nonlocal model
        items = make_workload(workload, requests, rate, seed=seed, arrival=arrival, tokenizer=tokenizer,
                              scale=scale, trace_format=trace_format, time_scale=time_scale,
                              **(arrival_kwargs or {}))
        # a trace at its own timing (rate 0) is labelled by the rate it offers
        offered = rate or float(f"{offered_rate([w.arrival for w in items]):.3g}")
        timing = f"{rate:g} req/s" if rate else f"its own timing ({offered:g} req/s)"
        print(f"{label}: {workload} at {timing}: {len(items)} requests over {items[-1].arrival:.1f} s",
              file=sys.stderr)
        if (warn := unmatched_classes(class_slo or {}, (w.cls for w in items))) is not None:
            print(f"warning: {warn}", file=sys.stderr)
        if cfg.max_duration_s is not None and items[-1].arrival > cfg.max_duration_s:
            unsent = sum(w.arrival > cfg.max_duration_s for w in items)
            print(f"warning: --max-duration {cfg.max_duration_s:g} s ends the run before the last arrival: "
                  f"{unsent} of {len(items)} requests will not be sent and count as failures", file=sys.stderr)
        res = run(items, cfg)
        model = model or res.model
        summary = summarize(res.records, res.duration_s, slo_ms, slo, per_class)
        runs.append(RateRun(offered, res.records, summary, res.timeline))
        print(markdown_table([(label, offered, summary)]).split("\n\n")[0], file=sys.stderr)
        return summary

    info: dict[str, Any] = {}
    if search_target is None:
        for rate in rates:
            run_at(rate)
    else:
        found = find_max_rate(lambda r: run_at(r)["goodput_frac"] or 0.0, search_target, rates[0])
        best = next((r for r in runs if r.rate == found.best), None)
        info["search"] = {"target_attainment": search_target, "best_rate": found.best, "bracketed": found.bracketed,
                          "goodput_rps": best.summary["goodput_rps"] if best else None,
                          "best_was_burst": best is not None and one_burst(best.records),
                          "probes": [{"rate": r, "attainment": a} for r, a in found.probes]}
        print(search_line(info["search"]), file=sys.stderr)
    info.update({"label": label, "url": cfg.url, "model": model, "workload": workload, "arrival": arrival,
                 "arrival_args": arrival_kwargs or {}, "trace_format": trace_format, "time_scale": time_scale,
                 "requests": requests, "seed": seed, "scale": scale,
                 "slo_ms": slo_ms, "slo": slo.targets() if slo else {},
                 "class_slo": {k: v.targets() for k, v in per_class.items()},
                 "created": datetime.datetime.now().isoformat(timespec="seconds"), **(meta or {})})
    return write_report(out, info, runs, plot=plot)


def sweep(a: argparse.Namespace) -> str:
    """`bench` flags -> run_sweep."""
    if a.trace:
        a.workload = a.trace
    is_trace = a.workload not in MIXES
    rates = parse_rates(a.rates) if a.rates else [0.0 if is_trace else 1.0]
    slo, class_slo = parse_slo_args(a.slo or [])
    from batchserve.bench.client import ClientConfig

    cfg = ClientConfig(a.url, model=a.model, temperature=a.temperature, ignore_eos=not a.no_ignore_eos,
                       extensions=not a.no_extensions, request_timeout_s=a.timeout,
                       max_duration_s=a.max_duration, progress=not a.no_progress)
    return run_sweep(cfg, a.workload, a.requests, rates, a.out, label=a.label or a.url, seed=a.seed,
                     arrival=a.arrival, arrival_kwargs=_arrival_kwargs(a), scale=a.scale,
                     tokenizer=load_tokenizer(a.tokenizer) if a.tokenizer else None, slo_ms=a.slo_ms,
                     slo=slo, class_slo=class_slo, plot=not a.no_plots, meta={"tokenizer": a.tokenizer},
                     search_target=a.target_attainment / 100.0 if a.find_max_goodput else None,
                     trace_format=a.trace_format, time_scale=a.time_scale)


def check_args(a: argparse.Namespace) -> str | None:
    """What is wrong with the search and SLO flags, before any request is sent; None if nothing."""
    try:
        parse_slo_args(a.slo or [])
    except ValueError as e:
        return f"--slo: {e}"
    if not 0 < a.target_attainment <= 100:
        return f"--target-attainment is a percentage in (0, 100], got {a.target_attainment:g}"
    try:
        _arrival_kwargs(a)
        if a.rates:
            parse_rates(a.rates)
    except ValueError as e:
        return str(e)
    if a.find_max_goodput and not a.rates:
        return "--find-max-goodput needs a starting rate > 0: --rates R"
    if a.trace and a.trace not in TRACE_SAMPLES and not os.path.isfile(a.trace):
        return f"--trace {a.trace!r}: no such file, nor a bundled sample {sorted(TRACE_SAMPLES)}"
    if a.time_scale is not None and (a.rates or a.find_max_goodput or not a.time_scale > 0):
        return "--time-scale: a positive factor for a trace's own timing, without --rates or --find-max-goodput"
    return None


def cmd_bench(a: argparse.Namespace) -> int:
    if a.compare:
        from batchserve.bench.report import compare_reports

        print(compare_reports(a.compare, a.out))
        print(f"wrote {os.path.join(a.out, 'compare.md')} and plots", file=sys.stderr)
        return 0
    if not a.url:
        print("error: bench needs --url (or --compare)", file=sys.stderr)
        return 2
    if not a.url.startswith(("http://", "https://")):
        a.url = "http://" + a.url
    err = check_args(a) or _check_reachable(a.url)
    if err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    path = sweep(a)
    with open(os.path.join(os.path.dirname(path), "table.md")) as f:
        print(f.read())
    print(f"wrote {path}, records, table.md and plots in {a.out}", file=sys.stderr)
    return 0
