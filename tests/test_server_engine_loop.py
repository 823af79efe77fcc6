"""AsyncEngine without a model (the fake executor): the background loop streams outputs to
asyncio, passes add errors back to the caller, aborts, and survives a failing step (failing
only the request it fails on). The
conftest leak check then proves every KV block came back."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
from conftest import FakeExecutor

from batchserve.engine.async_engine import AsyncEngine
from batchserve.request import RequestError, RequestSpec, SamplingParams


class SlowFlakyExecutor(FakeExecutor):
    """1 ms per step (so an abort can land mid-request); a step holding request "boom" raises."""

    def execute(self, batch):
        time.sleep(0.001)
        if any(s.request_id == "boom" for s in batch.seqs):
            raise RuntimeError("injected fault")
        return super().execute(batch)


def test_async_engine_loop(make_fake_engine) -> None:
    engine = make_fake_engine(num_blocks=64, block_size=4, executor=SlowFlakyExecutor(64))
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    steps: list = []
    finished: list = []

    async def scenario() -> None:
        ae = AsyncEngine(engine, on_step=steps.append, on_finish=finished.append)
        ae.start()
        while not ae.ready:
            await asyncio.sleep(0.001)
        try:
            out = await (await ae.add(RequestSpec(params, [1, 2, 3], request_id="a"))).collect()
            assert (out.finish_reason, len(out.token_ids), out.prompt_token_ids) == ("length", 5, [1, 2, 3])

            with pytest.raises(RequestError) as e:  # 1000 tokens cannot fit 64 blocks of 4
                await ae.add(RequestSpec(SamplingParams(max_tokens=1000), [1, 2, 3], request_id="big"))
            assert e.value.param == "max_tokens"

            boom = await ae.add(RequestSpec(params, [4, 5], request_id="boom"))
            ok = await ae.add(RequestSpec(params, [6], request_id="ok"))
            out = await boom.collect()
            assert out.finish_reason == "error" and "failed on this request" in out.error
            assert "injected fault" not in out.error  # exception text goes to the log only
            out = await ok.collect()  # shared the failed step or ran after it: carried on either way
            assert out.finish_reason == "length" and len(out.token_ids) == 5
            out = await (await ae.add(RequestSpec(params, [7], request_id="after"))).collect()
            assert out.finish_reason == "length"  # the engine kept serving

            long = await ae.add(RequestSpec(SamplingParams(max_tokens=200, ignore_eos=True), [1, 2, 3],
                                            request_id="long"))
            first = await long.next()
            assert not first.finished
            ae.abort("long")
            out = await long.collect()
            assert out.finish_reason == "abort" and len(out.token_ids) < 200

            auto = await ae.add(RequestSpec(SamplingParams(max_tokens=1, ignore_eos=True), [1] * 10,
                                            request_id="auto", auto_max_tokens=1024))
            out = await auto.collect()
            assert len(out.token_ids) == 64 * 4 - 10  # the room left in the KV cache
            assert await ae.call(lambda eng: eng.kv.num_free_blocks) == 64
        finally:
            await asyncio.to_thread(ae.shutdown)

    asyncio.run(scenario())
    assert {o.request_id for o in finished} == {"a", "boom", "ok", "after", "long", "auto"}
    assert steps and all(s.num_seqs >= 1 for s in steps)


class LayeredSleepExecutor(FakeExecutor):
    """Steps of 5 layers of `layer_s` (real time), calling `between_layers` between each two as
    the model runner does; records each step's requests and whether it ran inside another. Once
    the test sets `slow`, the next step runs slow layers and sets `slow_started` as it begins, so
    a request posted then lands mid-step however busy the machine; a step of that request's sets
    the layers back."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.between_layers = None
        self.depth = 0
        self.layer_s = 0.004
        self.slow, self.slow_started = threading.Event(), threading.Event()
        self.ran: list[tuple[list[str], int]] = []

    def execute(self, batch):
        self.ran.append(([s.request_id for s in batch.seqs], self.depth))
        if any(s.request_id == "light" for s in batch.seqs):
            self.layer_s = 0.004
        elif self.slow.is_set():
            self.slow.clear()
            self.layer_s = 0.2
            self.slow_started.set()
        self.depth += 1
        try:
            for layer in range(5):
                time.sleep(self.layer_s)
                if layer < 4 and self.between_layers is not None:
                    self.between_layers()
        finally:
            self.depth -= 1
        return super().execute(batch)


@pytest.mark.parametrize("broken", [False, True])
def test_a_light_tenant_starts_between_the_layers_of_a_running_step(make_fake_engine, broken) -> None:
    """Served: a light tenant's request posted while a step of the heavy tenant's decodes runs
    is taken in at that step's next pause between layers and runs its first step there; every
    stream ends with its answer and the step count includes the interjected step. `broken`:
    choosing the step to interject raises; nothing is failed (the paused step still writes its
    requests' blocks) and the light request runs after the step, as without interjection."""
    ex = LayeredSleepExecutor(256)
    engine = make_fake_engine(num_blocks=256, block_size=4, executor=ex, max_num_seqs=8)
    if broken:
        def boom(now, in_flight):
            raise RuntimeError("injected")
        engine.scheduler.interjection = boom
    steps: list = []

    async def scenario() -> None:
        ae = AsyncEngine(engine, on_step=steps.append)
        ae.start()
        while not ae.ready:
            await asyncio.sleep(0.001)
        try:
            once = await ae.add(RequestSpec(SamplingParams(max_tokens=1), [1, 2, 3], request_id="seen", tenant="light"))
            await once.collect()
            heavy = [await ae.add(RequestSpec(SamplingParams(max_tokens=60, ignore_eos=True), [1, 2, 3],
                                              request_id=f"heavy{i}", tenant="heavy")) for i in range(4)]
            for _ in range(12):  # the heavy tenant served well past the light one
                await heavy[0].next()
            ex.slow.set()  # the next step has slow layers to go: it is still running when the add lands
            assert await asyncio.to_thread(ex.slow_started.wait, 10.0)
            light = await ae.add(RequestSpec(SamplingParams(max_tokens=5, ignore_eos=True), [4, 5, 6],
                                             request_id="light", tenant="light"))
            out = await light.collect()
            assert out.finish_reason == "length" and len(out.token_ids) == 5
            for h in heavy:
                out = await h.collect()
                assert out.finish_reason == "length" and len(out.token_ids) == 60
        finally:
            await asyncio.to_thread(ae.shutdown)

    asyncio.run(scenario())
    first = next((ids, depth) for ids, depth in ex.ran if "light" in ids)
    assert first == (["light"], 0 if broken else 1)  # its first step, alone, inside a heavy step (or after it)
    assert engine.scheduler.num_interjections == (0 if broken else 1) and len(steps) == len(ex.ran)
