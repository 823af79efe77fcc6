"""Server operations over real HTTP: overload (503 + Retry-After, nothing leaked), the config
file merged with flags, and `batchserve serve` as a real process: /health while loading, API
key, body limit, and a graceful SIGTERM."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import MODEL, build_engine, free_socket, start_server, wait_idle

from batchserve.cli import build_parser, engine_config
from batchserve.config import ConfigError
from batchserve.server.config import load_configs


def _metric_values(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


@pytest.mark.model
@pytest.mark.http
def test_overload_refuses_with_503_and_leaks_nothing() -> None:
    cfg = engine_config(build_parser().parse_args(
        ["serve", "--queue-capacity", "8", "--max-num-seqs", "4", "--kv-cache-gb", "0.1"]))
    engine = build_engine(cfg)
    srv = start_server(engine)
    body = {"model": MODEL, "prompt": "Tell me a joke.", "max_tokens": 4, "ignore_eos": True, "temperature": 0}

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=srv.url, timeout=120,
                                     limits=httpx.Limits(max_connections=100)) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(100)))

    try:
        resps = asyncio.run(burst())
        ok = [r for r in resps if r.status_code == 200]
        refused = [r for r in resps if r.status_code == 503]
        assert len(ok) + len(refused) == 100, sorted({r.status_code for r in resps})
        assert refused and len(ok) >= 8  # at least a full queue got in
        for r in refused:
            assert int(r.headers["Retry-After"]) >= 1
            assert r.json()["error"]["code"] in ("queue_full", "dropped")
        for r in ok:
            assert r.json()["choices"][0]["finish_reason"] == "length"
            assert r.json()["usage"]["completion_tokens"] == 4
        wait_idle(engine)
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
        m = _metric_values(httpx.get(srv.url + "/metrics").text)
        rejected = sum(v for (name, _), v in m.items() if name == "batchserve:requests_rejected_total")
        assert rejected == len(refused)
        assert m[("batchserve:requests_total", (("finish_reason", "length"),))] == len(ok)
        assert m[("batchserve:http_errors_total", (("status", "503"),))] == len(refused)
        assert m[("batchserve:requests_waiting", (("level", "default"),))] == 0
    finally:
        srv.stop()


CONFIG = """
cache: {kv_cache_gb: 0.5}
scheduler: {policy: continuous, max_num_seqs: 32}
queue:
  levels:
    - {name: high, priorities: "6-10", capacity: 100}
    - {name: low, priorities: "0-5", capacity: 1000, overflow: drop_oldest}
server: {api_key: k, port: 8080, grace_period_s: 7}
"""


def test_config_file_maps_onto_dataclasses_and_flags_win(tmp_path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text(CONFIG)
    a = build_parser().parse_args(["serve", "--config", str(path), "--max-num-seqs", "12", "--port", "9000"])
    engine, server = load_configs(a)
    assert engine.cache.kv_cache_gb == 0.5  # from the file
    assert engine.scheduler.max_num_seqs == 12  # the flag wins
    assert [lv.name for lv in engine.queue.levels] == ["high", "low"]
    assert engine.queue.levels[1].overflow == "drop_oldest"
    assert (server.api_key, server.port, server.grace_period_s) == ("k", 9000, 7)
    for bad, field in (("cache: {kv_cache_gbs: 1}", "kv_cache_gbs"), ("servers: {}", "servers"),
                       ("server: {port: -1}", "server.port")):
        path.write_text(bad)
        with pytest.raises(ConfigError, match=field):
            load_configs(build_parser().parse_args(["serve", "--config", str(path)]))


def _stream_in_thread(url: str, headers: dict, body: dict, first: threading.Event, lines: list[str]) -> threading.Thread:
    def run() -> None:
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers, timeout=120) as r:
            lines.append(f"status {r.status_code}")
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
                    first.set()
        first.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.model
@pytest.mark.http
def test_serve_process_health_auth_limits_and_graceful_sigterm(tmp_path) -> None:
    (tmp_path / "serve.yaml").write_text(
        "cache: {kv_cache_gb: 0.1}\nserver: {api_key: sekrit, served_model_name: tiny, grace_period_s: 120}\n")
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "batchserve", "serve", "--config", str(tmp_path / "serve.yaml"),
                                 "--port", str(port), "--max-body-bytes", "4096"],
                                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url, auth = f"http://127.0.0.1:{port}", {"Authorization": "Bearer sekrit"}
    try:
        seen = []
        end = time.monotonic() + 180
        while time.monotonic() < end and 200 not in seen:
            try:
                seen.append(httpx.get(url + "/health", timeout=5).status_code)
            except httpx.TransportError:
                assert proc.poll() is None, log_path.read_text()
                time.sleep(0.1)
        assert seen[0] == 503 and seen[-1] == 200, seen  # not ready while the model loads

        r = httpx.get(url + "/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(url + "/v1/models", headers=auth).json()["data"][0]["id"] == "tiny"
        big = {"model": "tiny", "prompt": "x" * 5000}
        assert httpx.post(url + "/v1/completions", json=big, headers=auth).status_code == 413

        # long enough to be still running after the signal and the checks below (~3.5-5 ms a token here)
        body = {"model": "tiny", "prompt": "Count to a hundred:", "max_tokens": 1024, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}, "user": "alice"}
        first, lines = threading.Event(), []
        t = _stream_in_thread(url, auth, body, first, lines)
        assert first.wait(60)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "Hi"}, headers=auth)
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        assert int(r.headers["Retry-After"]) >= 1
        assert httpx.get(url + "/health").status_code == 503
        t.join(150)
        assert lines[0] == "status 200" and lines[-1] == "[DONE]", lines[-3:]
        assert '"completion_tokens":1024' in lines[-2]  # the in-flight request finished in full
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = log_path.read_text()
    assert "draining" in out
    assert "completion_tokens=1024" in out and "finish=length" in out  # the per-request log line
    assert "level=default priority=5 tenant='alice' prompt_tokens=" in out
