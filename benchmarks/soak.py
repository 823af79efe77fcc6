"""The soak: a server held at a multiple of its capacity for minutes, behind a small queue cap.
Does every request end in an answer or an explicit refusal, are KV blocks all returned, and
does resident memory stay flat?

    python -m benchmarks.soak --minutes 10 --overload 3 --out BENCHMARKS.md
    python -m benchmarks.soak --minutes 1 --rate 6              # a short look at a given rate

One `batchserve serve --queue-capacity 8` (plus `--server-args`) on 127.0.0.1, driven by the
project's open-loop client (streaming `/v1/completions`, random-token prompts of about 48 tokens,
answers of 32 to 128, `ignore_eos`). In one run:
1. capacity, unless `--rate`: as many closed-loop clients as the batch and the queue hold, each
   sending the next request when its last one is answered (or shortly after a 503), for
   `--calibrate-s`; capacity = answers per second over its last two thirds. (A burst of that
   size, as the other benchmarks use, is mostly refused by the queue cap: the engine takes
   waiting requests only between steps);
2. the soak: Poisson arrivals at `--overload` times capacity for `--minutes`. Every request sent
   is counted once: answered (a complete stream), refused (503; the count without a Retry-After
   header is reported beside it), failed (any other explicit error: an HTTP status, an error
   event in the stream) or lost (none of these: a stream cut short, a client-side timeout, a
   connection the server never accepted);
3. drained: /metrics polled until nothing runs or waits and no KV block is in use, for up to
   DRAIN_S (ten seconds); the blocks still in use then are the leak;
4. the disconnect storm: `--storm` streams started together (a refused one tries again after its
   Retry-After); once each has its first token the client closes them all, and /metrics is
   polled until the KV blocks in use are back to zero.
Resident memory (the server's process tree, /proc) is sampled every `--rss-every` seconds from
the start of the soak; memory is flat when the last sample is within FLAT_PCT (5 %) of the one
taken after the warm-up (WARM_S, two minutes, or a fifth of a shorter run).
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shlex
import sys
import time
from typing import Any

import aiohttp
import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from batchserve.bench.client import ClientConfig, discover_model, run
from batchserve.bench.metrics import RequestRecord
from batchserve.bench.workload import WorkItem, build_prompt, lognormal_lengths
from benchmarks.priority_flood import poisson
from benchmarks.report_md import publish
from benchmarks.servers import RssSampler, start_batchserve, started, tree_rss_bytes

TITLE = "## Soak: three times capacity behind a queue of eight, and a disconnect storm"
QUEUE_CAP = 8
FLAT_PCT = 5.0  # the largest change of resident memory after the warm-up still called flat
WARM_S = 120.0  # memory is judged from here on (or from a fifth of a shorter run)
DRAIN_S = 10.0  # how long a drained server has to show no work and no KV block in use
OUTCOMES = ("answered", "refused", "failed", "lost")


def work(arrivals: np.ndarray, rng: np.random.Generator, prompt_mean: float = 48,
         out_lo: int = 32, out_hi: int = 128) -> list[WorkItem]:
    """Requests at these times: random-token prompts (lognormal, CV 0.5, at least 8 tokens) and
    answers uniform in [out_lo, out_hi]."""
    n = len(arrivals)
    plen = np.maximum(8, lognormal_lengths(rng, prompt_mean, 0.5, n))
    olen = rng.integers(out_lo, out_hi + 1, size=n)
    return [WorkItem(float(t), int(p), None, build_prompt(int(p), rng)[1], int(o), cls="soak")
            for t, p, o in zip(arrivals, plen, olen)]


def outcome(rec: RequestRecord) -> str:
    """Which of OUTCOMES a sent request came to. Failed needs an answer from the server that
    says so; anything the client had to conclude on its own (a broken or silent stream, no
    connection) is lost."""
    if rec.ok:
        return "answered"
    transport = rec.disconnected or (rec.error or "").startswith(
        ("timeout", "connect failed", "cut off", "not sent", "bad response"))
    if not rec.status or transport:  # status 0: no response at all
        return "lost"
    return "refused" if rec.status == 503 else "failed"


def tally(records: list[RequestRecord]) -> dict[str, Any]:
    """Counts per outcome, refusals without a Retry-After, and a few lost and failed examples."""
    out: dict[str, Any] = {"sent": len(records), **{k: 0 for k in OUTCOMES}}
    examples: dict[str, list[str]] = {"failed": [], "lost": []}
    for r in records:
        kind = outcome(r)
        out[kind] += 1
        if kind in examples and len(examples[kind]) < 3:
            examples[kind].append(f"{r.status}: {r.error}")
    out["refused_without_retry_after"] = sum(outcome(r) == "refused" and r.retry_after_s is None for r in records)
    out["examples"] = {k: v for k, v in examples.items() if v}
    return out


def scrape(url: str) -> dict[str, float]:
    """Every sample of the server's /metrics, labels folded into the name and summed over
    `level` (the queue's levels) and `model_name`."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("level", "model_name"))
            key = f"{s.name}{{{labels}}}" if labels else s.name
            out[key] = out.get(key, 0.0) + s.value
    return out


def in_use(m: dict[str, float]) -> int:
    """KV blocks held by requests (prefix caching is off here: a free block is not cached)."""
    return int(m["batchserve:kv_cache_blocks"] - m["batchserve:kv_cache_free_blocks"])


def busy(m: dict[str, float]) -> bool:
    return bool(in_use(m) or m.get("batchserve:requests_running", 0) or m.get("batchserve:requests_waiting", 0))


def drain(url: str, timeout_s: float = DRAIN_S, poll_s: float = 0.02) -> tuple[dict[str, float], float]:
    """Poll /metrics until the server is idle (nothing running or waiting, no block in use) or
    `timeout_s` passes; returns the last scrape and the seconds it took."""
    t0 = time.monotonic()
    while True:
        m = scrape(url)
        if not busy(m) or time.monotonic() - t0 > timeout_s:
            return m, time.monotonic() - t0
        time.sleep(poll_s)


def flatness(samples: list[tuple[float, int]], seconds: float) -> dict[str, Any]:
    """The last sample against the first one after the warm-up (WARM_S, or a fifth of a shorter
    run): the change in percent, and whether it is within FLAT_PCT."""
    warm = min(WARM_S, seconds / 5)
    base = next(((t, b) for t, b in samples if t >= warm), samples[-1])
    end = samples[-1]
    change = 100.0 * (end[1] - base[1]) / base[1]
    return {"warm_s": base[0], "warm_mib": base[1] / 2**20, "end_s": end[0], "end_mib": end[1] / 2**20,
            "change_pct": change, "flat": abs(change) <= FLAT_PCT}


def send(url: str, items: list[WorkItem], timeout_s: float, progress: bool = False,
         metrics_every_s: float = 10.0):
    cfg = ClientConfig(url, extensions=False, request_timeout_s=timeout_s, progress=progress,
                       metrics_interval_s=metrics_every_s)
    return run(items, cfg)


async def _saturate(url: str, workers: int, seconds: float, rng: np.random.Generator) -> tuple[list[float], float]:
    """`workers` clients sending back to back (after a 503, again once its Retry-After or a
    quarter second has passed, whichever is sooner) for `seconds`, and longer while the first
    answer came later than a third of the way (an answer takes long at a full batch), at most
    ten times `seconds`; the times answers came, and how long it ran."""
    ends: list[float] = []
    timeout = aiohttp.ClientTimeout(total=None, connect=10.0, sock_read=300.0)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as s:
        model = await discover_model(s, url)
        t0 = time.monotonic()

        async def worker() -> None:
            while not stop.is_set():
                w = work(np.zeros(1), rng)[0]
                body = {"model": model, "prompt": w.prompt_token_ids, "max_tokens": w.max_tokens,
                        "ignore_eos": True, "temperature": 0.0, "stream": True}  # streamed, as the soak
                async with s.post(url + "/v1/completions", json=body) as resp:
                    async for _ in resp.content:
                        pass
                    if resp.status == 200:
                        ends.append(time.monotonic() - t0)
                    else:
                        await asyncio.sleep(min(0.25, float(resp.headers.get("Retry-After", 1))))

        stop = asyncio.Event()
        tasks = [asyncio.create_task(worker()) for _ in range(workers)]
        while (ran := time.monotonic() - t0) < 10 * seconds and (ran < seconds or not ends or ends[0] > ran / 3):
            await asyncio.sleep(0.5)
        stop.set()
        for t in tasks:  # those still waiting are cut off: the drain afterwards waits for the aborts
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return ends, ran


def measure_capacity(url: str, workers: int, seconds: float, rng: np.random.Generator) -> float:
    """Answers per second of a saturated server: `workers` closed-loop clients, counted over the
    last two thirds of the run (the first third fills the batch). Not a burst: one bigger than
    the queue cap is mostly refused, and measures a small batch."""
    ends, ran = asyncio.run(_saturate(url, workers, seconds, rng))
    counted = [t for t in ends if t >= ran / 3]
    drain(url)
    if not counted:
        raise RuntimeError(f"capacity: nothing answered in {ran:.0f} s")
    return len(counted) / (2 * ran / 3)


async def _storm(url: str, n: int, max_tokens: int, first_s: float) -> dict[str, Any]:
    """Start `n` streams, wait up to `first_s` until each has a token (a refused one asks again
    after its Retry-After), close them all at once, then poll until no KV block is in use."""
    timeout = aiohttp.ClientTimeout(total=None, connect=10.0, sock_read=60.0)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as s:
        model = await discover_model(s, url)
        rng = np.random.default_rng(7)

        async def first_token(i: int) -> tuple[aiohttp.ClientResponse, int]:
            """A stream that has sent a token, and how often it was refused before (the queue
            cap refuses most of a storm that arrives at once)."""
            body = {"model": model, "prompt": build_prompt(48, rng)[1], "max_tokens": max_tokens,
                    "ignore_eos": True, "temperature": 0.0, "stream": True}
            refused = 0
            while True:
                resp = await s.post(url + "/v1/completions", json=body)
                if resp.status == 200:
                    break
                await resp.read()
                if resp.status != 503:
                    raise RuntimeError(f"storm: HTTP {resp.status}")
                refused += 1
                await asyncio.sleep(float(resp.headers.get("Retry-After", 1)))
            async for line in resp.content:
                if line.startswith(b"data: {") and any(c.get("text") for c in json.loads(line[6:])["choices"]):
                    break
            return resp, refused

        tasks = [asyncio.create_task(first_token(i)) for i in range(n)]
        done, pending = await asyncio.wait(tasks, timeout=first_s)
        for t in pending:
            t.cancel()
        started = [t.result() for t in done if not t.cancelled() and t.exception() is None]
        before = await asyncio.to_thread(scrape, url)
        for resp, _ in started:
            resp.close()  # drops the connection: the server sees the client go
        after, waited = await asyncio.to_thread(drain, url, 30.0, 0.01)
        return {"streams": n, "cut_mid_stream": len(started), "refusals_before_start": sum(k for _, k in started),
                "no_first_token": n - len(started), "blocks_in_use_at_cut": in_use(before),
                "seconds_to_zero": None if busy(after) else waited,
                "blocks_in_use_after": in_use(after)}


def storm(url: str, n: int, max_tokens: int = 512, first_s: float = 60.0) -> dict[str, Any]:
    return asyncio.run(_storm(url, n, max_tokens, first_s))


def server_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What the server counted over the soak: finished requests by reason, refusals, 503s."""
    keep = ("batchserve:requests_total", "batchserve:requests_rejected_total", "batchserve:http_errors_total")
    return {k: after[k] - before.get(k, 0.0) for k in sorted(after) if k.startswith(keep)
            and after[k] - before.get(k, 0.0)}


def kv_series(timeline: list[dict[str, Any]]) -> list[tuple[float, int, int]]:
    """(seconds, KV blocks in use, requests waiting) from the client's /metrics timeline, whose
    sample names carry their labels."""
    out = []
    for p in timeline:
        v: dict[str, float] = {}
        for key, x in p["values"].items():
            name = key.split("{", 1)[0]
            v[name] = v.get(name, 0.0) + x
        if "batchserve:kv_cache_blocks" in v:
            out.append((p["t"], in_use(v), int(v.get("batchserve:requests_waiting", 0))))
    return out


def soak(a: argparse.Namespace) -> dict[str, Any]:
    """Capacity, the soak, the drain and the storm on one server, stopped on the way out
    whatever happens."""
    rng = np.random.default_rng(a.seed)
    args = ["--queue-capacity", str(a.queue_cap), *shlex.split(a.server_args)]
    out: dict[str, Any] = {"server_args": args}
    with started(start_batchserve(extra_args=args, log_path=a.server_log), timeout_s=600.0) as srv:
        send(srv.url, work(np.zeros(4), rng), timeout_s=120.0)  # warm the server and the client path
        cap = out["capacity_rps"] = a.rate or measure_capacity(srv.url, a.seats + a.queue_cap, a.calibrate_s, rng)
        seconds = out["arrivals_s"] = 60.0 * a.minutes
        items = work(poisson(a.overload * cap, seconds, rng), rng)
        out["rate_rps"] = a.overload * cap
        drain(srv.url)
        before = scrape(srv.url)
        with RssSampler(srv.proc.pid, a.rss_every) as rss:
            res = send(srv.url, items, timeout_s=a.timeout, progress=True, metrics_every_s=a.rss_every)
            after, out["drain_s"] = drain(srv.url)
        out["soak"] = tally(res.records)
        out["soak"]["seconds"] = res.duration_s
        out["leaked_blocks"] = in_use(after)
        out["idle_after_drain"] = not busy(after)
        out["server_counted"] = server_deltas(before, after)
        out["rss"] = [(round(t, 1), round(b / 2**20, 1)) for t, b in rss.samples]
        out["memory"] = flatness(rss.samples, seconds)
        out["kv"] = kv_series(res.timeline)
        out["storm"] = storm(srv.url, a.storm)
        m, _ = drain(srv.url)
        out["leaked_blocks_after_storm"] = in_use(m)
        out["rss_after_storm_mib"] = tree_rss_bytes(srv.proc.pid) / 2**20
    return out


def every(rows: list[tuple], step_s: float) -> list[tuple]:
    """The first row, then the first row at or after each multiple of `step_s`, and the last."""
    picked, nxt = [], 0.0
    for r in rows:
        if r[0] >= nxt:
            picked.append(r)
            nxt = (r[0] // step_s + 1) * step_s
    if rows and picked[-1] is not rows[-1]:
        picked.append(rows[-1])
    return picked


def report(r: dict[str, Any], cmdline: str) -> str:
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    s, mem, st = r["soak"], r["memory"], r["storm"]
    lines = [TITLE, "", f"`python -m benchmarks.soak {cmdline}` — {datetime.date.today()}, {cpu}, "
             f"{os.cpu_count()} cores; `serve {' '.join(r['server_args'])}`; capacity {r['capacity_rps']:.2f} "
             f"requests/s, Poisson arrivals at {r['rate_rps']:.2f}/s for {r['arrivals_s']:.0f} s, the last "
             f"request ended at {s['seconds']:.0f} s.", "",
             "| sent | answered | refused (503) | refused without Retry-After | failed | lost "
             "| KV blocks leaked | memory after warm-up → end (MiB) |",
             "|---|---|---|---|---|---|---|---|",
             f"| {s['sent']} | {s['answered']} | {s['refused']} | {s['refused_without_retry_after']} | {s['failed']} "
             f"| {s['lost']} | {r['leaked_blocks']} (idle after {r['drain_s']:.2f} s: {r['idle_after_drain']}) "
             f"| {mem['warm_mib']:.0f} → {mem['end_mib']:.0f} ({mem['change_pct']:+.1f} %, "
             f"{'flat' if mem['flat'] else 'not flat'}) |", ""]
    step = 60.0 if s["seconds"] >= 180 else 10.0
    kv = r["kv"]
    lines += ["| t (s) | resident memory (MiB) | KV blocks in use | waiting |", "|---|---|---|---|"]
    for t, mib in every(r["rss"], step):
        near = min(kv, key=lambda p: abs(p[0] - t)) if kv else None
        lines.append(f"| {t:.0f} | {mib:.0f} | {near[1] if near else '—'} | {near[2] if near else '—'} |")
    lines += ["", f"Disconnect storm: {st['streams']} streams, {st['cut_mid_stream']} closed by the client after "
              f"their first token with {st['blocks_in_use_at_cut']} KV blocks in use; back to "
              f"{st['blocks_in_use_after']} in use after "
              + (f"{1000 * st['seconds_to_zero']:.0f} ms" if st["seconds_to_zero"] is not None else "more than 30 s")
              + f" ({st['refusals_before_start']} 503s on the way in, each waited out; {st['no_first_token']} "
              "without a first token in time). "
              f"KV blocks in use after the storm: {r['leaked_blocks_after_storm']}; resident memory "
              f"{r['rss_after_storm_mib']:.0f} MiB.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0, help="how long the overload runs")
    p.add_argument("--overload", type=float, default=3.0, help="arrival rate as a multiple of capacity")
    p.add_argument("--rate", type=float, default=None, help="capacity in requests/s (default: measured)")
    p.add_argument("--queue-cap", type=int, default=QUEUE_CAP, help="the server's --queue-capacity")
    p.add_argument("--seats", type=int, default=64, help="the server's --max-num-seqs (and the calibration's clients)")
    p.add_argument("--calibrate-s", type=float, default=60.0, help="seconds of the capacity measurement")
    p.add_argument("--server-args", default="", help="more `serve` flags, one shell-quoted string")
    p.add_argument("--storm", type=int, default=32, help="streams in the disconnect storm")
    p.add_argument("--rss-every", type=float, default=10.0, help="seconds between memory and KV samples")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds of silence before a request is lost")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrivals and prompts")
    p.add_argument("--server-log", default=None, help="write the server's output to this file")
    p.add_argument("--out", default=None, help="Markdown file to write the section into")
    a = p.parse_args(argv)
    if "--max-num-seqs" not in a.server_args:
        a.server_args = f"--max-num-seqs {a.seats} {a.server_args}".strip()
    return publish(report(soak(a), " ".join(argv)), a.out, TITLE)


if __name__ == "__main__":
    sys.exit(main())
