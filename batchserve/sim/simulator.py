"""The simulator: the real LLMEngine (queue, scheduler, policy, KV manager) on a virtual clock.

Nothing here knows a policy, and nothing here runs events: a Simulator is the event loop of
sim/loop.py over a single engine node (every arrival goes to it), plus what a one-engine run
reports — bench's records and summary, a timeline of the engine's gauges, and, on request,
every batch with its start time. The loop's docstring states the timing rules (arrivals wait
in the inbox while a step is in flight; a step that runs nothing retries at the policy's due
time or after a poll; a step's outputs reach clients when it ends).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from batchserve.bench.metrics import SLO, RequestRecord, span_s, summarize
from batchserve.bench.workload import WorkItem
from batchserve.config import EngineConfig
from batchserve.core.batch import StepRecord
from batchserve.sim.cost import CostModel
from batchserve.sim.executor import BatchKey
from batchserve.sim.loop import IDLE_POLL_S, MIN_WAKE_S, SimLoop, SimNode, SimulationStuck, prompt_ids, record_output

__all__ = ["IDLE_POLL_S", "MIN_WAKE_S", "SimResult", "SimulationStuck", "Simulator", "engine_stats", "prompt_ids",
           "record_output"]


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


def _only_node(stage: str, priority: int, ids: list[int]) -> list[int]:
    """The route of a one-node loop: every request to node 0 (it never hands off)."""
    return [0]


class Simulator:
    """Runs a workload through a fresh engine built from `config` over a SimExecutor: the
    loop over one node, which every arrival is routed to. `engine`, `executor` and `clock`
    are that node's, for callers that drive or inspect the engine directly. `slo_ms`, `slo`
    and `class_slo` are `bench.metrics.summarize`'s: the summary's goodput and attainment."""

    def __init__(self, config: EngineConfig, cost: CostModel, *, num_blocks: int | None = None,
                 token_times: bool = True, timeline_dt: float = 0.1, record_batches: bool = False,
                 idle_poll_s: float = IDLE_POLL_S, slo_ms: float | None = None, slo: SLO | None = None,
                 class_slo: dict[str, SLO] | None = None,
                 max_idle_polls: int = 1_000_000) -> None:
        self.config = config
        self.cost = cost
        self.node = SimNode(0, "both", config, cost, num_blocks, record=record_batches, name="")
        self.executor, self.clock, self.engine = self.node.executor, self.node.clock, self.node.engine
        self.token_times = token_times
        self.timeline_dt = timeline_dt
        self.idle_poll_s = idle_poll_s
        self.slo_ms = slo_ms
        self.slo, self.class_slo = slo, class_slo
        self.max_idle_polls = max_idle_polls

    def run(self, items: Sequence[WorkItem]) -> SimResult:
        """Every item through the engine; the engine keeps its state between runs."""
        wall0 = time.perf_counter()
        ex = self.executor
        timeline: list[dict[str, Any]] = []
        batches: list[tuple[float, BatchKey]] = []
        next_sample = 0.0

        def on_step(node: SimNode, t: float, ran: StepRecord) -> None:
            """A batch started at t: trace it, and sample the gauges every timeline_dt."""
            nonlocal next_sample
            if ex.trace is not None:
                batches.append((t, ex.trace[-1]))
            if t >= next_sample:
                timeline.append(self._sample(t))
                next_sample = t + self.timeline_dt

        loop = SimLoop([self.node], items, _only_node, token_times=self.token_times,
                       idle_poll_s=self.idle_poll_s, max_idle_polls=self.max_idle_polls, on_step=on_step)
        order = loop.run()
        # a run whose every request was refused at once spans no time: its rates are 0, not undefined
        duration = max(span_s(order), 1e-9) if order else 0.0
        summary = summarize(order, duration, self.slo_ms, self.slo, self.class_slo) if order else {}
        return SimResult(order, summary, ex.num_steps, ex.busy_time, time.perf_counter() - wall0,
                         timeline, batches, engine_stats(self.engine, ex))

    def _sample(self, t: float) -> dict[str, Any]:
        """Engine state as a timeline point, named as the server's /metrics gauges are, so
        bench's timeline plot reads simulated and polled runs alike."""
        sched = self.engine.scheduler
        pol = sched.policy
        return {"t": t, "values": {"batchserve:requests_waiting": float(len(sched.waiting)),
                                   "batchserve:requests_running": float(len(sched.running)),
                                   "batchserve:kv_cache_usage": self.engine.kv.usage,
                                   "batchserve:scheduling_window_seconds": float(pol.window_ms) / 1000,
                                   "batchserve:max_batch": float(pol.max_batch)}}


def engine_stats(engine: Any, executor: Any) -> dict[str, Any]:
    """A run's engine-side counters: the scheduler's and policy's, and the executor's
    `num_blocks`, `busy_time`, `num_steps` and `num_tokens` (a SimExecutor's, or a live
    runner's wrapper that counts the same)."""
    sched, pol = engine.scheduler, engine.scheduler.policy
    useful = getattr(pol, "useful_tokens", 0)
    total = pol.padding_tokens + useful
    return {"num_preemptions": sched.num_preemptions, "kv_blocks": executor.num_blocks,
            "block_size": engine.config.cache.block_size, "busy_s": executor.busy_time,
            "steps": executor.num_steps, "tokens_computed": executor.num_tokens,
            "padding_tokens": pol.padding_tokens, "num_batches": getattr(pol, "num_batches", None),
            "padding_fraction": pol.padding_tokens / total if total else 0.0}

