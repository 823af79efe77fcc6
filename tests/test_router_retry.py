"""The Ray router places a request again when its replica dies before the client has seen
anything: any non-streamed request (its answer goes out whole, at the end), a stream before its
first chunk. Model-free and Ray-free: the router's own logic against two fake replica handles."""
from __future__ import annotations

import asyncio
import random

from batchserve.core.batch import RequestOutput
from batchserve.distributed.router import RayEngineClient, _Replica, _Track
from batchserve.engine.request_stream import RequestStream
from batchserve.request import RequestSpec, SamplingParams


class FakeHandle:
    """A replica actor's handle: `add.remote(...)` records the request."""

    def __init__(self) -> None:
        self.added: list[str] = []
        self.add = self
        self.abort = self

    async def _add(self, spec: RequestSpec, _wait: float) -> None:
        self.added.append(spec.request_id)

    def remote(self, *args):
        return self._add(*args) if len(args) == 2 else None


def router() -> RayEngineClient:
    c = object.__new__(RayEngineClient)  # no Ray: only the routing state the retry path reads
    c._tracks, c._stopping, c.disaggregated, c.prefix_routing, c.block_size = {}, False, False, False, 4
    c._rng, c.retries, c.on_finish, c.on_step = random.Random(0), 0, None, None
    c.replicas = [_Replica(0, "both", FakeHandle(), up=True), _Replica(1, "both", FakeHandle(), up=True)]
    return c


def out(rid: str, tokens: list[int], new: list[int], finished: bool = False) -> RequestOutput:
    return RequestOutput(rid, [1, 2], list(tokens), new, finished, "length" if finished else None,
                         text="".join(map(str, tokens)), new_text="".join(map(str, new)))


async def placed(c: RayEngineClient, rid: str) -> _Track:
    spec = RequestSpec(SamplingParams(max_tokens=3), [1, 2], request_id=rid)
    t = _Track(rid, RequestStream(rid), [1, 2], spec, c.now())
    c._tracks[rid] = t
    await c._place(t)
    return t


def test_a_request_the_client_has_not_seen_is_placed_again_from_its_prompt() -> None:
    async def scenario() -> None:
        c = router()
        t = await placed(c, "a")
        answer = asyncio.ensure_future(t.stream.collect())  # a non-streamed request
        first = t.replica
        c._deliver(t, out("a", [7], [7]))  # the dying replica got one token out
        await asyncio.sleep(0)
        await c._lost(t, c.replicas[first], RuntimeError("actor died"))
        assert t.replica == 1 - first and c.replicas[1 - first].handle.added == ["a"] and c.retries == 1
        c._deliver(t, out("a", [3], [3]))
        c._deliver(t, out("a", [3, 4, 5], [4, 5], finished=True))
        final = await asyncio.wait_for(answer, 5)
        assert (final.finish_reason, final.token_ids, final.new_token_ids, final.new_text) == \
            ("length", [3, 4, 5], [3, 4, 5], "345")  # nothing of the dead replica's

    asyncio.run(scenario())


def test_a_stream_the_client_has_seen_fails_with_a_clear_error() -> None:
    async def scenario() -> None:
        c = router()
        t = await placed(c, "s")
        c._deliver(t, out("s", [7], [7]))
        assert (await t.stream.next()).new_token_ids == [7]
        t.stream.seen = True  # the server sent the first chunk
        await c._lost(t, c.replicas[t.replica], RuntimeError("actor died"))
        end = await asyncio.wait_for(t.stream.next(), 5)
        assert end.finished and end.finish_reason == "error" and "died" in end.error
        assert c.retries == 0 and sum(len(r.handle.added) for r in c.replicas) == 1

    asyncio.run(scenario())
