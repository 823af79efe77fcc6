"""`serve --ray` end to end on a local Ray: real replicas of the default model behind real HTTP.

One local Ray for the module (8 logical CPUs on this 2-core machine, so that every fixture's
actors fit at once); two replicas serve the first tests, a prefill + decode pair the
disaggregated one. The replica-death test runs last
among the replica tests: it kills a replica and waits for Ray to bring it back.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import ray

from batchserve.config import CacheConfig, EngineConfig
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


def test_replicas_answer_concurrent_clients_like_one_engine(replicated, expected):
    server, client = replicated
    assert ask_all(server.url, QUESTIONS) == expected
    assert expected[0] == "The capital of France is Paris."


def test_a_burst_is_spread_across_replicas(replicated):
    server, client = replicated
    before = [r.routed for r in client.replicas]
    ask_all(server.url, QUESTIONS + QUESTIONS[:2], max_tokens=4)
    spread = [r.routed - b for r, b in zip(client.replicas, before)]
    assert sum(spread) == 8
    assert min(spread) >= 2, spread
    text = httpx.get(server.url + "/metrics").text
    assert 'batchserve:replica_up{replica="1",role="both"} 1' in text
    assert "batchserve:requests_running" in text


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


def test_killing_a_replica_loses_no_request_and_ray_restarts_it(replicated):
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
    assert ask_all(server.url, QUESTIONS[:1]) == ["The capital of France is Paris."]
    end = time.monotonic() + 180
    while time.monotonic() < end and not victim.up:
        time.sleep(0.2)
    assert victim.up, "Ray did not restart the replica"
    assert 'batchserve:replica_up{replica="0",role="both"} 1' in httpx.get(server.url + "/metrics").text
    before = victim.routed
    ask_all(server.url, QUESTIONS[:4], max_tokens=4)
    assert victim.routed > before  # back in the rotation


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
