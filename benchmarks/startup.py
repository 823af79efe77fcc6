"""Startup: how long `serve` takes to answer /health with 200, the C++ kernels already built,
and where that time goes.

    python -m benchmarks.startup --out BENCHMARKS.md           # about a minute

Each run starts `python -m batchserve serve` with the default model on a free port, polls
/health every 20 ms and stops the server once it answers 200; the runs' median and range are
reported. The breakdown is one more process that takes the steps `serve` takes, one after
another, timing each (uvicorn's start and the polling are not in it). Kernels not built yet are built
first, outside the timing (a first start is not what this measures), and a first start that
writes the tokenizer cache is not counted.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

TITLE = "## Startup: warm start to /health"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(root: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": root}


def time_to_health(root: str = ROOT, timeout_s: float = 300.0) -> float:
    """Seconds from starting `serve` (the checkout at `root`) to its first 200 on /health."""
    port = _free_port()
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-m", "batchserve", "serve", "--port", str(port), "--log-level", "WARNING"],
                         cwd=root, env=_env(root), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while time.monotonic() - t0 < timeout_s:
            if p.poll() is not None:
                raise RuntimeError(f"serve exited with status {p.returncode} before /health turned 200")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except OSError:
                pass
            time.sleep(0.02)
        raise RuntimeError(f"/health not 200 within {timeout_s:.0f} s")
    finally:
        p.terminate()
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()


def phases() -> list[tuple[str, float]]:
    """In this process: the steps of a warm start in `serve`'s order, (what, seconds) each.
    Run as a child (--phases) so that every import is paid here."""
    started = float(os.environ["STARTUP_T0"])
    out = [("interpreter start", time.time() - started)]
    t = time.perf_counter()

    def mark(what: str) -> None:
        nonlocal t
        now = time.perf_counter()
        out.append((what, now - t))
        t = now

    import torch  # noqa: F401

    mark("import torch")
    import batchserve.server.app  # noqa: F401
    import batchserve.server.run  # noqa: F401

    mark("import the server (fastapi, uvicorn, the app)")
    from batchserve.config import EngineConfig
    from batchserve.engine.engine import LLMEngine
    from batchserve.runner import loader
    from batchserve.runner.kernels import build_all
    from batchserve.runner.model_runner import ModelRunner

    mark("import the engine and runner")
    cfg = EngineConfig()
    loader.check_model(cfg.model)
    mark("check_model: the GGUF metadata")
    tok_s = [0.0]
    if hasattr(loader, "_gguf_tokenizer"):
        target, attr = loader, "_gguf_tokenizer"
    else:  # the loader of before: transformers' GGUF conversion inside the load
        import transformers

        mark("import transformers")
        target, attr = transformers.AutoTokenizer, "from_pretrained"
    real = getattr(target, attr)

    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            tok_s[0] += time.perf_counter() - t0

    setattr(target, attr, timed)
    loaded = loader.load_model(cfg.model)
    setattr(target, attr, real)
    now = time.perf_counter()
    out.append(("load_model: GGUF tensors and weights", now - t - tok_s[0]))
    out.append(("load_model: the tokenizer", tok_s[0]))
    t = now
    build_all()
    mark("load the C++ kernels")
    runner = ModelRunner(loaded, cfg.model, cfg.cache)
    mark("ModelRunner: pack the weights, allocate the KV cache")
    tok, eos = loaded.tokenizer, loaded.config.eos_token_id
    del loaded
    loader.release_freed_memory()
    engine = LLMEngine(cfg, runner, tok, eos)
    mark("build the engine")
    engine.warm_up()
    mark("warm_up: synthetic requests")
    out.append(("transformers imported", float("transformers" in sys.modules)))
    return out


def run_phases(root: str = ROOT) -> list[tuple[str, float]]:
    env = {**_env(root), "STARTUP_T0": repr(time.time())}
    res = subprocess.run([sys.executable, os.path.abspath(__file__), "--phases"], cwd=root, env=env,
                         capture_output=True, text=True, check=True)
    return [tuple(x) for x in json.loads(res.stdout.strip().splitlines()[-1])]


def report(runs: list[float], steps: list[tuple[str, float]], label: str) -> str:
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    imported = dict(steps).pop("transformers imported", 0.0)
    rows = [(w, s) for w, s in steps if w != "transformers imported"]
    lines = [TITLE, "",
             f"`python -m benchmarks.startup --runs {len(runs)}`: {cpu_name()}, {os.cpu_count()} cores, "
             f"{when} UTC ({label}; 1-minute load average {load:.2f} at the end).", "",
             f"Warm start (kernels built, tokenizer cached) to the first 200 on /health, {len(runs)} runs: "
             f"median **{statistics.median(runs):.2f} s**, range {min(runs):.2f}–{max(runs):.2f} s "
             f"({', '.join(f'{r:.2f}' for r in runs)}).", "",
             "| step, in serve's order | ms |", "|---|---|"]
    lines += [f"| {w} | {s * 1000:.0f} |" for w, s in rows]
    lines += [f"| total | {sum(s for _, s in rows) * 1000:.0f} |", "",
              f"transformers imported on the way: {'yes' if imported else 'no'}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="starts to time")
    ap.add_argument("--checkout", default=ROOT, help="the batchserve checkout to start (default: this one)")
    ap.add_argument("--label", default="this checkout", help="what was measured, for the report")
    ap.add_argument("--out", default=None, help="replace this section in a markdown file (BENCHMARKS.md)")
    ap.add_argument("--phases", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.phases:
        print(json.dumps(phases()))
        return 0
    root = os.path.abspath(a.checkout)
    subprocess.run([sys.executable, "-m", "batchserve.runner.kernels"], cwd=root, env=_env(root), check=True,
                   capture_output=True)  # built now, if they were not: not part of what is timed
    time_to_health(root)  # a first run may write the tokenizer cache; not counted
    runs = [time_to_health(root) for _ in range(a.runs)]
    steps = run_phases(root)
    from benchmarks.report_md import publish

    return publish(report(runs, steps, a.label), a.out, TITLE)


if __name__ == "__main__":
    sys.exit(main())
