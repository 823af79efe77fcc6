"""One engine replica, run as a Ray actor (`batchserve serve --ray`).

`EngineReplica` is a plain class; `router.py` wraps it with `ray.remote` (so importing this
module needs no Ray). Inside, an AsyncEngine runs the LLMEngine on its own thread, exactly as
in the single-process server; the actor's event loop only moves requests in and outputs out.

Outputs do not travel one call per request: the router keeps one `pull()` call open per
replica, and each returns every output produced since the last one (merged per request),
the step records for metrics, and the replica's live queue statistics for routing.

Roles: "both" (a whole engine), "prefill" (runs prompts; on each request's first token it
exports the prompt's K/V, drops the request and returns token and K/V to the router), and
"decode" (a whole engine that also adopts prefilled requests, see LLMEngine.add_prefilled).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

from batchserve.config import EngineConfig
from batchserve.core.batch import RequestOutput, StepRecord
from batchserve.core.stats import EngineSnapshot
from batchserve.engine.async_engine import AsyncEngine
from batchserve.engine.request_stream import merge_outputs
from batchserve.request import MAX_PRIORITY, MIN_PRIORITY, RequestSpec

log = logging.getLogger(__name__)
PULL_WAIT_S = 0.5  # a pull with nothing to say returns after this long (carries fresh stats)
NUM_PRIORITIES = MAX_PRIORITY - MIN_PRIORITY + 1


@dataclass
class ReplicaStats:
    """What the router needs to place a request: work queued per priority, and cached prefixes."""

    waiting: list[int] = field(default_factory=lambda: [0] * NUM_PRIORITIES)  # requests per priority
    waiting_tokens: list[int] = field(default_factory=lambda: [0] * NUM_PRIORITIES)  # prompt tokens
    running: int = 0
    kv_free_blocks: int = 0
    kv_blocks: int = 0
    snapshot: EngineSnapshot | None = None  # for /metrics
    prefix_hashes: frozenset[int] | None = None  # None: prefix caching off
    taken_at: float = 0.0


@dataclass
class Handoff:
    """A prefill worker's answer: the first output, and whether a decode worker takes over."""

    output: RequestOutput
    kv_tokens: int  # prompt positions in the K/V (0: nothing to hand over, the output is final)
    export_s: float  # time to gather the K/V out of the cache


def queued_work(sched: Any) -> tuple[list[int], list[int]]:
    """Per priority: requests waiting, and prompt tokens not yet computed — those of waiting
    requests and of admitted prompts still in chunks (work ahead of a new request too)."""
    waiting, tokens = [0] * NUM_PRIORITIES, [0] * NUM_PRIORITIES
    for req in sched.waiting:
        waiting[req.priority] += 1
        tokens[req.priority] += req.num_tokens - req.num_computed_tokens
    for req in sched.running:
        left = req.num_tokens - req.num_computed_tokens - 1  # a decode has 1 left
        if left > 0:
            tokens[req.priority] += left
    return waiting, tokens


def replica_stats(engine: Any, with_hashes: bool) -> ReplicaStats:
    """Read on the engine thread, between steps."""

    waiting, tokens = queued_work(engine.scheduler)
    s = ReplicaStats(waiting, tokens, running=len(engine.scheduler.running),
                     kv_free_blocks=engine.kv.num_free_blocks, kv_blocks=engine.kv.num_blocks,
                     snapshot=engine.snapshot(), taken_at=time.monotonic())
    if with_hashes and engine.kv.prefix_caching:
        s.prefix_hashes = engine.kv.cached_hashes()
    return s


class _ReplicaEngine(AsyncEngine):
    """An AsyncEngine whose outputs go to one outbox (for `pull`) instead of per-request
    streams; in the prefill role, requests leave at their first token with their K/V."""

    def __init__(self, replica: "EngineReplica", config: EngineConfig) -> None:
        from batchserve.engine.engine import LLMEngine

        super().__init__(lambda: LLMEngine.from_config(config), on_step=replica.on_step)
        self.replica = replica
        self.prefill_role = replica.role == "prefill"
        self.handoffs: dict[str, asyncio.Future] = {}  # event-loop side: prefill calls waiting

    def _deliver(self, outs: list[RequestOutput]) -> None:  # on the event loop
        for out in outs:
            if out.finished:
                self._streams.pop(out.request_id, None)
        self.replica.post(outs)

    def _emit(self, outs: list[RequestOutput]) -> None:  # on the engine thread
        if self.prefill_role and outs:
            outs = self._hand_off(outs)
        super()._emit(outs)

    def _hand_off(self, outs: list[RequestOutput]) -> list[RequestOutput]:
        """Prefill role: each request that just got its first token leaves here, its K/V with it."""
        engine = self.engine
        runner = engine.executor
        for out in outs:  # each is a request's first token (it leaves here) or its end
            handoff = Handoff(out, 0, 0.0)
            kv = None
            if not out.finished:
                t0 = time.perf_counter()
                n = len(out.prompt_token_ids)
                kv = runner.export_kv(engine.kv.block_table(out.request_id), n).numpy()
                handoff = Handoff(out, n, time.perf_counter() - t0)
                engine.hand_off(out.request_id)  # its blocks go back now; it has no more output here
            self._to_loop(self._settle_handoff, out.request_id, handoff, kv)
        return []

    def _settle_handoff(self, rid: str, handoff: Handoff, kv: Any) -> None:
        self._streams.pop(rid, None)
        fut = self.handoffs.get(rid)  # take_handoff removes it
        if fut is not None and not fut.done():
            fut.set_result((handoff, kv))


class EngineReplica:
    """A Ray actor holding one engine. Methods are called by router.RayEngineClient."""

    def __init__(self, config: EngineConfig, role: str = "both", replica_id: str = "0") -> None:
        if role not in ("both", "prefill", "decode"):
            raise ValueError(f"role must be both, prefill or decode, got {role!r}")
        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s [{role} {replica_id}] %(message)s")
        self.config = config
        self.role = role
        self.replica_id = replica_id
        self._outbox: dict[str, RequestOutput] = {}
        self._steps: list[StepRecord] = []
        self._wake: asyncio.Event | None = None
        self._engine: _ReplicaEngine | None = None
        self.started_at = time.monotonic()

    # --- lifecycle ---------------------------------------------------------------------
    async def ready(self) -> dict[str, Any]:
        """Start the engine (first call) and wait for the model; returns its shape."""
        if self._engine is None:
            self._wake = asyncio.Event()
            self._engine = _ReplicaEngine(self, self.config)
            self._engine.start(asyncio.get_running_loop())
        eng = self._engine
        while not eng.ready:
            if eng.load_error is not None:
                raise RuntimeError(f"replica {self.replica_id}: engine failed to start: {eng.load_error}")
            await asyncio.sleep(0.05)
        e = eng.engine
        return {"replica_id": self.replica_id, "role": self.role, "pid": os.getpid(),
                "max_model_len": e.executor.max_model_len, "kv_blocks": e.kv.num_blocks,
                "block_size": e.kv.block_size}

    async def shutdown(self) -> None:
        if self._engine is not None:
            await asyncio.to_thread(self._engine.shutdown)

    # --- requests ----------------------------------------------------------------------
    async def add(self, spec: RequestSpec, age_s: float) -> None:
        """Queue a tokenized request (`spec.prompt` is token ids) that arrived `age_s` ago;
        raises what LLMEngine.add raises. In the prefill role the request leaves at its first
        token: fetch that with `take_handoff`."""
        eng = self._engine
        rid = spec.request_id
        if eng.prefill_role:
            eng.handoffs[rid] = asyncio.get_running_loop().create_future()
        try:
            # arrival is sent as an age, not a timestamp: clocks differ between machines
            await eng.add(dataclasses.replace(spec, arrival_time=eng.now() - max(0.0, age_s)))
        except BaseException:
            eng.handoffs.pop(rid, None)
            raise

    async def take_handoff(self, request_id: str) -> tuple[Handoff, Any]:
        """Prefill role: wait for the request's first token; (Handoff, K/V as numpy or None).
        Called with num_returns=2, so the K/V goes into Ray's object store and the router
        passes its reference on to a decode worker without fetching it."""
        fut = self._engine.handoffs.get(request_id)
        if fut is None:
            raise KeyError(f"replica {self.replica_id}: no prefill in flight for {request_id!r}")
        try:
            return await asyncio.shield(fut)
        finally:
            self._engine.handoffs.pop(request_id, None)

    async def adopt(self, spec: RequestSpec, first_token: int, age_s: float, ttft_s: float, kv: Any,
                    first_logprob: Any = None) -> float:
        """Decode role: continue a prefilled request from its K/V; returns the import time (s).
        `age_s`: since the request arrived; `ttft_s`: arrival to its first token;
        `first_logprob`: its TokenLogprob, when the request asked for logprobs."""
        import torch

        eng = self._engine
        now = eng.now()
        arrival = now - max(0.0, age_s)
        with warnings.catch_warnings():  # the object store's array is read-only; it is only read
            warnings.simplefilter("ignore", UserWarning)
            kv_t = torch.from_numpy(kv)

        def take(engine: Any) -> float:
            t0 = time.perf_counter()
            engine.add_prefilled(spec.prompt, first_token, kv_t, spec.params, now=now, request_id=spec.request_id,
                                 priority=spec.priority, deadline_ms=spec.deadline_ms,
                                 deadline_kind=spec.deadline_kind, arrival=arrival,
                                 first_token_time=arrival + max(0.0, ttft_s), constraint=spec.constraint,
                                 first_logprob=first_logprob)
            return time.perf_counter() - t0

        return await eng.call(take)

    def abort(self, request_id: str) -> None:
        if self._engine is not None:
            self._engine.abort(request_id)

    # --- outputs and stats ---------------------------------------------------------------
    def on_step(self, rec: StepRecord) -> None:  # engine thread: list.append is atomic
        self._steps.append(rec)

    def post(self, outs: list[RequestOutput]) -> None:  # event loop
        box = self._outbox
        for out in outs:
            prev = box.get(out.request_id)
            box[out.request_id] = out if prev is None else merge_outputs(prev, out)
        self._wake.set()

    async def pull(self, with_hashes: bool = False) -> tuple[list[RequestOutput], list[StepRecord], ReplicaStats]:
        """Everything new since the last pull; waits up to PULL_WAIT_S for something to say."""
        if not self._outbox:
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), PULL_WAIT_S)
            except asyncio.TimeoutError:
                pass
        outs, self._outbox = list(self._outbox.values()), {}
        steps, self._steps = self._steps, []
        stats = await self._engine.call(lambda e: replica_stats(e, with_hashes))
        return outs, steps, stats
