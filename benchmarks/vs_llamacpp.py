"""The 64-request workload over HTTP: batchserve against llama.cpp's server, same GGUF file.

    python -m benchmarks.vs_llamacpp --llama-server PATH/llama-server --out BENCHMARKS.md

Both servers get the same 64 streaming requests at once from the same client (the foundation
benchmark's offline workload: random prompts of lognormal length, median ~200 tokens, outputs
80 % 32-64 / 20 % 256-512 tokens, `ignore_eos`, greedy), on the same cores, alternating for
`--rounds` rounds: batchserve as `serve` with the HTTP benchmark's flags, llama.cpp as
`llama-server` on the same model file with one slot per request (continuous batching), the
threads set to the machine's cores, and each slot's context room for its longest request.

`make bench-llamacpp` builds llama-server and runs this: the PyPI sdist of llama-cpp-python
carries llama.cpp's source (`pip download --no-deps --no-binary :all: llama-cpp-python`, then in
its vendor/llama.cpp `cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF
-DLLAMA_OPENSSL=OFF && cmake --build build --target llama-server`; about 12 minutes on 2 cores).
The server's command is benchmarks.servers.llamacpp_cmd (flash attention off: faster than its
default here); extra llama-server flags go after `--`.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys

from batchserve.bench.client import ClientConfig, run
from batchserve.bench.workload import WorkItem
from batchserve.runner.loader import resolve_model_path
from benchmarks.foundation import offline_workload
from benchmarks.http_offline import ENGINE_FLAGS
from benchmarks.report_md import publish
from benchmarks.servers import Server, llamacpp_cmd, start_batchserve, start_llamacpp, started

TITLE = "## Against llama.cpp: the 64-request workload through both servers"
SLOT_CTX = 1600  # the workload's longest request: a 1,024-token prompt and 512 output tokens, rounded up


def serve_once(server: Server, items: list[WorkItem], warm: list[WorkItem]) -> dict:
    """Wait for a started server, warm it up, send the workload, stop it."""
    with started(server, timeout_s=600.0) as s:
        run(warm, ClientConfig(s.url, progress=False, extensions=False))
        res = run(items, ClientConfig(s.url, progress=False, extensions=False))
    ok = sum(1 for r in res.records if r.ok)
    tokens = sum(r.output_tokens for r in res.records)
    return {"ok": ok, "tokens": tokens, "seconds": res.duration_s, "tok_s": tokens / res.duration_s,
            "errors": sorted({r.error for r in res.records if not r.ok and r.error})[:3]}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmdline = " ".join(argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-server", required=True, help="path of llama.cpp's llama-server binary")
    p.add_argument("--out", default=None)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    a = p.parse_args(argv)
    if not os.access(a.llama_server, os.X_OK):
        p.error(f"--llama-server: {a.llama_server!r} is not an executable file")

    model = resolve_model_path("smollm2-135m-instruct")
    work = offline_workload(a.requests, 0, 49152)  # SmolLM2's vocabulary (not loading the model here)
    items = [WorkItem(0.0, len(ids), None, ids, m) for ids, m in work]
    warm = items[:4]
    servers = {"batchserve": lambda: start_batchserve(extra_args=ENGINE_FLAGS),
               "llama.cpp": lambda: start_llamacpp(a.llama_server, model, a.requests, SLOT_CTX, extra_args=extra,
                                                   threads=a.threads)}
    llama_args = llamacpp_cmd(a.llama_server, model, a.requests, SLOT_CTX, "PORT", extra, a.threads)[1:]
    rows: list[tuple[int, str, dict]] = []
    for r in range(a.rounds):
        for name in (("llama.cpp", "batchserve") if r % 2 == 0 else ("batchserve", "llama.cpp")):
            res = serve_once(servers[name](), items, warm)
            rows.append((r + 1, name, res))
            print(f"round {r + 1} {name}: {res['ok']}/{len(items)} ok, {res['tok_s']:.1f} tok/s", file=sys.stderr)

    med = {n: statistics.median(res["tok_s"] for _, m, res in rows if m == n) for n in servers}
    lines = [TITLE, "", f"`python -m benchmarks.vs_llamacpp {cmdline}` — "
             f"{datetime.datetime.now():%Y-%m-%d %H:%M}, {platform.machine()}, {os.cpu_count()} cores. "
             f"Model {os.path.basename(model)} in both. batchserve: `serve {' '.join(ENGINE_FLAGS)}`. llama.cpp: "
             f"`llama-server {' '.join(x if x != model else 'MODEL' for x in llama_args)}`. "
             f"{len(items)} streaming requests at once from the same client, servers alternating.", "",
             "| round | server | ok | output tokens | seconds | tok/s |", "|---|---|---|---|---|---|"]
    for r, name, res in rows:
        lines.append(f"| {r} | {name} | {res['ok']}/{len(items)} | {res['tokens']} | {res['seconds']:.1f} | "
                     f"{res['tok_s']:.1f} |" + (f" errors: {'; '.join(res['errors'])}" if res["errors"] else ""))
    lines += ["", f"Median output tok/s: batchserve **{med['batchserve']:.1f}**, llama.cpp **{med['llama.cpp']:.1f}**: "
              f"**{med['batchserve'] / med['llama.cpp']:.1f}×**."]
    return publish("\n".join(lines), a.out, TITLE)


if __name__ == "__main__":
    sys.exit(main())
