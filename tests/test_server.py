"""The OpenAI-compatible server over real HTTP, with the real model: the official openai client,
greedy parity with the offline LLM, strict input validation, metrics, client disconnects, a
failing model step, and hard/soft deadlines. One server (one engine) for the whole module."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import MODEL, build_engine, start_server, wait_idle

from batchserve.config import CacheConfig, EngineConfig
from batchserve.request import SamplingParams

pytestmark = [pytest.mark.model, pytest.mark.http]

POISON = [7, 7, 7, 7, 7, 7, 7, 13]  # a prompt starting with POISON + [k] fails at its k-th output token


class FaultyRunner:
    """The real runner, except that the step which would sample output token k of a request
    whose prompt is POISON + [k, ...] raises (to test a failing model step)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.fail_at: dict[str, int] = {}

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def execute(self, batch):
        for s in batch.seqs:
            if s.start_pos == 0 and s.token_ids[:len(POISON)] == POISON:
                self.fail_at[s.request_id] = s.token_ids[len(POISON)]
            k = self.fail_at.get(s.request_id)
            if k is not None and s.sample and s.output_index >= k:
                raise RuntimeError("injected fault")
        return self.inner.execute(batch)


@pytest.fixture(scope="module")
def server():
    engine = build_engine(EngineConfig(cache=CacheConfig(kv_cache_gb=0.25)), wrap=FaultyRunner)
    srv = start_server(engine)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(autouse=True)
def all_blocks_back(server):
    """Every test leaves the server's engine idle with every KV block free."""
    yield
    wait_idle(server.engine)
    kv = server.engine.kv
    assert kv.num_free_blocks == kv.num_blocks


def post(server, body: dict, path: str = "/v1/completions", **kw) -> httpx.Response:
    kw.setdefault("timeout", 60)
    return httpx.post(server.url + path, json=body, **kw)


def good(server) -> None:
    r = post(server, {"model": MODEL, "prompt": "Hello", "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1


def test_health_and_models(server, client) -> None:
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]


def test_completion_matches_offline(server, client, llm) -> None:
    prompt = "The capital of France is"
    offline = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0))[0]
    n_prompt = len(llm.tokenizer.encode(prompt, add_special_tokens=False))

    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert r.choices[0].text == offline.text
    assert r.choices[0].finish_reason == offline.finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, len(offline.token_ids))
    assert r.usage.total_tokens == n_prompt + len(offline.token_ids)

    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == offline.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == offline.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(offline.token_ids)
    assert chunks[-1].usage.prompt_tokens == n_prompt

    ids = client.completions.create(model=MODEL, prompt=offline.prompt_token_ids, max_tokens=12, temperature=0)
    assert ids.choices[0].text == offline.text  # a token-id prompt is the same prompt


def test_chat_matches_offline(server, client, llm) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    offline = llm.chat(messages, SamplingParams(max_tokens=24, temperature=0))[0]

    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == offline.text
    assert r.choices[0].finish_reason == offline.finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(offline.prompt_token_ids),
                                                                    len(offline.token_ids))

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=24,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == offline.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == offline.finish_reason
    assert chunks[-1].usage.total_tokens == len(offline.prompt_token_ids) + len(offline.token_ids)


def _c(**kw) -> dict:
    return {"model": MODEL, "prompt": "Hi", "max_tokens": 2, **kw}


def _chat(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **kw}


# (id, body (dict, or raw bytes), content type, path, status, param)
BAD = [
    ("max_tokens-str", _c(max_tokens="abc"), None, "c", 400, "max_tokens"),
    ("max_tokens-bool", _c(max_tokens=True), None, "c", 400, "max_tokens"),
    ("max_tokens-float", _c(max_tokens=1.5), None, "c", 400, "max_tokens"),
    ("max_tokens-zero", _c(max_tokens=0), None, "c", 400, "max_tokens"),
    ("max_tokens-over-context", _c(max_tokens=100_000), None, "c", 400, "max_tokens"),
    ("temperature-str", _c(temperature="hot"), None, "c", 400, "temperature"),
    ("temperature-range", _c(temperature=2.5), None, "c", 400, "temperature"),
    ("temperature-bool", _c(temperature=False), None, "c", 400, "temperature"),
    ("top_p-zero", _c(top_p=0), None, "c", 400, "top_p"),
    ("top_p-range", _c(top_p=1.5), None, "c", 400, "top_p"),
    ("top_k-negative", _c(top_k=-2), None, "c", 400, "top_k"),
    ("top_k-float", _c(top_k=2.5), None, "c", 400, "top_k"),
    ("seed-str", _c(seed="x"), None, "c", 400, "seed"),
    ("stop-int", _c(stop=5), None, "c", 400, "stop"),
    ("stop-empty", _c(stop=[""]), None, "c", 400, "stop"),
    ("stop-too-many", _c(stop=[str(i) for i in range(17)]), None, "c", 400, "stop"),
    ("n-str", _c(n="1"), None, "c", 400, "n"),
    ("ignore_eos-str", _c(ignore_eos="yes"), None, "c", 400, "ignore_eos"),
    ("stream-str", _c(stream="yes"), None, "c", 400, "stream"),
    ("stream_options-without-stream", _c(stream_options={"include_usage": True}), None, "c", 400, "stream_options"),
    ("priority-range", _c(priority=11), None, "c", 400, "priority"),
    ("priority-str", _c(priority="high"), None, "c", 400, "priority"),
    ("priority-bool", _c(priority=True), None, "c", 400, "priority"),
    ("deadline_ms-negative", _c(deadline_ms=-5), None, "c", 400, "deadline_ms"),
    ("deadline_ms-str", _c(deadline_ms="soon"), None, "c", 400, "deadline_ms"),
    ("deadline_kind", _c(deadline_kind="maybe"), None, "c", 400, "deadline_kind"),
    ("best_of-stream", _c(best_of=3, stream=True), None, "c", 400, "best_of"),
    ("best_of-below-n", _c(best_of=1, n=2), None, "c", 400, "best_of"),
    ("model-missing", {"prompt": "Hi"}, None, "c", 400, "model"),
    ("model-int", _c(model=5), None, "c", 400, "model"),
    ("model-unknown", _c(model="gpt-4"), None, "c", 404, "model"),
    ("prompt-missing", {"model": MODEL}, None, "c", 400, "prompt"),
    ("prompt-empty", _c(prompt=""), None, "c", 400, "prompt"),
    ("prompt-empty-list", _c(prompt=[]), None, "c", 400, "prompt"),
    ("prompt-int", _c(prompt=5), None, "c", 400, "prompt"),
    ("prompt-mixed", _c(prompt=[1, "a"]), None, "c", 400, "prompt[0]"),
    ("prompt-bad-token-id", _c(prompt=[10 ** 9]), None, "c", 400, "prompt"),
    ("prompt-oversize", _c(prompt=[100] * 8200), None, "c", 400, "prompt"),
    ("prompt-plus-max_tokens", _c(prompt=[100] * 8000, max_tokens=500), None, "c", 400, "max_tokens"),
    ("messages-missing", {"model": MODEL}, None, "chat", 400, "messages"),
    ("messages-empty", _chat(messages=[]), None, "chat", 400, "messages"),
    ("messages-role", _chat(messages=[{"role": "wizard", "content": "x"}]), None, "chat", 400, "messages[0].role"),
    ("messages-content", _chat(messages=[{"role": "user", "content": 5}]), None, "chat", 400, "messages[0].content"),
    ("max_completion_tokens", _chat(max_completion_tokens="x"), None, "chat", 400, "max_completion_tokens"),
    ("malformed-json", b'{"model": ', None, "c", 400, None),
    ("json-not-object", b"[1, 2]", None, "c", 400, None),
    ("wrong-content-type", json.dumps(_c()).encode(), "text/plain", "c", 400, None),
    ("body-too-large", b'{"prompt": "' + b"x" * (2 << 20) + b'"}', None, "c", 413, None),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input(server, case) -> None:
    _, body, ctype, path, status, param = case
    url = server.url + ("/v1/chat/completions" if path == "chat" else "/v1/completions")
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(url, content=raw, headers={"content-type": ctype or "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    if param is not None:
        assert param in err["message"]
    good(server)  # and the server still answers


def test_not_found_and_method_errors_are_openai_shaped(server) -> None:
    r = httpx.get(server.url + "/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(server.url + "/v1/completions")
    assert r.status_code == 405 and "message" in r.json()["error"]


def scrape(server) -> dict[tuple[str, tuple], float]:
    """/metrics parsed by prometheus-client's parser: (sample name, sorted labels) -> value."""
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200
    samples = [s for fam in text_string_to_metric_families(r.text) for s in fam.samples]
    assert all(s.labels.get("model_name") == MODEL for s in samples if s.name.startswith("batchserve:"))
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
            for s in samples}


def test_metrics_show_what_the_test_did(server) -> None:
    before = scrape(server)
    prompt = "One two three four"
    for user in (None, "alice"):
        r = post(server, {"model": MODEL, "prompt": prompt, "max_tokens": 5, "ignore_eos": True, "temperature": 0,
                          **({"user": user} if user else {})})
        assert r.json()["usage"]["completion_tokens"] == 5
    n_prompt = r.json()["usage"]["prompt_tokens"]
    assert post(server, _c(max_tokens="x")).status_code == 400
    after = scrape(server)

    def delta(name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("batchserve:requests_total", finish_reason="length") == 2
    assert delta("batchserve:generation_tokens_total") == 10
    assert delta("batchserve:prompt_tokens_total") == 2 * n_prompt
    for h in ("e2e_request_latency_seconds", "time_to_first_token_seconds", "request_queue_time_seconds",
              "time_per_output_token_seconds", "request_prefill_time_seconds", "request_decode_time_seconds"):
        assert delta(f"batchserve:{h}_count") == 2, h
    assert delta("batchserve:inter_token_latency_seconds_count") == 2 * 4  # a gap per token after the first
    assert 0 < delta("batchserve:inter_token_latency_seconds_sum") < delta("batchserve:e2e_request_latency_seconds_sum")
    caching = server.state.engine.engine.kv.prefix_caching
    assert delta("batchserve:prefix_cache_queries_total") == (2 * n_prompt if caching else 0)
    assert 0 <= delta("batchserve:prefix_cache_hits_total") <= (n_prompt if caching else 0)
    assert delta("batchserve:batch_size_count") >= 5  # at least one step per token
    assert delta("batchserve:http_errors_total", status="400") == 1
    assert after[("batchserve:kv_cache_usage", ())] == 0.0
    assert after[("batchserve:requests_running", ())] == 0
    assert after[("batchserve:requests_waiting", (("level", "default"),))] == 0
    for name in ("batchserve:preemptions_total", "batchserve:prefix_cache_hit_rate", "batchserve:max_batch"):
        assert (name, ()) in after, name
    assert delta("batchserve:interjected_steps_total") == 0  # one tenant: no step is ever interjected
    # every token of the two answers was computed once: prompt + 5 each (the last sampled is not fed back)
    assert delta("batchserve:computed_tokens_total", level="default") == 2 * (n_prompt + 4)
    assert delta("batchserve:deadline_wasted_tokens_total", level="default") == 0
    assert delta("batchserve:tenant_requests_total", tenant="alice") == 1
    assert delta("batchserve:tenant_tokens_total", tenant="alice") == n_prompt + 4
    for reason in ("priority", "fairness", "memory"):
        assert ("batchserve:preemptions_by_level_total", (("level", "default"), ("reason", reason))) in after


def test_disconnect_aborts_within_one_step(server) -> None:
    """24 streams; 20 are cut mid-way: they leave the engine (blocks freed) within a step or
    two of the cut, and the 4 others complete."""
    aengine = server.state.engine
    body = {"model": MODEL, "prompt": "Count slowly:", "max_tokens": 48, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}

    async def run() -> tuple[int, list[dict]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60,
                                     limits=httpx.Limits(max_connections=32)) as c:
            resps = await asyncio.gather(*(c.send(c.build_request("POST", "/v1/completions", json=body),
                                                  stream=True) for _ in range(24)))
            lines = [r.aiter_lines() for r in resps]
            ids = []
            for it in lines:  # read two chunks of every stream
                chunks = []
                while len(chunks) < 2:
                    line = await it.__anext__()
                    if line.startswith("data: {"):
                        chunks.append(json.loads(line[6:]))
                ids.append(chunks[0]["id"])
            cut, steps0 = ids[:20], aengine.num_steps
            assert all(rid in server.engine.scheduler.requests for rid in cut)
            for r in resps[:20]:
                await r.aclose()
            end = time.monotonic() + 10
            while any(rid in server.engine.scheduler.requests for rid in cut) and time.monotonic() < end:
                await asyncio.sleep(0.001)
            steps = aengine.num_steps - steps0
            finals = []
            for r, it in zip(resps[20:], lines[20:]):
                events = [json.loads(line[6:]) async for line in it if line.startswith("data: {")]
                finals.append(events[-1])
                await r.aclose()
            return steps, finals

    steps, finals = asyncio.run(run())
    assert steps <= 2, f"cut streams took {steps} steps to leave the engine"
    assert len(finals) == 4
    for ev in finals:
        assert ev["usage"]["completion_tokens"] == 48


def test_non_streaming_client_that_gives_up_is_aborted(server) -> None:
    body = {"model": MODEL, "prompt": "Write a long story.", "max_tokens": 400, "ignore_eos": True}
    t0 = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        post(server, body, timeout=1.0)
    wait_idle(server.engine, timeout=10)  # 400 tokens would take 15 s or more
    assert time.monotonic() - t0 < 10


def test_failed_step_is_500_and_server_keeps_serving(server, llm) -> None:
    r = post(server, {"model": MODEL, "prompt": POISON + [0], "max_tokens": 8})
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["type"] == "server_error" and "injected fault" not in err["message"]  # in the log only
    assert r.headers["X-Request-Id"] in err["message"]

    events = []  # failing at output token 3, after the stream has started: an error event
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": POISON + [3], "max_tokens": 8, "stream": True}) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "model_error"
    assert sum(1 for e in events[:-2] if json.loads(e).get("choices")) >= 1

    prompt = "The capital of France is"
    offline = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0))[0]
    r = post(server, {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == offline.text


def _deadline_request(server, kind: str, deadline_ms: float) -> tuple[httpx.Response, float]:
    # 1,500 tokens take 5-6 s at this model's single-stream speed here (~3.5-4 ms a token), far past
    # the deadlines below
    body = {"model": MODEL, "prompt": "Write a very long story.", "max_tokens": 1500, "ignore_eos": True,
            "temperature": 0, "deadline_ms": deadline_ms, "deadline_kind": kind}
    t0 = time.monotonic()
    try:
        r = post(server, body, timeout=deadline_ms / 1000 + 4)
    except httpx.TimeoutException:
        pytest.fail(f"no answer {deadline_ms / 1000 + 4:.1f} s after a {kind} deadline of {deadline_ms:.0f} ms: "
                    "the engine did not enforce it")
    return r, time.monotonic() - t0


def test_hard_deadline_fails_fast_with_504(server) -> None:
    r, took = _deadline_request(server, "hard", 1500)
    assert r.status_code == 504, r.text
    assert r.json()["error"]["code"] == "deadline_exceeded"
    assert r.headers["x-should-retry"] == "false"  # the SDKs would resend it (and miss it again)
    assert took < 2.5, f"504 after {took:.2f} s"


def test_soft_deadline_truncates(server) -> None:
    r, took = _deadline_request(server, "soft", 1000)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["batchserve_finish_reason"] == "deadline_truncated"
    assert 0 < r.json()["usage"]["completion_tokens"] < 1500
    assert took < 4.0  # the 1,500 tokens would take 5 s or more


def test_sse_text_chunks_are_the_bytes_of_the_whole_object():
    """The prebuilt bytes around a text delta must give what encoding the whole chunk gives."""
    from batchserve.server.responses import ChunkWriter

    for chat in (False, True):
        for usage in (False, True):
            w = ChunkWriter('cmpl-"1\\', 1700000000, 'my "model" é', chat, usage)
            for text in ["Paris", ' "quoted" \\ ', "é中😀", "\x00\x1f\n\t", "\u2028", ""]:
                fast = w._delta(text)
                assert fast == w._chunk(w._choice(text, None))
                obj = json.loads(fast[len(b"data: "):])
                got = obj["choices"][0]["delta"]["content"] if chat else obj["choices"][0]["text"]
                assert got == text and obj["model"] == 'my "model" é' and ("usage" in obj) == usage
