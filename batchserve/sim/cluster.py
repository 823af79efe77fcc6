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

Each engine is the real LLMEngine over its own SimExecutor and SimClock, stepped exactly as
`simulator.py` steps its one engine: an arrival is added at once if its engine is idle, else it
waits in that engine's inbox until the running step ends; a step that runs nothing retries at
the policy's due time or after a poll. The router reads each engine's queue at the instant of
the arrival (no stale stats); requests sitting in an inbox count as the router's `pending`, as
in the live router. A queue that refuses a request sends it to the next engine in the router's
order; when every engine refuses, the client gets a 503.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from batchserve.bench.metrics import RequestRecord, span_s, summarize
from batchserve.bench.workload import WorkItem
from batchserve.config import EngineConfig
from batchserve.core.batch import RequestOutput
from batchserve.core.kv_cache import prefix_hashes
from batchserve.distributed.replica import NUM_PRIORITIES, queued_work
from batchserve.distributed.routing import PER_WAITING, Candidate, layout, rank
from batchserve.engine.clock import SimClock
from batchserve.engine.engine import LLMEngine
from batchserve.request import OverloadedError, RequestError, SamplingParams
from batchserve.sim.cost import CostModel
from batchserve.sim.events import Arrival, EventQueue, Kind
from batchserve.sim.executor import SimExecutor
from batchserve.sim.simulator import IDLE_POLL_S, MIN_WAKE_S, SimulationStuck, prompt_ids, record_output

ROUTINGS = ("rank", "random", "round_robin")
LINK_BYTES_PER_S = 25e9  # 200 Gb/s InfiniBand
LINK_LATENCY_S = 50e-6
STEADY_FROM = 0.4  # the steady-throughput window starts this far into the arrivals


# --- events (ordered as in events.py: step ends, then arrivals, then step starts) ---------------
@dataclass(frozen=True)
class KVArrival:
    """A prefilled request (first token sampled, K/V sent) reaches the decode side."""

    time: float
    index: int
    first_token: int
    kind: Kind = field(default=Kind.ARRIVAL, init=False)


@dataclass(frozen=True)
class EngineStart:
    time: float
    node: int
    generation: int
    kind: Kind = field(default=Kind.STEP_START, init=False)


@dataclass(frozen=True)
class EngineEnd:
    time: float
    node: int
    start: float
    outputs: list[RequestOutput]
    kind: Kind = field(default=Kind.STEP_END, init=False)


@dataclass(frozen=True)
class KVStandIn:
    """What a decode engine adopts in place of the K/V tensor: only its shape
    [layers, 2, tokens, kv_heads, head_dim] matters (add_prefilled checks the token count)."""

    tokens: int

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (0, 2, self.tokens, 0, 0)


@dataclass
class _Job:
    """A request on its way into an engine: new (first_token None) or prefilled."""

    index: int
    first_token: int | None
    rest: list[int]  # engines the router ranked and not yet tried, best first
    cost: int  # what the router counts it as until the engine shows it (prompt-token units)


class _Node:
    """One engine with its loop state (the simulator's locals, per engine)."""

    def __init__(self, key: int, role: str, config: EngineConfig, cost: CostModel, num_blocks: int | None) -> None:
        self.key, self.role = key, role
        self.executor = SimExecutor(cost, config.cache.block_size, num_blocks or config.cache.num_blocks)
        self.clock = SimClock()
        self.engine = LLMEngine(config, self.executor, tokenizer=None, eos_token_id=None, clock=self.clock)
        self.inbox: list[tuple[_Job, int]] = []  # (job, priority)
        self.busy = False
        self.generation = 0
        self.pending_start: float | None = None
        self.idle_polls = 0
        self.routed = 0
        self.busy_arriving_s = 0.0  # step time spent while requests were still arriving
        self.handoff_bytes = 0  # K/V this (prefill) engine sent

    def candidate(self, with_prefix: bool) -> Candidate:
        """The engine as the router sees it: exact queue contents now, inbox as pending."""
        sched = self.engine.scheduler
        waiting, tokens = queued_work(sched)
        pending = [0] * NUM_PRIORITIES
        for job, prio in self.inbox:
            pending[prio] += job.cost
        prefix = self.engine.kv.cached_hashes() if with_prefix and self.engine.kv.prefix_caching else None
        return Candidate(self.key, tokens, waiting, len(sched.running), pending, prefix)

    @property
    def depth(self) -> int:
        """Requests here: waiting, running and in the inbox."""
        sched = self.engine.scheduler
        return len(sched.waiting) + len(sched.running) + len(self.inbox)


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
                 slo_ms: float | None = None, max_idle_polls: int = 1_000_000) -> None:
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
        self.max_idle_polls = max_idle_polls
        self.prefix_routing = config.cache.prefix_caching  # entry (prefill) engines only, as the router does
        specs = layout(config, replicas, prefill, decode)
        self.nodes = [_Node(k, role, cfg, cost, num_blocks) for k, (role, cfg) in enumerate(specs)]
        self._rr = {"entry": 0, "decode": 0}

    # --- routing ---------------------------------------------------------------------------
    def _route(self, pool: list[_Node], stage: str, priority: int, ids: list[int]) -> list[int]:
        """Engine keys in the order to try."""
        keys = [n.key for n in pool]
        if self.routing == "rank":
            with_prefix = self.prefix_routing and stage == "entry"
            hashes = prefix_hashes(ids, self.config.cache.block_size) if with_prefix else None
            return rank([n.candidate(hashes is not None) for n in pool], priority, hashes, self.rng,
                        len(ids), self.config.cache.block_size)
        if self.routing == "random":
            first = self.rng.randrange(len(keys))
        else:
            first = self._rr[stage] % len(keys)
            self._rr[stage] += 1
        return keys[first:] + keys[:first]

    # --- the loop ---------------------------------------------------------------------------
    def run(self, items: Sequence[WorkItem]) -> ClusterResult:
        wall0 = time.perf_counter()
        nodes = self.nodes
        entry = [n for n in nodes if n.role in ("both", "prefill")]
        decoders = [n for n in nodes if n.role == "decode"]
        events = EventQueue()
        recs: list[RequestRecord | None] = [None] * len(items)
        order: list[RequestRecord] = []
        ids_of: dict[int, list[int]] = {}
        live: dict[str, int] = {}  # request id -> workload index, while an engine holds it
        handoff = {"count": 0, "tokens": 0, "bytes": 0, "seconds": 0.0}
        spread_max, spread_sum, spread_n = 0, 0, 0
        arrival_order = sorted(range(len(items)), key=lambda k: items[k].arrival)  # stable
        next_item = 0
        first_arrival = min((it.arrival for it in items), default=0.0)
        last_arrival = max((it.arrival for it in items), default=0.0)
        # throughput is also counted in a steady window: from 40% into the arrivals (after
        # the warm-up, while the running population builds) to the last one (before the drain)
        steady_from = first_arrival + STEADY_FROM * (last_arrival - first_arrival)
        steady_tokens = 0

        def push_arrival() -> None:  # one pending client arrival keeps the heap small
            nonlocal next_item
            if next_item < len(items):
                k = arrival_order[next_item]
                events.push(Arrival(items[k].arrival, k))
                next_item += 1

        def start_at(node: _Node, t: float) -> None:
            if node.busy or (node.pending_start is not None and node.pending_start <= t):
                return
            node.generation += 1
            node.pending_start = t
            events.push(EngineStart(t, node.key, node.generation))

        def place(job: _Job, now: float) -> None:
            """Hand `job` to its first choice: added now when that engine is idle, else queued
            for its next step boundary."""
            node = nodes[job.rest.pop(0)]
            node.routed += 1
            if node.busy:
                node.inbox.append((job, items[job.index].priority))
            else:
                admit(node, job, now)
                start_at(node, now)

        def admit(node: _Node, job: _Job, now: float) -> None:
            item, rec = items[job.index], recs[job.index]
            ids = ids_of[job.index]
            params = SamplingParams(max_tokens=item.max_tokens, temperature=0.0, ignore_eos=True)
            opts = {"now": now, "request_id": rec.id, "priority": item.priority, "deadline_ms": item.deadline_ms,
                    "deadline_kind": item.deadline_kind}
            try:
                if job.first_token is None:
                    node.engine.add_request(ids, params, **opts)
                else:
                    node.engine.add_prefilled(ids, job.first_token, KVStandIn(len(ids)), params,
                                              arrival=item.arrival, **opts)  # deadlines count from arrival
            except OverloadedError as e:
                if job.rest:  # the router tries its next choice
                    place(job, now)
                    return
                end(rec, now, e)
                return
            except RequestError as e:
                end(rec, now, e)
                return
            rec.status = 200
            live[rec.id] = job.index

        def end(rec: RequestRecord, now: float, e: Exception) -> None:
            """A request no engine took: a 503/400 before any output, an error after one."""
            live.pop(rec.id, None)
            rec.end_time, rec.error = now, str(e)
            if rec.status == 200:  # refused on the decode side: the stream had started
                rec.finish_reason = "error"
            elif isinstance(e, OverloadedError):
                rec.status, rec.retry_after_s = 503, e.retry_after_s
            else:
                rec.status = 400

        def deliver(node: _Node, outs: list[RequestOutput], t: float) -> None:
            nonlocal steady_tokens
            steady = steady_from <= t <= last_arrival
            for out in outs:
                index = live.get(out.request_id)
                if index is None:
                    continue
                if steady:
                    steady_tokens += len(out.new_token_ids)
                if record_output(recs[index], out, t, self.token_times):
                    del live[out.request_id]
                elif node.role == "prefill" and out.new_token_ids:
                    hand_off(node, index, out, t)

        def hand_off(node: _Node, index: int, out: RequestOutput, t: float) -> None:
            """The first token is out: free the request here, send its K/V to the decode side."""
            first, n = out.token_ids[0], len(out.prompt_token_ids)
            node.engine.hand_off(out.request_id, now=t)
            del live[out.request_id]
            nbytes = n * self.kv_bytes
            delay = nbytes / self.link_bytes_per_s + self.link_latency_s
            handoff["count"] += 1
            handoff["tokens"] += n
            handoff["bytes"] += nbytes
            handoff["seconds"] += delay
            node.handoff_bytes += nbytes
            events.push(KVArrival(t + delay, index, first))

        def step(node: _Node, t: float) -> None:
            eng, ex = node.engine, node.executor
            n_before = ex.num_steps
            outs = eng.step(now=t).outputs
            if ex.num_steps != n_before:
                node.busy, node.idle_polls = True, 0
                node.busy_arriving_s += max(0.0, min(t + ex.last_step_time, last_arrival) - t)
                events.push(EngineEnd(t + ex.last_step_time, node.key, t, outs))
                return
            deliver(node, outs, t)
            if eng.has_unfinished:
                node.idle_polls += 1
                if node.idle_polls > self.max_idle_polls:
                    raise SimulationStuck(f"engine {node.key} at t={t:.3f}s: {len(eng.scheduler.requests)} "
                                          f"requests left, {self.max_idle_polls} steps in a row ran nothing")
                due = eng.next_step_due(t)
                start_at(node, t + self.idle_poll_s if due is None else max(due, t + MIN_WAKE_S))

        push_arrival()
        while len(events):
            ev = events.pop()
            if isinstance(ev, Arrival):  # a workload item reaches the router
                push_arrival()
                i, item = ev.index, items[ev.index]
                rec = RequestRecord(id=f"r{i}", cls=item.cls, priority=item.priority, send_time=item.arrival,
                                    prompt_tokens=item.prompt_len, deadline_ms=item.deadline_ms,
                                    deadline_kind=item.deadline_kind)
                recs[i] = rec
                order.append(rec)
                ids_of[i] = ids = prompt_ids(item, i)
                if len(entry) > 1:
                    depths = [n.depth for n in entry]
                    spread = max(depths) - min(depths)
                    spread_max, spread_sum, spread_n = max(spread_max, spread), spread_sum + spread, spread_n + 1
                keys = self._route(entry, "entry", item.priority, ids)
                place(_Job(i, None, keys, len(ids) + PER_WAITING), ev.time)
            elif isinstance(ev, KVArrival):
                item = items[ev.index]
                keys = self._route(decoders, "decode", item.priority, ids_of[ev.index])
                place(_Job(ev.index, ev.first_token, keys, PER_WAITING), ev.time)
            elif isinstance(ev, EngineEnd):
                node = nodes[ev.node]
                node.busy = False
                node.clock.set(ev.time)
                deliver(node, ev.outputs, ev.time)
                jobs, node.inbox = node.inbox, []
                for job, _ in jobs:
                    admit(node, job, ev.time)
                if node.engine.has_unfinished:
                    start_at(node, ev.time)
            else:
                node = nodes[ev.node]
                if ev.generation == node.generation:
                    node.pending_start = None
                    node.clock.set(ev.time)
                    step(node, ev.time)

        left = [n.key for n in nodes if n.engine.has_unfinished]
        if left or live:
            raise SimulationStuck(f"engines {left} unfinished, {len(live)} requests open with no event left")
        duration = span_s(order) if order else 0.0
        summary = summarize(order, duration, self.slo_ms) if duration > 0 else {}
        window = last_arrival - first_arrival
        engines = [self._engine_stats(n, duration, window) for n in nodes]
        handoff["mean_ms"] = 1e3 * handoff["seconds"] / handoff["count"] if handoff["count"] else 0.0
        imbalance = {"max": spread_max, "mean": spread_sum / spread_n if spread_n else 0.0}
        sustained = steady_tokens / (last_arrival - steady_from) if last_arrival > steady_from else 0.0
        return ClusterResult(order, summary, engines, handoff, imbalance, time.perf_counter() - wall0, window,
                             sustained)

    @staticmethod
    def _engine_stats(node: _Node, duration: float, window: float) -> dict[str, Any]:
        """busy_frac: share of the whole run spent in steps; busy_arriving: the same while
        requests were still arriving (the drain at the end left out)."""
        ex = node.executor
        return {"key": node.key, "role": node.role, "routed": node.routed, "steps": ex.num_steps,
                "busy_s": ex.busy_time, "busy_frac": ex.busy_time / duration if duration > 0 else 0.0,
                "busy_arriving": node.busy_arriving_s / window if window > 0 else 0.0,
                "tokens_computed": ex.num_tokens, "preemptions": node.engine.scheduler.num_preemptions,
                "handoff_bytes": node.handoff_bytes}
