"""The load generator against a local server that misbehaves on purpose: it must count 503s
(with Retry-After), 500s, in-stream errors, dropped connections and slow tokens correctly,
send open-loop, and poll /metrics. Loopback only; every run is bounded in count and time."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from batchserve.bench.client import ClientConfig, parse_metrics, run
from batchserve.bench.metrics import summarize
from batchserve.bench.workload import WorkItem

pytestmark = pytest.mark.http

METRICS = """# HELP batchserve:num_requests_waiting Queued requests.
# TYPE batchserve:num_requests_waiting gauge
batchserve:num_requests_waiting 3.0
# TYPE batchserve:batch_size gauge
batchserve:batch_size 2.0
# TYPE batchserve:kv_cache_usage gauge
batchserve:kv_cache_usage 0.25
# TYPE batchserve:queue_depth gauge
batchserve:queue_depth{level="high"} 1.0
# TYPE batchserve:e2e_seconds histogram
batchserve:e2e_seconds_bucket{le="1.0"} 4.0
batchserve:e2e_seconds_bucket{le="+Inf"} 5.0
batchserve:e2e_seconds_count 5.0
batchserve:e2e_seconds_sum 2.5
# TYPE other_metric gauge
other_metric 7.0
"""


class MisbehavingServer:
    """A tiny HTTP/1.1 server on 127.0.0.1; the prompt text says how to answer."""

    def __init__(self) -> None:
        self.port = 0
        self.arrivals: list[tuple[float, str]] = []
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "MisbehavingServer":
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()
        server.close()
        pending = asyncio.all_tasks(self._loop)  # open handlers: end them inside the loop
        for t in pending:
            t.cancel()
        self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self._loop.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                method, path, _ = lines[0].split(" ")
                hdr = {k.lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
                body = await reader.readexactly(int(hdr.get("content-length", 0)))
                if not await self._answer(method, path, body, writer):
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    @staticmethod
    def _plain(writer: asyncio.StreamWriter, status: str, body: bytes, extra: str = "") -> None:
        writer.write(f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                     f"{extra}\r\n".encode() + body)

    async def _answer(self, method: str, path: str, body: bytes, writer: asyncio.StreamWriter) -> bool:
        """Write one response; False when the connection must close."""
        if path == "/metrics":
            self._plain(writer, "200 OK", METRICS.encode())
            return True
        if path == "/v1/models":
            self._plain(writer, "200 OK", json.dumps({"data": [{"id": "fake-model"}]}).encode())
            return True
        req = json.loads(body)
        kind = req["prompt"]
        self.arrivals.append((time.monotonic(), kind))
        assert req["model"] == "fake-model" and req["stream"] is True and req["priority"] in (1, 9)
        if kind == "503":
            self._plain(writer, "503 Service Unavailable", b'{"error": {"message": "queue full"}}',
                        "Retry-After: 2\r\n")
            return True
        if kind == "500":
            self._plain(writer, "500 Internal Server Error", b'{"error": {"message": "boom"}}')
            return True
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        if kind == "hang":  # headers, then silence
            await writer.drain()
            await asyncio.sleep(30)
            return False

        async def event(obj: object) -> None:
            data = b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
            writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            await writer.drain()

        n = req["max_tokens"]
        for i in range(n):
            if kind == "drop" and i == 2:
                writer.transport.abort()  # mid-stream: no [DONE], no final chunk
                return False
            await asyncio.sleep(0.3 if kind == "slow" else 0.01)
            await event({"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]})
        if kind == "err504":
            await event({"error": {"message": "hard deadline missed"}, "status_code": 504})
        else:
            await event({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
            await event({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": n}})
        await event(b"[DONE]")
        writer.write(b"0\r\n\r\n")
        return True


def _item(t: float, kind: str, n: int = 4, **kw) -> WorkItem:
    return WorkItem(t, 3, kind, None, n, kw.pop("priority", 1), cls=kind, **kw)


def test_counts_failures_of_every_kind():
    kinds = ["ok", "503", "drop", "500", "slow", "err504", "ok", "503", "drop", "ok"]
    items = [_item(0.05 * i, k, priority=9 if k == "ok" else 1) for i, k in enumerate(kinds)]
    with MisbehavingServer() as srv:
        res = run(items, ClientConfig(f"http://127.0.0.1:{srv.port}", progress=False,
                                      metrics_interval_s=0.1, max_duration_s=30))
    recs = {k: [r for r in res.records if r.cls == k] for k in set(kinds)}
    assert res.model == "fake-model" and len(res.records) == len(items)
    for r in recs["ok"]:
        assert r.ok and r.status == 200 and r.finish_reason == "length" and r.error is None
        assert r.output_tokens == 4 and r.prompt_tokens == 7 and len(r.token_times) == 4
        assert r.send_time < r.first_token_time <= r.token_times[-1] <= r.end_time
    for r in recs["503"]:
        assert (r.status, r.retry_after_s, r.error) == (503, 2.0, "queue full") and not r.ok
    for r in recs["drop"]:
        assert r.disconnected and r.status == 200 and not r.ok and len(r.token_times) == 2
    (e500,) = recs["500"]
    assert e500.status == 500 and e500.error == "boom" and not e500.disconnected
    (slow,) = recs["slow"]
    assert slow.ok and slow.tpot == pytest.approx(0.3, abs=0.1)
    assert all(g > 0.2 for g in slow.itls())
    (e504,) = recs["err504"]
    assert e504.status == 504 and "deadline" in e504.error and len(e504.token_times) == 4
    s = summarize(res.records, res.duration_s)
    assert (s["n_ok"], s["n_rejected"], s["n_503"], s["n_disconnects"], s["n_errors"], s["n_504"]) == \
           (4, 2, 2, 2, 1, 1)
    assert s["per_class"]["ok"]["priority"] == [9]
    # /metrics was polled: batchserve gauges kept (labels too), histograms' buckets and others dropped
    assert res.timeline and res.timeline[0]["values"]["batchserve:num_requests_waiting"] == 3.0
    assert 'batchserve:queue_depth{level=high}' in res.timeline[0]["values"]
    assert not any("bucket" in k or "other" in k for k in res.timeline[0]["values"])


def test_open_loop_sends_on_schedule_while_earlier_requests_are_slow():
    # two slow streams (~1.2 s each) must not delay requests due at 0.2 s .. 0.6 s
    items = [_item(0.0, "slow"), _item(0.0, "slow")] + [_item(0.2 + 0.1 * i, "ok") for i in range(5)]
    with MisbehavingServer() as srv:
        res = run(items, ClientConfig(f"http://127.0.0.1:{srv.port}", progress=False, max_duration_s=30))
        arrivals = sorted(t for t, _ in srv.arrivals)
    for w, r in zip(items, res.records):
        assert r.send_time == pytest.approx(w.arrival, abs=0.1)
    assert all(r.ok for r in res.records)
    assert arrivals[-1] - arrivals[0] == pytest.approx(0.6, abs=0.15)


def test_run_time_limit_cuts_off_and_unreachable_server():
    items = [_item(0.0, "slow", n=20), _item(5.0, "ok")]
    with MisbehavingServer() as srv:
        t = time.monotonic()
        res = run(items, ClientConfig(f"http://127.0.0.1:{srv.port}", progress=False, max_duration_s=1.0))
        assert time.monotonic() - t < 5
    slow, never = res.records
    assert "cut off" in slow.error and 1 <= len(slow.token_times) < 20 and not slow.ok
    assert "not sent" in never.error
    # nothing listens on this port (a closed server's): connection refused is an error, not a disconnect
    res = run([_item(0.0, "ok")], ClientConfig(f"http://127.0.0.1:{srv.port}", model="m", progress=False,
                                               max_duration_s=10))
    (r,) = res.records
    assert r.status == 0 and "connect" in r.error and not r.disconnected
    assert summarize(res.records, 1.0)["n_errors"] == 1


def test_a_silent_stream_times_out():
    with MisbehavingServer() as srv:
        t = time.monotonic()
        res = run([_item(0.0, "hang"), _item(0.0, "ok")],
                  ClientConfig(f"http://127.0.0.1:{srv.port}", progress=False, request_timeout_s=0.5,
                               metrics_interval_s=0.1, max_duration_s=20))
        assert time.monotonic() - t < 10
    hang, ok = res.records
    assert hang.status == 200 and "timeout" in hang.error and not hang.disconnected and not hang.ok
    assert hang.end_time - hang.send_time == pytest.approx(0.5, abs=0.3)
    assert ok.ok


def test_parse_metrics_tolerates_other_servers():
    assert parse_metrics("") == {}
    vals = parse_metrics("# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name=\"x\"} 4\n"
                         "# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 1.0\n")
    assert vals == {"vllm:num_requests_waiting{model_name=x}": 4.0}


def test_vs_llamacpp_refuses_a_missing_server_binary_by_name(tmp_path, capsys):
    import pytest

    from benchmarks import vs_llamacpp

    not_exec = tmp_path / "llama-server"
    not_exec.write_text("")  # exists, not executable
    for path in ("/nonexistent/llama-server", str(not_exec)):
        with pytest.raises(SystemExit) as e:
            vs_llamacpp.main(["--llama-server", path, "--", "-fa", "off"])
        assert e.value.code == 2
        assert f"--llama-server: {path!r} is not an executable file" in capsys.readouterr().err
