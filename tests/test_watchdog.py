"""The engine reports its own trouble, model-free (tests/fake_server.py): a model step running
past --step-timeout-s fails the requests in flight and turns /health 503 until it ends; a dead
engine thread fails them too, turns /health (and /health/live) 503 and makes the server exit 1.
And the engine thread only runs the model: a slow tokenization holds up no step, and a full
queue is refused at once, not at the next step boundary."""
from __future__ import annotations

import asyncio
import threading
import time

from conftest import FakeExecutor
from fake_server import MODEL, FakeTokenizer, fake_engine, serve_app
from prometheus_client.parser import text_string_to_metric_families

from batchserve.config import QueueConfig, ServerConfig
from batchserve.server.run import exit_status

BODY = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 500, "ignore_eos": True}


class Die(BaseException):
    """Escapes every `except Exception`: it ends the engine thread."""


class TroubleExecutor(FakeExecutor):
    """2 ms a step; blocks while `hang` is set (until `release`), raises Die once `die` is set."""

    def __init__(self, step_s: float = 0.002) -> None:
        super().__init__(256)
        self.step_s = step_s
        self.hang, self.release, self.die, self.busy = (threading.Event() for _ in range(4))
        self.step_starts: list[float] = []

    def execute(self, batch):
        self.step_starts.append(time.monotonic())
        self.busy.set()
        if self.die.is_set():
            raise Die()
        if self.hang.is_set():
            self.release.wait(10)
        time.sleep(self.step_s)
        return super().execute(batch)


def run(coro, timeout: float = 20.0) -> None:
    asyncio.run(asyncio.wait_for(coro, timeout))


def metrics(text: str) -> dict[str, float]:
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


async def until(cond, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.01)


def test_a_stalled_step_fails_requests_in_flight_and_health_says_so() -> None:
    ex = TroubleExecutor()

    async def scenario() -> None:
        async with serve_app(fake_engine(ex), ServerConfig(step_timeout_s=0.3)) as (client, state):
            inflight = asyncio.ensure_future(client.post("/v1/completions", json=BODY))
            await until(lambda: len(ex.step_starts) > 3)
            ex.hang.set()
            t0 = time.monotonic()
            r = await inflight
            assert r.status_code == 500 and "stalled" in r.json()["error"]["message"], r.text
            assert time.monotonic() - t0 < 1.5
            for path in ("/health", "/health/ready", "/health/live"):
                h = await client.get(path)
                assert h.status_code == 503 and h.json()["status"] == "stalled", (path, h.text)
            r = await client.post("/v1/completions", json=BODY)
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_stalled"
            m = metrics((await client.get("/metrics")).text)  # answers while the engine thread is stuck
            assert m["batchserve:engine_stalls_total"] == 1 and m["batchserve:engine_up"] == 0
            assert m["batchserve:requests_failed_by_watchdog_total"] == 1
            assert m["batchserve:engine_step_running_seconds"] > 0.3

            ex.hang.clear()
            ex.release.set()  # the step ends: the engine serves again
            await until(lambda: state.engine.health().state == "ok")
            assert (await client.get("/health")).status_code == 200
            r = await client.post("/v1/completions", json={**BODY, "max_tokens": 3})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
            assert state.engine.health().stalls == 1 and state.fatal is None

    run(scenario())


def test_a_dead_engine_thread_fails_requests_health_and_the_process() -> None:
    ex = TroubleExecutor()
    fatal = []

    async def scenario() -> None:
        engine = fake_engine(ex, check_leaks=False)  # it dies holding its requests
        async with serve_app(engine, ServerConfig(step_timeout_s=5)) as (client, state):
            state.on_fatal = lambda: fatal.append(True)
            inflight = asyncio.ensure_future(client.post("/v1/completions", json=BODY))
            await until(lambda: len(ex.step_starts) > 3)
            ex.die.set()
            r = await inflight
            assert r.status_code == 500 and "died" in r.json()["error"]["message"], r.text
            await until(lambda: bool(fatal))
            assert isinstance(state.fatal, Die) and exit_status(state) == 1
            for path in ("/health", "/health/live"):
                h = await client.get(path)
                assert h.status_code == 503 and h.json()["status"] == "dead", (path, h.text)
            r = await client.post("/v1/completions", json=BODY)
            assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
            m = metrics((await client.get("/metrics")).text)
            assert m["batchserve:engine_up"] == 0 and m["batchserve:requests_failed_by_watchdog_total"] == 1

    run(scenario())


class SlowTokenizer(FakeTokenizer):
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        time.sleep(0.6)  # a 1 MB prompt's worth (the Rust tokenizer lets go of the GIL like this)
        return super().encode(text)


def test_tokenizing_holds_up_no_step() -> None:
    ex = TroubleExecutor()

    async def scenario() -> None:
        async with serve_app(fake_engine(ex, tokenizer=SlowTokenizer())) as (client, _):
            running = asyncio.ensure_future(client.post("/v1/completions", json=BODY))
            await until(lambda: len(ex.step_starts) > 3)
            r = await client.post("/v1/completions", json={**BODY, "prompt": "a long prompt", "max_tokens": 2})
            assert r.status_code == 200
            starts = [t for t in ex.step_starts]
            assert max(b - a for a, b in zip(starts, starts[1:])) < 0.3  # tokenizing took 0.6 s
            assert (await running).status_code == 200

    run(scenario())


def test_a_full_queue_is_refused_at_once() -> None:
    ex = TroubleExecutor(step_s=1.0)

    async def scenario() -> None:
        async with serve_app(fake_engine(ex, queue=QueueConfig.bounded(1), max_num_seqs=1)) as (client, state):
            first = asyncio.ensure_future(client.post("/v1/completions", json={**BODY, "max_tokens": 2}))
            await until(lambda: state.engine.engine.scheduler.running)  # running: its queue level is empty
            second = asyncio.ensure_future(client.post("/v1/completions", json={**BODY, "max_tokens": 1}))
            await until(lambda: state.engine._posted["default"] + len(state.engine.engine.scheduler.waiting) == 1)
            t0 = time.monotonic()
            r = await client.post("/v1/completions", json=BODY)
            took = time.monotonic() - t0
            assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
            assert int(r.headers["Retry-After"]) >= 1
            assert took < 0.5, f"refused after {took:.2f} s: it waited for the step (1 s)"
            assert [(await f).status_code for f in (first, second)] == [200, 200]

    run(scenario())


def test_serve_stops_and_exits_1_when_the_engine_dies() -> None:
    """`batchserve serve`'s server: the engine's death stops it at once (no drain), status 1."""
    import uvicorn

    from batchserve.server.app import create_app
    from batchserve.server.run import DrainingServer

    app = create_app(fake_engine(), ServerConfig(), MODEL)
    state = app.state.server
    server = DrainingServer(uvicorn.Config(app), state, grace_s=30)
    assert exit_status(state) == 0 and not server.should_exit
    state.engine.on_dead(Die())  # what the engine calls on the event loop
    assert server.should_exit and exit_status(state) == 1
