"""The standard comparison: every batching policy on the standard workloads, live.

    python -m benchmarks.standard --out-dir bench_out            # full size: a quiet machine
    python -m benchmarks.standard --out-dir /tmp/b --quick       # a smoke run, a minute or two

For each policy in `core.policies.POLICIES` it starts `batchserve serve --policy NAME` on a
free loopback port, waits for /health, sweeps each workload's rates with the open-loop
client, and stops the server. Then, per workload, it overlays the policies (compare.md,
compare_sweep.png, compare_cdf.png) and writes `REPORT.md` in --out-dir linking it all.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from batchserve.bench.cli import run_sweep
from batchserve.bench.client import ClientConfig
from batchserve.bench.report import compare_reports


@dataclass(frozen=True)
class Standard:
    """One standard workload: its rates (req/s), requests per rate and workload options."""

    workload: str
    rates: tuple[float, ...]
    requests: int
    scale: float | None = None
    arrival: str | None = None
    arrival_kwargs: dict[str, Any] = field(default_factory=dict)
    slo_ms: float | None = None


# Sized for SmolLM2-135M on a few CPU cores: the higher rate of each is near saturation.
STANDARD = (
    Standard("chat", (0.5, 1.0), 60, scale=0.25, slo_ms=8000),
    Standard("mixed", (0.25, 0.5), 40, slo_ms=10000),
    Standard("short-long", (1.0, 2.0), 60, scale=0.5, slo_ms=8000),
    Standard("priority-flood", (1.0,), 80, arrival="step", arrival_kwargs={"factors": (1, 7.5, 1), "step_s": 8},
             slo_ms=8000),
)
QUICK = (
    Standard("chat", (2.0,), 4, scale=0.05, slo_ms=5000),
    Standard("priority-flood", (2.0,), 6, scale=0.25, slo_ms=5000),
)


SERVE_CMD = (sys.executable, "-m", "batchserve", "serve")


def free_port() -> int:
    """A port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    """Poll /health until 200; raise if the process dies or time runs out."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before it was healthy")
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"server at {url} not healthy after {timeout_s:.0f} s")


@contextlib.contextmanager
def running_server(args: list[str], log_path: str | None = None, timeout_s: float = 300.0,
                   serve_cmd: tuple[str, ...] = SERVE_CMD) -> Iterator[str]:
    """`batchserve serve ARGS` (or another server that takes --host / --port and answers /health,
    `serve_cmd`) on a free 127.0.0.1 port, as a subprocess; yields its URL once /health is 200,
    and stops it (SIGTERM, then kill) on exit."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [*serve_cmd, "--host", "127.0.0.1", "--port", str(port), *args]
    log = open(log_path, "w") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, proc, timeout_s)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        if log is not subprocess.DEVNULL:
            log.close()


def run_standard(out_dir: str, policies: list[str], standards: tuple[Standard, ...], server_args: list[str],
                 progress: bool = False, max_duration_s: float | None = None) -> str:
    """Every policy x every standard workload; returns the REPORT.md path."""
    os.makedirs(out_dir, exist_ok=True)
    done: dict[str, list[str]] = {s.workload: [] for s in standards}
    failed: list[str] = []
    for policy in policies:
        log_path = os.path.join(out_dir, f"server_{policy}.log")
        try:
            with running_server(["--policy", policy, *server_args], log_path) as url:
                for s in standards:
                    cfg = ClientConfig(url, progress=progress, max_duration_s=max_duration_s)
                    done[s.workload].append(run_sweep(
                        cfg, s.workload, s.requests, list(s.rates), os.path.join(out_dir, s.workload, policy),
                        label=policy, arrival=s.arrival, arrival_kwargs=s.arrival_kwargs, scale=s.scale,
                        slo_ms=s.slo_ms, meta={"policy": policy, "server_args": server_args}))
        except (RuntimeError, TimeoutError) as e:
            failed.append(f"{policy}: {e} (see {os.path.basename(log_path)})")
            print(f"policy {policy}: {e}", file=sys.stderr)
    lines = ["# Standard comparison: every policy on the standard workloads", "",
             f"Server flags: `{' '.join(server_args) or '(defaults)'}`. Open-loop Poisson load unless noted; "
             "latencies in ms over completed requests.", ""]
    for s in standards:
        if not done[s.workload]:
            continue
        wdir = os.path.join(out_dir, s.workload)
        md = compare_reports(done[s.workload], wdir)
        arrival = f"{s.arrival} {s.arrival_kwargs}" if s.arrival else "poisson"
        lines += [f"## {s.workload}", "", f"{s.requests} requests per rate, rates {', '.join(f'{r:g}' for r in s.rates)}"
                  f" req/s, arrivals {arrival}, scale {s.scale if s.scale is not None else 'default'}, "
                  f"SLO {s.slo_ms:g} ms.", "", md,
                  f"![latency and throughput vs load]({s.workload}/compare_sweep.png)", "",
                  f"![latency CDFs]({s.workload}/compare_cdf.png)", ""]
    if failed:
        lines += ["## Failed", ""] + [f"- {f}" for f in failed] + [""]
    path = os.path.join(out_dir, "REPORT.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path


def main(argv: list[str] | None = None) -> int:
    from batchserve.core.policies import POLICIES

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", default="bench_out")
    p.add_argument("--quick", action="store_true", help="a tiny smoke run")
    p.add_argument("--policies", default=None, help=f"comma-separated (default: all of {sorted(POLICIES)})")
    p.add_argument("--workloads", default=None, help="comma-separated subset of the standard workloads")
    p.add_argument("--server-args", default="", help='extra `batchserve serve` flags, e.g. "--kv-cache-gb 0.5"')
    p.add_argument("--max-duration", type=float, default=None, help="cut each rate's run off after this (s)")
    p.add_argument("--progress", action="store_true")
    a = p.parse_args(argv)
    policies = a.policies.split(",") if a.policies else list(POLICIES)
    standards = QUICK if a.quick else STANDARD
    if a.workloads:
        standards = tuple(s for s in standards if s.workload in a.workloads.split(","))
    server_args = a.server_args.split()
    if a.quick and "--kv-cache-gb" not in server_args:
        server_args += ["--kv-cache-gb", "0.25"]
    path = run_standard(a.out_dir, policies, standards, server_args, a.progress,
                        a.max_duration if a.max_duration is not None else (60.0 if a.quick else None))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
