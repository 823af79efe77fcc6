"""The HTTP app against hostile or broken input, model-free (tests/fake_server.py): JSON too deep,
text that is not Unicode, unknown fields, a poison request in a shared step, a crashing route;
/metrics behind the key, the Host check, the access log. Bad input is a 400 naming the field;
no response body holds exception text (5xx bodies give a request id the log has)."""
from __future__ import annotations

import asyncio
import json
import logging

import pytest
from conftest import FakeExecutor
from fake_server import MODEL, fake_engine, serve_app

from batchserve.config import ServerConfig

BODY = {"model": MODEL, "prompt": "hello", "max_tokens": 3, "ignore_eos": True}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "ignore_eos": True}


def run(coro):
    return asyncio.run(coro)


async def post(client, body, path="/v1/completions", **kw):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return await client.post(path, content=raw, headers={"content-type": "application/json", **kw.pop("headers", {})},
                             **kw)


def assert_400(r, param) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    if param is not None:
        assert param in err["message"]
    return err


# (id, path, raw body, param): every one a 400 naming the field
CASES = [
    ("deep-array", "c", b'{"model": "fake", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),
    ("deep-object", "c", b'{"a":' * 5000 + b"1" + b"}" * 5000, None),
    ("lone-surrogate-prompt", "c", json.dumps({**BODY, "prompt": "a\ud800b"}).encode(), "prompt"),
    ("lone-surrogate-message", "chat", json.dumps({**CHAT, "messages": [{"role": "user", "content": "\udfff"}]}).encode(),
     "messages[0].content"),
    ("lone-surrogate-part", "chat", json.dumps({**CHAT, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "ok"}, {"type": "text", "text": "\ud83d"}]}]}).encode(), "messages[0].content[1].text"),
    ("lone-surrogate-stop", "c", json.dumps({**BODY, "stop": ["\ud800"]}).encode(), "stop[0]"),
    ("unknown-field", "c", json.dumps({**BODY, "max_token": 50}).encode(), "max_token"),
    ("unknown-chat-field", "chat", json.dumps({**CHAT, "prompt": "x"}).encode(), "prompt"),
    ("unknown-message-field", "chat", json.dumps({**CHAT, "messages": [{"role": "user", "content": "x", "contnet": 1}]})
     .encode(), "messages[0].contnet"),
    ("unknown-stream-option", "c", json.dumps({**BODY, "stream": True, "stream_options": {"usage": True}}).encode(),
     "stream_options.usage"),
    ("include_usage-type", "c", json.dumps({**BODY, "stream": True, "stream_options": {"include_usage": 1}}).encode(),
     "stream_options.include_usage"),
    ("top_k-2^63", "c", json.dumps({**BODY, "top_k": 2**63}).encode(), "top_k"),
    ("huge-int-temperature", "c", b'{"model": "fake", "prompt": "x", "temperature": 1' + b"0" * 400 + b"}",
     "temperature"),
    ("chat-prompt-too-long", "chat", json.dumps({**CHAT, "max_tokens": None, "messages": [
        {"role": "user", "content": "x" * 300}]}).encode(), "messages"),
    ("prompt-too-long", "c", json.dumps({**BODY, "prompt": "x" * 300}).encode(), "prompt"),
    ("prompt-plus-max_tokens", "c", json.dumps({**BODY, "prompt": "x" * 100, "max_tokens": 200}).encode(), "max_tokens"),
]


def test_bad_input_is_a_400_naming_the_field() -> None:
    async def scenario() -> None:
        async with serve_app(fake_engine(FakeExecutor(256, max_model_len=256))) as (client, _):
            for name, path, raw, param in CASES:
                r = await post(client, raw, "/v1/chat/completions" if path == "chat" else "/v1/completions")
                err = assert_400(r, param)
                assert "Traceback" not in r.text and "Error" not in err["message"], (name, err)
            r = await post(client, BODY)  # and the server still answers
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3

    run(scenario())


def test_brackets_inside_strings_are_not_nesting() -> None:
    async def scenario() -> None:
        async with serve_app(fake_engine()) as (client, _):
            r = await post(client, {**BODY, "prompt": "[{" * 200})
            assert r.status_code == 200, r.text

    run(scenario())


def test_lenient_fields_ignores_unknown_fields() -> None:
    async def scenario() -> None:
        async with serve_app(fake_engine(), ServerConfig(lenient_fields=True)) as (client, _):
            r = await post(client, {**BODY, "max_tokens": None, "max_token": 50, "logit_bias_x": 1})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16  # the default, as asked
            r = await post(client, {**CHAT, "messages": [{"role": "user", "content": "x", "extra": 1}]},
                           "/v1/chat/completions")
            assert r.status_code == 200, r.text

    run(scenario())


class PoisonExecutor(FakeExecutor):
    """Raises on every batch holding a request whose prompt starts with token 4."""

    def __init__(self) -> None:
        super().__init__(256)
        self.poisoned: set[str] = set()

    def execute(self, batch):
        self.poisoned |= {s.request_id for s in batch.seqs if s.start_pos == 0 and s.token_ids[0] == 4}
        if any(s.request_id in self.poisoned for s in batch.seqs):
            raise RuntimeError("secret internal detail")
        return super().execute(batch)


def test_a_poison_request_in_a_shared_step_fails_alone_without_exception_text(caplog) -> None:
    ex = PoisonExecutor()

    async def scenario() -> None:
        async with serve_app(fake_engine(ex)) as (client, _):
            ok = [post(client, {**BODY, "prompt": [10 + i] * 3, "max_tokens": 8}) for i in range(8)]
            bad = post(client, {**BODY, "prompt": [4, 5], "max_tokens": 8})
            *rs, r = await asyncio.gather(*ok, bad)
            assert [x.status_code for x in rs] == [200] * 8
            assert all(x.json()["usage"]["completion_tokens"] == 8 for x in rs)
            assert r.status_code == 500
            err = r.json()["error"]
            assert "secret" not in r.text and err["code"] == "model_error"
            rid = r.headers["x-request-id"]
            assert rid in err["message"]
            return rid

    with caplog.at_level(logging.INFO):
        rid = run(scenario())
    assert any(rid in rec.getMessage() and "secret internal detail" in rec.getMessage() for rec in caplog.records)


def test_a_crash_is_a_500_with_a_request_id_and_no_exception_text(caplog, monkeypatch) -> None:
    eng = fake_engine()

    def boom(spec):
        raise KeyError("secret internal detail")

    monkeypatch.setattr(eng, "prepare", boom)

    async def scenario() -> None:
        async with serve_app(eng) as (client, _):
            r = await post(client, BODY)
            assert r.status_code == 500
            assert "secret" not in r.text and "KeyError" not in r.text
            rid = r.json()["error"]["message"].split("request id ")[1].rstrip(")")
            assert r.headers["x-request-id"] == rid
            return rid

    with caplog.at_level(logging.INFO):
        rid = run(scenario())
    crash = [rec for rec in caplog.records if rid in rec.getMessage() and rec.exc_info]
    assert crash and "secret internal detail" in str(crash[0].exc_info[1])


def test_metrics_need_the_key_when_one_is_set() -> None:
    async def scenario() -> None:
        async with serve_app(fake_engine(), ServerConfig(api_key="k")) as (client, _):
            r = await client.get("/metrics")
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            r = await client.get("/metrics", headers={"Authorization": "Bearer k"})
            assert r.status_code == 200 and 'batchserve:engine_up{model_name="fake"} 1.0' in r.text
            assert (await client.get("/health")).status_code == 200  # probes need no key

    run(scenario())


@pytest.mark.parametrize("cfg,host,ok", [
    (ServerConfig(), "127.0.0.1:8000", True), (ServerConfig(), "localhost", True), (ServerConfig(), "[::1]:80", True),
    (ServerConfig(), "evil.example:8000", False), (ServerConfig(), "127.0.0.1.evil.example", False),
    (ServerConfig(host="10.1.2.3"), "localhost", False), (ServerConfig(host="10.1.2.3"), "10.1.2.3:9", True),
    (ServerConfig(host="0.0.0.0"), "anything.example", True),
    (ServerConfig(allowed_hosts="api.example, other.example"), "API.example:443", True),
    (ServerConfig(allowed_hosts="api.example"), "127.0.0.1", False), (ServerConfig(allowed_hosts="*"), "x.y", True)])
def test_the_host_header_must_name_this_server(cfg, host, ok) -> None:
    async def scenario() -> None:
        async with serve_app(fake_engine(), cfg, ready=False) as (client, _):
            r = await client.get("/v1/models", headers={"host": host})
            if ok:
                assert r.status_code == 200, r.text
            else:
                assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host"

    run(scenario())


def test_one_access_log_line_per_request(caplog) -> None:
    async def scenario() -> None:
        async with serve_app(fake_engine()) as (client, _):
            caplog.clear()
            r = await post(client, BODY)
            bad = await post(client, {**BODY, "max_token": 1})
            return r.headers["x-request-id"], bad.headers["x-request-id"]

    with caplog.at_level(logging.INFO, logger="batchserve.access"):
        ok_id, bad_id = run(scenario())
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "batchserve.access"]
    assert len(lines) == 2, lines
    assert ok_id.startswith("cmpl-") and lines[0].startswith(f"{ok_id} POST /v1/completions 200 ")
    assert lines[1].startswith(f"{bad_id} POST /v1/completions 400 ") and lines[1].endswith("ms")
