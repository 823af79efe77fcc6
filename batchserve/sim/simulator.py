"""The simulator: the real LLMEngine (queue, scheduler, policy, KV manager) on a virtual clock.

Nothing here knows a policy. The loop does what the live engine's loop does (the async
engine's thread: drain the inbox, step, and when a step runs nothing wait for new work or
the policy's next due time), only in virtual time:

- ARRIVAL at t: the request is added at t if the engine is idle; if a step is in flight it
  waits in the inbox and is added when the step ends (the engine thread adds requests
  between steps), with that time as its engine-side arrival — the client-side send time
  stays t, as in `bench`.
- STEP_START at t: `engine.step(now=t)`. If a batch ran, its results are applied at
  t + step_time and a STEP_END is queued for then; if nothing ran (a window is collecting),
  the next try is at `engine.next_step_due(t)`, or after `idle_poll_s` (the live loop's
  poll) when the policy cannot say, or at the next arrival, whichever comes first.
- STEP_END at t: the step's outputs reach the clients (token and end times = t); queued
  arrivals are added; a STEP_START at t follows.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from batchserve.bench.metrics import RequestRecord, span_s, summarize
from batchserve.bench.workload import WorkItem
from batchserve.config import EngineConfig
from batchserve.core.batch import RequestOutput
from batchserve.engine.clock import SimClock
from batchserve.engine.engine import LLMEngine
from batchserve.request import OverloadedError, RequestError, SamplingParams
from batchserve.sim.cost import CostModel
from batchserve.sim.events import Arrival, EventQueue, StepEnd, StepStart
from batchserve.sim.executor import TOKEN_BASE, BatchKey, SimExecutor

IDLE_POLL_S = 0.002  # the async engine's wait when a step runs nothing (engine/async_engine.py)
MIN_WAKE_S = 1e-6  # a due time at or before `now` (rounding) is retried this much later


def record_output(rec: RequestRecord, out: RequestOutput, t: float, token_times: bool) -> bool:
    """What a client sees of `out` at virtual time `t`, into its record; True once finished."""
    if out.new_token_ids:
        if rec.first_token_time is None:
            rec.first_token_time = t
        if token_times:
            rec.token_times.append(t)
    if out.finished:
        rec.end_time, rec.finish_reason, rec.error = t, out.finish_reason, out.error
        rec.output_tokens = len(out.token_ids)
    return out.finished


class SimulationStuck(RuntimeError):
    """Work is left but nothing can run and nothing will arrive."""


@dataclass
class SimResult:
    """One simulated run: a record per workload item (bench's RequestRecord, virtual times),
    the summary bench would print, and engine-side counters."""

    records: list[RequestRecord]
    summary: dict[str, Any]
    num_steps: int
    busy_s: float
    wall_s: float
    timeline: list[dict[str, Any]] = field(default_factory=list)
    batches: list[tuple[float, BatchKey]] = field(default_factory=list)
    engine_stats: dict[str, Any] = field(default_factory=dict)


def prompt_ids(item: WorkItem, index: int) -> list[int]:
    """The item's token ids, or (a text prompt and no tokenizer here) `prompt_len` ordinary
    ids unique to the request, so prefix caching shares nothing by accident."""
    if item.prompt_token_ids is not None:
        return item.prompt_token_ids
    base = TOKEN_BASE + (index * 7919) % 20000
    return [base + (k * 31) % 9973 for k in range(item.prompt_len)]


class Simulator:
    """Runs a workload through a fresh engine built from `config` over a SimExecutor."""

    def __init__(self, config: EngineConfig, cost: CostModel, *, num_blocks: int | None = None,
                 token_times: bool = True, timeline_dt: float = 0.1, record_batches: bool = False,
                 idle_poll_s: float = IDLE_POLL_S, slo_ms: float | None = None,
                 max_idle_polls: int = 1_000_000) -> None:
        self.config = config
        self.cost = cost
        self.executor = SimExecutor(cost, config.cache.block_size, num_blocks or config.cache.num_blocks,
                                    record=record_batches)
        self.clock = SimClock()
        self.engine = LLMEngine(config, self.executor, tokenizer=None, eos_token_id=None, clock=self.clock)
        self.token_times = token_times
        self.timeline_dt = timeline_dt
        self.idle_poll_s = idle_poll_s
        self.slo_ms = slo_ms
        self.max_idle_polls = max_idle_polls

    def run(self, items: Sequence[WorkItem]) -> SimResult:
        wall0 = time.perf_counter()
        eng, ex = self.engine, self.executor
        events = EventQueue()
        records: dict[str, RequestRecord] = {}
        order: list[RequestRecord] = []
        inbox: list[int] = []
        timeline: list[dict[str, Any]] = []
        batches: list[tuple[float, BatchKey]] = []
        busy = False
        generation = 0  # only the newest STEP_START is live
        pending_start: float | None = None
        next_item = 0
        idle_polls = 0
        next_sample = 0.0

        arrival_order = sorted(range(len(items)), key=lambda k: items[k].arrival)  # stable: ties keep order

        def push_arrival() -> None:  # one pending arrival at a time keeps the heap small
            nonlocal next_item
            if next_item < len(items):
                k = arrival_order[next_item]
                events.push(Arrival(items[k].arrival, k))
                next_item += 1

        def start_at(t: float) -> None:
            nonlocal generation, pending_start
            if busy or (pending_start is not None and pending_start <= t):
                return
            generation += 1
            pending_start = t
            events.push(StepStart(t, generation))

        def add(i: int, now: float) -> None:
            item = items[i]
            rec = RequestRecord(id=f"r{i}", cls=item.cls, priority=item.priority, send_time=item.arrival,
                                prompt_tokens=item.prompt_len, deadline_ms=item.deadline_ms,
                                deadline_kind=item.deadline_kind)
            order.append(rec)
            params = SamplingParams(max_tokens=item.max_tokens, temperature=0.0, ignore_eos=True)
            try:
                eng.add_request(prompt_ids(item, i), params, now=now, request_id=rec.id, priority=item.priority,
                                deadline_ms=item.deadline_ms, deadline_kind=item.deadline_kind)
            except OverloadedError as e:
                rec.status, rec.error, rec.retry_after_s, rec.end_time = 503, str(e), e.retry_after_s, now
                return
            except RequestError as e:
                rec.status, rec.error, rec.end_time = 400, str(e), now
                return
            rec.status = 200
            records[rec.id] = rec

        def deliver(outs: list[RequestOutput], t: float) -> None:
            for out in outs:
                rec = records.get(out.request_id)
                if rec is not None and record_output(rec, out, t, self.token_times):
                    del records[out.request_id]

        def step(t: float) -> None:
            nonlocal busy, idle_polls, next_sample
            n_before = ex.num_steps
            outs = eng.step(now=t).outputs
            if ex.num_steps != n_before:
                if ex.trace is not None:
                    batches.append((t, ex.trace[-1]))
                dt = ex.last_step_time
                busy, idle_polls = True, 0
                if t >= next_sample:
                    timeline.append(self._sample(t))
                    next_sample = t + self.timeline_dt
                events.push(StepEnd(t + dt, t, outs))
                return
            deliver(outs, t)
            if eng.has_unfinished:
                idle_polls += 1
                if idle_polls > self.max_idle_polls:
                    raise SimulationStuck(f"at t={t:.3f}s: {len(eng.scheduler.requests)} requests left, "
                                          f"{self.max_idle_polls} steps in a row ran nothing")
                due = eng.next_step_due(t)
                due = t + self.idle_poll_s if due is None else max(due, t + MIN_WAKE_S)
                start_at(due)

        push_arrival()
        while len(events):
            ev = events.pop()
            if isinstance(ev, Arrival):
                push_arrival()
                if busy:
                    inbox.append(ev.index)
                else:
                    add(ev.index, ev.time)
                    start_at(ev.time)
            elif isinstance(ev, StepEnd):
                busy = False
                self.clock.set(ev.time)
                deliver(ev.outputs, ev.time)
                for i in inbox:
                    add(i, ev.time)
                inbox.clear()
                if eng.has_unfinished:
                    start_at(ev.time)
            elif ev.generation == generation:
                pending_start = None
                self.clock.set(ev.time)
                step(ev.time)
        if eng.has_unfinished or records:
            raise SimulationStuck(f"{len(eng.scheduler.requests)} requests unfinished with no event left")
        duration = span_s(order) if order else 0.0
        summary = summarize(order, duration, self.slo_ms) if duration > 0 else {}
        return SimResult(order, summary, ex.num_steps, ex.busy_time, time.perf_counter() - wall0,
                         timeline, batches, self._engine_stats())

    def _sample(self, t: float) -> dict[str, Any]:
        """Engine state as a timeline point, named as the server's /metrics gauges are, so
        bench's timeline plot reads simulated and polled runs alike."""
        sched = self.engine.scheduler
        pol = sched.policy
        return {"t": t, "values": {"batchserve:requests_waiting": float(len(sched.waiting)),
                                   "batchserve:requests_running": float(len(sched.running)),
                                   "batchserve:kv_cache_usage": self.engine.kv.usage,
                                   "batchserve:scheduling_window_ms": float(pol.window_ms),
                                   "batchserve:max_batch": float(pol.max_batch)}}

    def _engine_stats(self) -> dict[str, Any]:
        sched, pol = self.engine.scheduler, self.engine.scheduler.policy
        useful = getattr(pol, "useful_tokens", 0)
        total = pol.padding_tokens + useful
        return {"num_preemptions": sched.num_preemptions, "kv_blocks": self.executor.num_blocks,
                "block_size": self.config.cache.block_size, "busy_s": self.executor.busy_time,
                "steps": self.executor.num_steps, "tokens_computed": self.executor.num_tokens,
                "padding_tokens": pol.padding_tokens, "num_batches": getattr(pol, "num_batches", None),
                "padding_fraction": pol.padding_tokens / total if total else 0.0}

