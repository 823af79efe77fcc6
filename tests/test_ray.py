"""`serve --ray` end to end on a local Ray: real replicas of the default model behind real HTTP.

One local Ray for the module (8 logical CPUs on this 2-core machine, so that every fixture's
actors fit at once); two replicas serve the first tests, two narrow ones (two seats each, so
that requests queue) the count of a replica killed under load, a prefill + decode pair the
disaggregated one. The replica-death tests run last among the replica tests: each kills a
replica and waits for Ray to bring it back.
"""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from batchserve.config import CacheConfig, EngineConfig, SchedulerConfig
from batchserve.distributed.router import RayEngineClient
from batchserve.request import SamplingParams
from tests.server_helpers import MODEL, start_server

pytestmark = [pytest.mark.ray, pytest.mark.model, pytest.mark.http]

QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "What is 2 + 2?",
             "Say hello in Spanish.", "What is the largest planet?", "Give me a synonym for happy."]
CONFIG = EngineConfig(cache=CacheConfig(kv_cache_gb=0.1))


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=8, include_dashboard=False, object_store_memory=256 * 2**20, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def expected(llm):
    """Greedy answers of one in-process engine (the reference)."""
    params = SamplingParams(max_tokens=24, temperature=0.0)
    return [o.text for o in llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], params)]


@pytest.fixture(scope="module")
def replicated(local_ray):
    client = RayEngineClient(CONFIG, replicas=2, replica_cpus=1.0, seed=0)
    server = start_server(client, timeout=300)
    yield server, client
    server.stop()


@pytest.fixture(scope="module")
def narrow(local_ray):
    """Two replicas of two seats each: under load most of a replica's requests wait in its
    queue, where the client has seen nothing of them."""
    config = EngineConfig(cache=CacheConfig(kv_cache_gb=0.1), scheduler=SchedulerConfig(max_num_seqs=2))
    client = RayEngineClient(config, replicas=2, replica_cpus=1.0, seed=0)
    server = start_server(client, timeout=300)
    yield server, client
    server.stop()


@pytest.fixture(scope="module")
def disaggregated(local_ray):
    client = RayEngineClient(CONFIG, prefill_workers=1, decode_workers=1, replica_cpus=1.0, seed=0)
    server = start_server(client, timeout=300)
    yield server, client
    server.stop()


def ask_all(url: str, questions: list[str], max_tokens: int = 24) -> list[str]:
    oc = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)

    def ask(q: str) -> str:
        r = oc.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": q}],
                                       max_tokens=max_tokens, temperature=0)
        return r.choices[0].message.content

    with ThreadPoolExecutor(len(questions)) as pool:
        return list(pool.map(ask, questions))


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """/metrics parsed: (sample name, sorted labels but model_name) -> value. Every batchserve
    sample, the router's own included, carries the served model_name, as on one server."""
    text = httpx.get(url + "/metrics").text
    samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name.startswith("batchserve:")]
    assert samples and all(s.labels.get("model_name") == MODEL for s in samples), text
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
            for s in samples}


def test_replicas_answer_concurrent_clients_like_one_engine(replicated, expected):
    server, client = replicated
    assert ask_all(server.url, QUESTIONS) == expected
    assert "4" in expected[2], expected[2]


def test_a_burst_is_spread_across_replicas(replicated):
    server, client = replicated
    before = [r.routed for r in client.replicas]
    ask_all(server.url, QUESTIONS + QUESTIONS[:2], max_tokens=4)
    spread = [r.routed - b for r, b in zip(client.replicas, before)]
    assert sum(spread) == 8
    assert min(spread) >= 2, spread
    m = scrape(server.url)
    assert m[("batchserve:replica_up", (("replica", "1"), ("role", "both")))] == 1
    assert m[("batchserve:replica_routed_total", (("replica", "1"), ("role", "both")))] == client.replicas[1].routed
    assert ("batchserve:requests_running", ()) in m


def test_stream_and_errors_go_through_the_router(replicated):
    server, _ = replicated
    bad = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    too_long = httpx.post(server.url + "/v1/completions",
                          json={"model": MODEL, "prompt": "hi", "max_tokens": 100_000})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "max_tokens"
    oc = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    chunks = list(oc.completions.create(model=MODEL, prompt="The sky is", max_tokens=6, temperature=0, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"
    assert len("".join(c.choices[0].text for c in chunks)) > 0


def test_killing_a_replica_loses_no_request_and_ray_restarts_it(replicated, expected):
    server, client = replicated
    victim = client.replicas[0]

    def ask(i: int) -> tuple[int, dict]:
        r = httpx.post(server.url + "/v1/completions", timeout=120,
                       json={"model": MODEL, "prompt": f"Story number {i}: once upon a time", "max_tokens": 48,
                             "temperature": 0})
        return r.status_code, r.json()

    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(ask, i) for i in range(6)]
        end = time.monotonic() + 60
        while time.monotonic() < end and not (victim.stats and victim.stats.running):
            time.sleep(0.05)  # until the victim is generating
        assert victim.stats and victim.stats.running
        ray.kill(victim.handle, no_restart=False)
        results = [f.result(timeout=180) for f in futures]
    ok = [body for status, body in results if status == 200]
    failed = [body for status, body in results if status != 200]
    assert len(ok) + len(failed) == 6
    assert ok, "the surviving replica's requests must complete"
    for body in ok:
        assert body["choices"][0]["finish_reason"] == "length"
    for status, body in results:
        if status != 200:
            assert status == 500 and "replica 0 (both) died" in body["error"]["message"], body
    assert client.replica_failures == 1
    # the endpoint keeps answering while the victim restarts
    assert ask_all(server.url, QUESTIONS[:1]) == expected[:1]
    end = time.monotonic() + 180
    while time.monotonic() < end and not victim.up:
        time.sleep(0.2)
    assert victim.up, "Ray did not restart the replica"
    assert scrape(server.url)[("batchserve:replica_up", (("replica", "0"), ("role", "both")))] == 1
    before = victim.routed
    ask_all(server.url, QUESTIONS[:4], max_tokens=4)
    assert victim.routed > before  # back in the rotation


def _stream(url: str, i: int, max_tokens: int) -> dict:
    """One streamed completion: its id, when each text chunk came, its error event, the tokens
    its usage chunk counts, whether it ended with [DONE]."""
    out: dict = {"times": [], "error": None, "done": False, "id": None, "tokens": None}
    body = {"model": MODEL, "prompt": f"Tale {i}: in a far land", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            if line == "data: [DONE]":
                out["done"] = True
            elif line.startswith("data: {"):
                obj = json.loads(line[6:])
                out["id"] = out["id"] or obj.get("id")
                if "error" in obj:
                    out["error"] = obj["error"]["message"]
                elif any(c.get("text") for c in obj.get("choices") or []):
                    out["times"].append(time.monotonic())
                if obj.get("usage"):
                    out["tokens"] = obj["usage"]["completion_tokens"]
    return out


def _whole(url: str, i: int, max_tokens: int) -> dict:
    r = httpx.post(url + "/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": f"Fable {i}: a fox and", "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True})
    return {"status": r.status_code, **r.json()}


def test_a_replica_killed_under_load_loses_nothing_and_unseen_requests_are_placed_again(narrow):
    """Requests, half of them streamed, on replicas with few seats; one replica is killed while
    it streams and queues. Counted: every request ends answered or with the router's
    error; only streams whose client had a chunk fail; each request the victim held whose
    client had seen nothing is placed again and answered in full; the survivor frees every block."""
    server, client = narrow
    n, max_tokens = 12, 32
    retries0, failures0 = client.retries, client.replica_failures
    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(_stream if i % 2 else _whole, server.url, i, max_tokens) for i in range(n)]
        victim, end = None, time.monotonic() + 60
        while victim is None and time.monotonic() < end:
            for r in client.replicas:
                held = [t for t in list(client._tracks.values()) if t.replica == r.key]
                if any(t.stream.seen for t in held) and sum(not t.delivered for t in held) >= 2:
                    victim = r
                    break
            time.sleep(0.005)
        assert victim is not None, "no replica was both streaming and queueing"
        held = [t for t in list(client._tracks.values()) if t.replica == victim.key]
        ray.kill(victim.handle, no_restart=False)
        # nothing produced by the time the kill was asked (read after it: a request the victim
        # held may have sent its first token between the look above and the kill)
        queued = {t.rid for t in held if not t.delivered}
        results = [f.result(timeout=180) for f in futures]
    streams, wholes = results[1::2], results[0::2]
    assert all(w["status"] == 200 and w["choices"][0]["finish_reason"] == "length"
               and w["usage"]["completion_tokens"] == max_tokens for w in wholes), wholes  # none seen: none lost
    failed = [s for s in streams if s["error"] is not None]
    for s in streams:
        assert s["status"] == 200 and s["done"], s  # every stream ended, with [DONE]
        if s["error"] is None:
            assert s["tokens"] == max_tokens, s  # (a chunk may carry more than one token)
        else:  # only a stream whose client had output may fail
            assert "replica" in s["error"] and "died" in s["error"], s
            assert s["times"], s
    answered = {w["id"] for w in wholes} | {s["id"] for s in streams if s["error"] is None}
    # ray.kill does not wait for the actor to die: output it sent after the kill was asked may
    # still reach a stream's client, which then fails as a stream with output (checked above)
    unseen = queued - {s["id"] for s in failed}
    assert unseen <= answered  # what the victim queued, no client the wiser, was placed again and answered
    retried = client.retries - retries0
    assert len(unseen) <= retried and retried + len(failed) <= len(held), (unseen, retried, len(failed), len(held))
    assert client.replica_failures == failures0 + 1
    assert scrape(server.url)[("batchserve:router_retries_total", ())] == client.retries
    survivor = next(r for r in client.replicas if r is not victim)
    end = time.monotonic() + 10
    while time.monotonic() < end and not (survivor.stats and survivor.stats.running == 0
                                          and survivor.stats.kv_free_blocks == survivor.stats.kv_blocks):
        time.sleep(0.05)
    assert survivor.stats.kv_free_blocks == survivor.stats.kv_blocks, "the survivor kept KV blocks"
    end = time.monotonic() + 180
    while time.monotonic() < end and not victim.up:
        time.sleep(0.2)
    assert victim.up, "Ray did not restart the replica"


def test_disaggregated_prefill_decode_matches_one_engine(disaggregated, expected):
    server, client = disaggregated
    assert ask_all(server.url, QUESTIONS) == expected
    stats = client.handoff_stats()
    assert stats["handoffs"] == len(QUESTIONS)
    assert stats["tokens"] >= 6 * 30  # every prompt's K/V went across
    # a request that ends at its first token never reaches a decode worker
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 1})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1
    assert client.handoff_stats()["handoffs"] == len(QUESTIONS)
    assert [r.routed for r in client.replicas] == [7, 6]


def test_every_replica_full_gives_503_with_retry_after(local_ray):
    """Two replicas that each run one request and queue one more: a burst of eight gets some
    answers and 503s with Retry-After (refused everywhere), and every accepted one finishes."""
    from batchserve.config import ModelConfig, QueueConfig, SchedulerConfig
    from batchserve.runner.profiler import TINY_MODEL

    cfg = EngineConfig(model=ModelConfig(model="dummy", dummy_config=TINY_MODEL, num_threads=1),
                       cache=CacheConfig(block_size=4, num_blocks=256), scheduler=SchedulerConfig(max_num_seqs=1),
                       queue=QueueConfig.bounded(1))
    client = RayEngineClient(cfg, replicas=2, replica_cpus=0.5, seed=0)
    server = start_server(client, timeout=120)
    try:
        def send(i: int) -> httpx.Response:
            return httpx.post(server.url + "/v1/completions", timeout=60,
                              json={"model": MODEL, "prompt": list(range(5 + i, 25 + i)), "max_tokens": 200,
                                    "temperature": 0, "ignore_eos": True})

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(send, range(8)))
        codes = sorted(r.status_code for r in results)
        assert 200 in codes and 503 in codes, codes
        assert set(codes) <= {200, 503}
        for r in results:
            if r.status_code == 503:
                assert r.json()["error"]["code"] == "queue_full"
                assert "every replica refused" in r.json()["error"]["message"]
                assert float(r.headers["Retry-After"]) >= 1
            else:
                assert r.json()["usage"]["completion_tokens"] == 200
    finally:
        server.stop()
