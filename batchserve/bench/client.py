"""Open-loop load generator for any OpenAI-compatible server (batchserve or a peer).

Each WorkItem is sent at its arrival time whether or not earlier requests have finished
(closed-loop clients hide overload: they slow down exactly when the server does). Requests
stream (`/v1/completions`, SSE); every token-carrying chunk's arrival time is recorded.
While the load runs, the server's Prometheus `/metrics` is polled for the timeline plots.

Failures are recorded, never raised: a non-200 status (with Retry-After on 503), an SSE error
event (its `status_code` becomes the record's status: a stream cannot change its HTTP
status once it has started), a connection dropped before `[DONE]` (disconnected), a refused
connection or a timeout (error).

The client runs on aiohttp, on uvloop where it is installed: in our benchmarks it shares the
server's machine, and streaming 6,243 tokens to 64 clients cost it 0.22-0.34 s of CPU against
0.72-0.87 s on httpx (BENCHMARKS.md, HTTP vs offline), CPU taken from the model's cores.
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from batchserve.bench.metrics import RequestRecord
from batchserve.bench.workload import WorkItem

# Gauges worth a timeline, from batchserve and, where it has them, vLLM.
_PREFIXES = ("batchserve:", "vllm:num_requests", "vllm:gpu_cache_usage", "vllm:kv_cache_usage")


@dataclass
class ClientConfig:
    """Where and how to send. `extensions` sends batchserve's priority / deadline fields
    (turn off for servers that reject unknown fields). `max_duration_s` bounds the whole run
    (None: last arrival + `request_timeout_s`); requests still open then are cut off."""

    url: str
    model: str | None = None
    temperature: float = 0.0
    ignore_eos: bool = True
    extensions: bool = True
    request_timeout_s: float = 300.0
    max_duration_s: float | None = None
    metrics_interval_s: float = 0.5
    progress: bool = True


@dataclass
class RunResult:
    """Records in workload order, the run's span, and the polled metrics timeline
    (a list of {"t": seconds from start, "values": {sample: value}})."""

    records: list[RequestRecord]
    duration_s: float
    timeline: list[dict[str, Any]] = field(default_factory=list)
    model: str = ""


def _body(item: WorkItem, cfg: ClientConfig, model: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model, "prompt": item.prompt if item.prompt is not None else item.prompt_token_ids,
        "max_tokens": item.max_tokens, "temperature": cfg.temperature, "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.ignore_eos:  # outputs of the asked length, so the load is the one the workload says
        body["ignore_eos"] = True
    if item.user is not None:  # OpenAI's own field: every server takes it
        body["user"] = item.user
    if cfg.extensions:
        body["priority"] = item.priority
        if item.deadline_ms is not None:
            body["deadline_ms"] = item.deadline_ms
            if item.deadline_kind is not None:
                body["deadline_kind"] = item.deadline_kind
    return body


def _error_message(raw: bytes) -> str:
    try:
        err = json.loads(raw).get("error")
        return str(err.get("message", err)) if isinstance(err, dict) else str(err)
    except (ValueError, AttributeError):
        return raw[:200].decode(errors="replace") or "(empty body)"


def _retry_after(resp: aiohttp.ClientResponse) -> float | None:
    try:
        return float(resp.headers["Retry-After"])
    except (KeyError, ValueError):  # absent, or an HTTP date
        return None


async def send_one(session: aiohttp.ClientSession, item: WorkItem, cfg: ClientConfig, model: str,
                   rec: RequestRecord, now: Any) -> None:
    """Send one request and fill `rec` in place as chunks arrive (so a cut-off run keeps
    what was received)."""
    done = False
    chunks = 0
    rec.send_time = now()
    try:
        async with session.post(cfg.url.rstrip("/") + "/v1/completions", json=_body(item, cfg, model)) as resp:
            rec.status = resp.status
            if resp.status != 200:
                rec.error = _error_message(await resp.read())
                rec.retry_after_s = _retry_after(resp)
                return
            async for line in resp.content:  # one SSE line at a time (bytes, with its newline)
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                if "error" in obj:  # in-stream failure: the status it stands for, if given
                    rec.error = _error_message(data)
                    rec.status = int(obj.get("status_code", rec.status))
                    continue
                for ch in obj.get("choices") or []:
                    text = ch.get("text") or (ch.get("delta") or {}).get("content")
                    if text:
                        t = now()
                        rec.token_times.append(t)
                        if rec.first_token_time is None:
                            rec.first_token_time = t
                        chunks += 1
                    if ch.get("finish_reason"):
                        rec.finish_reason = ch.get("batchserve_finish_reason") or ch["finish_reason"]
                usage = obj.get("usage")
                if usage:
                    rec.output_tokens = int(usage.get("completion_tokens", 0))
                    rec.prompt_tokens = int(usage.get("prompt_tokens", rec.prompt_tokens))
            if not done:
                rec.disconnected = True
                rec.error = rec.error or "stream ended before [DONE]"
    except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
        rec.error = f"connect failed: {type(e).__name__}: {e}"
    except TimeoutError as e:  # no bytes for request_timeout_s (aiohttp's read timeouts are TimeoutErrors)
        rec.error = f"timeout: {type(e).__name__}"
    except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as e:
        rec.disconnected = True  # the connection broke after it was made (reset, closed, cut short)
        rec.error = f"disconnected: {type(e).__name__}: {e}"
    except (ValueError, KeyError, aiohttp.ClientError) as e:
        rec.error = f"bad response: {e}"
    except asyncio.CancelledError:
        rec.error = "cut off: the run's time limit"
        raise
    finally:
        rec.end_time = now()
        if rec.output_tokens == 0:
            rec.output_tokens = chunks  # no usage chunk: one token a chunk


async def discover_model(session: aiohttp.ClientSession, url: str) -> str:
    """The first model id the server lists at /v1/models, or "default"."""
    try:
        async with session.get(url.rstrip("/") + "/v1/models", timeout=aiohttp.ClientTimeout(total=10.0)) as r:
            return str((await r.json(content_type=None))["data"][0]["id"])
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, IndexError, TypeError):
        return "default"


def parse_metrics(text: str) -> dict[str, float]:
    """Gauge-like samples of interest from Prometheus text: name{labels} -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not s.name.startswith(_PREFIXES) or s.name.endswith(("_bucket", "_created")):
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = float(s.value)
    return out


async def poll_metrics(session: aiohttp.ClientSession, url: str, interval: float, now: Any,
                       timeline: list[dict[str, Any]], stop: asyncio.Event) -> None:
    """Append a timeline point every `interval` s until `stop`; quits quietly on servers
    without a (parsable) /metrics."""
    while not stop.is_set():
        try:
            async with session.get(url.rstrip("/") + "/metrics", timeout=aiohttp.ClientTimeout(total=5.0)) as r:
                if r.status == 404:
                    return
                if r.status == 200:
                    timeline.append({"t": now(), "values": parse_metrics(await r.text())})
        except (aiohttp.ClientError, TimeoutError, ValueError):
            pass
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except asyncio.TimeoutError:
            pass


class Progress:
    """One line on stderr: sent / finished / failures and elapsed time."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled = total, enabled
        self.tty = sys.stderr.isatty()
        self._last = 0.0

    def show(self, records: list[RequestRecord], sent: int, elapsed: float, final: bool = False) -> None:
        if not self.enabled or (not final and elapsed - self._last < (0.2 if self.tty else 5.0)):
            return
        self._last = elapsed
        ended = [r for r in records[:sent] if r.end_time is not None]
        ok = sum(r.ok for r in ended)
        width = 30
        bar = "#" * int(width * len(ended) / max(1, self.total))
        line = (f"[{bar:<{width}}] {len(ended)}/{self.total} done, {sent} sent, ok {ok}, "
                f"503 {sum(r.status == 503 for r in ended)}, failed {len(ended) - ok}, {elapsed:.1f}s")
        sys.stderr.write(("\r" + line + ("\n" if final else "")) if self.tty else line + "\n")
        sys.stderr.flush()


async def run_load(items: list[WorkItem], cfg: ClientConfig) -> RunResult:
    """Send `items` open-loop against cfg.url; return one record per item, in order."""
    t0 = time.perf_counter()

    def now() -> float:
        return time.perf_counter() - t0

    # no client-side queue (limit=0: a connection per request in flight); a stream that sends
    # nothing for request_timeout_s is a timeout
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, connect=10.0, sock_read=cfg.request_timeout_s)
    records = [RequestRecord(f"b{i}", w.cls, w.priority, prompt_tokens=w.prompt_len, deadline_ms=w.deadline_ms,
                             deadline_kind=w.deadline_kind) for i, w in enumerate(items)]
    last = max((w.arrival for w in items), default=0.0)
    limit = cfg.max_duration_s if cfg.max_duration_s is not None else last + cfg.request_timeout_s
    timeline: list[dict[str, Any]] = []
    progress = Progress(len(items), cfg.progress)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, read_bufsize=1 << 20) as client:
        model = cfg.model or await discover_model(client, cfg.url)
        t0 = time.perf_counter()  # the run starts after discovery
        stop = asyncio.Event()
        poller = asyncio.create_task(poll_metrics(client, cfg.url, cfg.metrics_interval_s, now, timeline, stop))
        tasks: list[asyncio.Task] = []

        async def dispatch() -> None:
            for w, rec in zip(items, records):
                while (wait := w.arrival - now()) > 0:
                    await asyncio.sleep(min(wait, 0.2))
                    progress.show(records, len(tasks), now())
                tasks.append(asyncio.create_task(send_one(client, w, cfg, model, rec, now)))

        async def watch() -> None:
            await dispatcher
            while any(not t.done() for t in tasks):
                progress.show(records, len(tasks), now())
                await asyncio.sleep(0.1)

        dispatcher = asyncio.create_task(dispatch())
        try:
            await asyncio.wait_for(watch(), timeout=max(0.0, limit))
        except asyncio.TimeoutError:
            for t in [dispatcher, *tasks]:
                t.cancel()
            await asyncio.gather(dispatcher, *tasks, return_exceptions=True)
            for r in records[len(tasks):]:  # never sent: count them, as failures
                r.error, r.send_time, r.end_time = f"not sent: the run's {limit:.0f} s limit", now(), now()
        stop.set()
        await poller
        progress.show(records, len(tasks), now(), final=True)
    end = max((r.end_time for r in records if r.end_time is not None), default=0.0)
    return RunResult(records, max(end, 1e-6), timeline, model)


def run(items: list[WorkItem], cfg: ClientConfig) -> RunResult:
    """Blocking wrapper around run_load, on uvloop where it is installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(run_load(items, cfg))
    return uvloop.run(run_load(items, cfg))
