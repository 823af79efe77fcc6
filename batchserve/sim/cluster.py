"""Several engines on one virtual clock: the `serve --ray` layouts, simulated.

Two layouts, as `distributed/router.py` runs them:

- replicas: K whole engines; each arrival is placed by a router (`routing.rank`, the live
  router's power of two choices, or `random` / `round_robin` to compare against).
- disaggregated: P prefill engines and D decode engines. A request is placed on a prefill
  engine; the step that samples its first token ends it there (its blocks are freed, as the
  prefill replica does), and after a hand-off delay

      prompt_tokens * kv_bytes_per_token / link_bytes_per_s + link_latency_s

  it is placed on a decode engine, which adopts it with `LLMEngine.add_prefilled` and decodes
  the rest. TTFT is the prefill engine's first token; the request ends on the decode engine.

The engines are nodes of the one event loop in sim/loop.py, the loop the single-engine
simulator runs over one node; this module adds the router and the cluster's counters. The
router reads each engine's queue at the instant of the arrival (no stale stats); requests
sitting in an inbox count as the router's `pending`, as in the live router. A queue that
refuses a request sends it to the next engine in the router's order; when every engine
refuses, the client gets a 503.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any, Sequence

from batchserve.bench.metrics import SLO, RequestRecord, span_s, summarize
from batchserve.bench.workload import WorkItem
from batchserve.config import EngineConfig
from batchserve.core.batch import StepRecord
from batchserve.core.kv_cache import prefix_hashes
from batchserve.distributed.replica import NUM_PRIORITIES, queued_work
from batchserve.distributed.routing import Candidate, layout, rank
from batchserve.sim.cost import CostModel
from batchserve.sim.loop import IDLE_POLL_S, Link, SimLoop, SimNode

ROUTINGS = ("rank", "random", "round_robin")
LINK_BYTES_PER_S = 25e9  # 200 Gb/s InfiniBand
LINK_LATENCY_S = 50e-6
STEADY_FROM = 0.4  # the steady-throughput window starts this far into the arrivals


def candidate(node: SimNode, with_prefix: bool) -> Candidate:
    """The engine as the router sees it: exact queue contents now, inbox as pending."""
    sched = node.engine.scheduler
    waiting, tokens = queued_work(sched)
    pending = [0] * NUM_PRIORITIES
    for job in node.inbox:
        pending[job.priority] += job.cost
    prefix = node.engine.kv.cached_hashes() if with_prefix and node.engine.kv.prefix_caching else None
    return Candidate(node.key, tokens, waiting, len(sched.running), pending, prefix)


def depth(node: SimNode) -> int:
    """Requests on the node: waiting, running and in the inbox."""
    sched = node.engine.scheduler
    return len(sched.waiting) + len(sched.running) + len(node.inbox)


@dataclass
class ClusterResult:
    """One run: a RequestRecord per workload item (virtual times), bench's summary, and per
    engine and hand-off counters. `imbalance` is over the entry engines, sampled at each
    arrival: the spread (max - min) of requests waiting + running + in the inbox."""

    records: list[RequestRecord]
    summary: dict[str, Any]
    engines: list[dict[str, Any]]
    handoff: dict[str, float]
    imbalance: dict[str, float]
    wall_s: float
    arrival_window_s: float = 0.0  # first to last arrival
    sustained_tok_s: float = 0.0  # output tokens per second over the steady part (see run)


def kv_bytes_per_token(cost: CostModel) -> int:
    """K and V of one token, every layer, as the cost model's shape stores them."""
    kv = getattr(cost, "kv_tok", None) or getattr(getattr(cost, "profile", None), "kv_bytes_per_token", None)
    if not kv:
        raise ValueError(f"{cost.name}: no K/V size per token known; pass kv_bytes")
    return int(kv)


class ClusterSimulator:
    """K replicas (`replicas=K`) or P prefill + D decode engines (`prefill=P, decode=D`) over
    one config and cost model, on one virtual clock. `kv_bytes`: K/V bytes per token handed
    over (default: the cost model's shape). One `run` per instance: the engines keep state."""

    def __init__(self, config: EngineConfig, cost: CostModel, *, replicas: int = 1, prefill: int = 0,
                 decode: int = 0, routing: str = "rank", seed: int = 0, num_blocks: int | None = None,
                 link_bytes_per_s: float = LINK_BYTES_PER_S, link_latency_s: float = LINK_LATENCY_S,
                 kv_bytes: int | None = None, token_times: bool = True, idle_poll_s: float = IDLE_POLL_S,
                 slo_ms: float | None = None, slo: SLO | None = None,
                 class_slo: dict[str, SLO] | None = None, max_idle_polls: int = 1_000_000) -> None:
        if routing not in ROUTINGS:
            raise ValueError(f"routing: choose from {ROUTINGS}, got {routing!r}")
        if (prefill > 0) != (decode > 0):
            raise ValueError("disaggregated needs prefill >= 1 and decode >= 1")
        if prefill == 0 and replicas < 1:
            raise ValueError("replicas: must be >= 1")
        if link_bytes_per_s <= 0 or link_latency_s < 0:
            raise ValueError("link: bandwidth must be > 0 and latency >= 0")
        self.config = config
        self.cost = cost
        self.disaggregated = prefill > 0
        self.routing = routing
        self.rng = random.Random(seed)
        self.link_bytes_per_s = link_bytes_per_s
        self.link_latency_s = link_latency_s
        self.kv_bytes = kv_bytes if kv_bytes is not None else (kv_bytes_per_token(cost) if self.disaggregated else 0)
        self.token_times = token_times
        self.idle_poll_s = idle_poll_s
        self.slo_ms = slo_ms
        self.slo, self.class_slo = slo, class_slo
        self.max_idle_polls = max_idle_polls
        self.prefix_routing = config.cache.prefix_caching  # entry (prefill) engines only, as the router does
        specs = layout(config, replicas, prefill, decode)
        self.nodes = [SimNode(k, role, cfg, cost, num_blocks) for k, (role, cfg) in enumerate(specs)]
        self.pools = {"entry": [n for n in self.nodes if n.role in ("both", "prefill")],
                      "decode": [n for n in self.nodes if n.role == "decode"]}
        self._rr = {"entry": 0, "decode": 0}
        self._spread = [0, 0, 0]  # max, sum, count of the entry engines' depth spread

    # --- routing ---------------------------------------------------------------------------
    def route(self, stage: str, priority: int, ids: list[int]) -> list[int]:
        """Engine keys in the order to try, for a new request (stage "entry") or a hand-off
        ("decode"). Each new request first samples the entry engines' imbalance."""
        pool = self.pools[stage]
        if stage == "entry" and len(pool) > 1:
            depths = [depth(n) for n in pool]
            spread, s = max(depths) - min(depths), self._spread
            s[0], s[1], s[2] = max(s[0], spread), s[1] + spread, s[2] + 1
        keys = [n.key for n in pool]
        if self.routing == "rank":
            with_prefix = self.prefix_routing and stage == "entry"
            hashes = prefix_hashes(ids, self.config.cache.block_size) if with_prefix else None
            return rank([candidate(n, hashes is not None) for n in pool], priority, hashes, self.rng,
                        len(ids), self.config.cache.block_size)
        if self.routing == "random":
            first = self.rng.randrange(len(keys))
        else:
            first = self._rr[stage] % len(keys)
            self._rr[stage] += 1
        return keys[first:] + keys[:first]

    # --- a run ------------------------------------------------------------------------------
    def run(self, items: Sequence[WorkItem]) -> ClusterResult:
        """The workload through the cluster's loop. Besides bench's summary, throughput is
        counted in a steady window: from STEADY_FROM into the arrivals (after the warm-up,
        while the running population builds) to the last one (before the drain)."""
        wall0 = time.perf_counter()
        first_arrival = min((it.arrival for it in items), default=0.0)
        last_arrival = max((it.arrival for it in items), default=0.0)
        steady_from = first_arrival + STEADY_FROM * (last_arrival - first_arrival)
        busy_arriving = [0.0] * len(self.nodes)  # step time spent while requests were still arriving
        steady_tokens = 0
        self._spread = [0, 0, 0]

        def on_step(node: SimNode, t: float, ran: StepRecord) -> None:
            busy_arriving[node.key] += max(0.0, min(t + ran.step_time, last_arrival) - t)

        def on_delivered(t: float, tokens: int) -> None:
            nonlocal steady_tokens
            if steady_from <= t <= last_arrival:
                steady_tokens += tokens

        link = Link(self.kv_bytes, self.link_bytes_per_s, self.link_latency_s)
        loop = SimLoop(self.nodes, items, self.route, token_times=self.token_times, idle_poll_s=self.idle_poll_s,
                       max_idle_polls=self.max_idle_polls, link=link, on_step=on_step, on_delivered=on_delivered)
        order = loop.run()
        duration = span_s(order) if order else 0.0
        summary = summarize(order, duration, self.slo_ms, self.slo, self.class_slo) if duration > 0 else {}
        window = last_arrival - first_arrival
        engines = [self._engine_stats(n, busy_arriving[n.key], duration, window) for n in self.nodes]
        handoff = dict(loop.handoff)
        handoff["mean_ms"] = 1e3 * handoff["seconds"] / handoff["count"] if handoff["count"] else 0.0
        spread_max, spread_sum, spread_n = self._spread
        imbalance = {"max": spread_max, "mean": spread_sum / spread_n if spread_n else 0.0}
        sustained = steady_tokens / (last_arrival - steady_from) if last_arrival > steady_from else 0.0
        return ClusterResult(order, summary, engines, handoff, imbalance, time.perf_counter() - wall0, window,
                             sustained)

    @staticmethod
    def _engine_stats(node: SimNode, busy_arriving_s: float, duration: float, window: float) -> dict[str, Any]:
        """busy_frac: share of the whole run spent in steps; busy_arriving: the same while
        requests were still arriving (the drain at the end left out)."""
        ex = node.executor
        return {"key": node.key, "role": node.role, "routed": node.routed, "steps": ex.num_steps,
                "busy_s": ex.busy_time, "busy_frac": ex.busy_time / duration if duration > 0 else 0.0,
                "busy_arriving": busy_arriving_s / window if window > 0 else 0.0,
                "tokens_computed": ex.num_tokens, "preemptions": node.engine.scheduler.num_preemptions,
                "handoff_bytes": node.handoff_bytes}
