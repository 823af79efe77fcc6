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

    python -m batchserve.sim.cluster --out projection.md   # the 8-GPU projection (main below)
"""
from __future__ import annotations

import argparse
import datetime
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from batchserve.bench.metrics import RequestRecord, span_s, summarize
from batchserve.bench.workload import WorkItem, make_workload
from batchserve.config import EngineConfig, SchedulerConfig
from batchserve.core.batch import RequestOutput
from batchserve.core.kv_cache import prefix_hashes
from batchserve.distributed.replica import NUM_PRIORITIES, queued_work
from batchserve.distributed.routing import PER_WAITING, Candidate, layout, rank
from batchserve.engine.clock import SimClock
from batchserve.engine.engine import LLMEngine
from batchserve.request import OverloadedError, RequestError, SamplingParams
from batchserve.sim.cost import CostModel, RooflineCost
from batchserve.sim.events import Arrival, EventQueue, Kind
from batchserve.sim.executor import SimExecutor
from batchserve.sim.hardware import GPUS, MODELS
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


# --- the projection ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """One way to use the GPUs. `independent` = K > 0: K single engines, each fed its own
    workload of n / K requests at rate / K (a different seed each), their records pooled: K
    GPUs with no router at all, each taking a fixed share of the traffic."""

    label: str
    replicas: int = 1
    prefill: int = 0
    decode: int = 0
    routing: str = "rank"
    independent: int = 0


def default_layouts(gpus: int, routings: Sequence[str] = ("rank", "random")) -> list[Layout]:
    out = [Layout(f"{gpus} x 1 GPU at rate/{gpus}", independent=gpus)]
    out += [Layout(f"{gpus} replicas, {r}", replicas=gpus, routing=r) for r in routings]
    splits = [(gpus // 2, gpus - gpus // 2), (gpus // 4, gpus - gpus // 4), (gpus - gpus // 4, gpus // 4)]
    seen = set()
    for p, d in splits:
        if p >= 1 and d >= 1 and (p, d) not in seen:
            seen.add((p, d))
            out.append(Layout(f"{p}P+{d}D", prefill=p, decode=d))
    return out


def run_layout(layout: Layout, config: EngineConfig, cost: CostModel, workload: dict[str, Any], rate: float,
               slo_ms: float | None, seed: int = 0, **kw: Any) -> ClusterResult:
    if layout.independent:
        return run_independent(layout.independent, config, cost, workload, rate, slo_ms, seed)
    items = make_workload(**{**workload, "rate": rate})
    sim = ClusterSimulator(config, cost, replicas=layout.replicas, prefill=layout.prefill, decode=layout.decode,
                           routing=layout.routing, seed=seed, slo_ms=slo_ms, token_times=False, **kw)
    return sim.run(items)


def run_independent(k: int, config: EngineConfig, cost: CostModel, workload: dict[str, Any], rate: float,
                    slo_ms: float | None, seed: int = 0) -> ClusterResult:
    """K one-engine runs at rate / K, n / K requests each, summarized as one: statistically
    what random placement gives (a Poisson stream split at random is K Poisson streams)."""
    n = max(1, workload["n"] // k)
    runs = []
    for j in range(k):
        seed_j = workload.get("seed", 0) + 1000 * (j + 1)
        items = make_workload(**{**workload, "n": n, "rate": rate / k, "seed": seed_j})
        runs.append(ClusterSimulator(config, cost, replicas=1, seed=seed, slo_ms=slo_ms, token_times=False).run(items))
    records = [r for res in runs for r in res.records]
    duration = max(span_s(res.records) for res in runs)  # each run starts at its first arrival
    engines = [dict(e, key=j) for j, res in enumerate(runs) for e in res.engines]
    return ClusterResult(records, summarize(records, duration, slo_ms), engines, runs[0].handoff,
                         {"max": 0, "mean": 0.0}, sum(res.wall_s for res in runs),
                         max(res.arrival_window_s for res in runs), sum(res.sustained_tok_s for res in runs))


def row_of(layout: Layout, rate: float, res: ClusterResult) -> dict[str, Any]:
    s, lat = res.summary, res.summary["latency"]
    busy = [e["busy_arriving"] for e in res.engines]
    return {"rate": rate, "layout": layout.label, "independent": layout.independent,
            "tok_s": s["output_tokens_per_s"], "sustained_tok_s": res.sustained_tok_s,
            "goodput_rps": s["goodput_rps"], "goodput_frac": s["goodput_frac"],
            "n_ok": s["n_ok"], "n_requests": s["n_requests"],
            **{f"{m}_{q}": lat[f"{m}_ms"][q] for m in ("ttft", "tpot", "e2e") for q in ("p50", "p99")},
            "busy_min": min(busy), "busy_max": max(busy),
            "busy_prefill": _mean([e["busy_arriving"] for e in res.engines if e["role"] == "prefill"]),
            "busy_decode": _mean([e["busy_arriving"] for e in res.engines if e["role"] == "decode"]),
            "handoff_gb": res.handoff["bytes"] / 1e9, "handoff_s": res.handoff["seconds"],
            "handoff_ms": res.handoff["mean_ms"],
            "link_gbytes_s": max((e["handoff_bytes"] for e in res.engines), default=0) / 1e9
            / max(res.arrival_window_s, 1e-9),
            "imbalance_max": res.imbalance["max"], "wall_s": res.wall_s}


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _ms(x: float | None) -> str:
    return "-" if x is None else (f"{x:.1f}" if x < 100 else f"{x:.0f}")


def format_table(rows: list[dict[str, Any]]) -> str:
    out = ["| rate req/s | layout | output tok/s steady / run | within SLO | TTFT p50 / p99 ms | TPOT p50 / p99 ms "
           "| E2E p50 / p99 ms | busy % | hand-off |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["busy_prefill"] is not None:
            busy = f"P {100 * r['busy_prefill']:.0f} / D {100 * r['busy_decode']:.0f}"
        else:
            lo, hi = f"{100 * r['busy_min']:.0f}", f"{100 * r['busy_max']:.0f}"
            busy = lo if lo == hi else f"{lo}-{hi}"
        hand = f"{r['handoff_gb']:.1f} GB, {r['handoff_ms']:.2f} ms each" if r["handoff_gb"] else "-"
        out.append(f"| {r['rate']:g} | {r['layout']} | {r['sustained_tok_s']:.0f} / {r['tok_s']:.0f} | "
                   f"{100 * r['goodput_frac']:.1f}% | "
                   f"{_ms(r['ttft_p50'])} / {_ms(r['ttft_p99'])} | {_ms(r['tpot_p50'])} / {_ms(r['tpot_p99'])} | "
                   f"{_ms(r['e2e_p50'])} / {_ms(r['e2e_p99'])} | {busy} | {hand} |")
    return "\n".join(out)


def observations(rows: list[dict[str, Any]], gpus: int, slo_ms: float, link_bytes_per_s: float) -> list[str]:
    """Statements read off the rows: routing, the best layout per rate, what disaggregation
    changes against rank-routed replicas, and the hand-off traffic."""
    by = {(r["rate"], r["layout"]): r for r in rows}
    rates = sorted({r["rate"] for r in rows})
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    rank_l, rand_l = f"{gpus} replicas, rank", f"{gpus} replicas, random"
    cluster = [lay for lay in layouts if (rates[0], lay) in by and not by[rates[0], lay]["independent"]]
    disagg = [lay for lay in layouts if "P+" in lay]
    notes = []
    top = rates[-1]
    if (top, rank_l) in by and (top, rand_l) in by:
        a, b = by[top, rank_l], by[top, rand_l]
        notes.append(f"Routing: at {top:g} req/s rank gives TTFT P99 {_ms(a['ttft_p99'])} ms, TPOT P99 "
                     f"{_ms(a['tpot_p99'])} ms and E2E P99 {_ms(a['e2e_p99'])} ms against {_ms(b['ttft_p99'])} / "
                     f"{_ms(b['tpot_p99'])} / {_ms(b['e2e_p99'])} ms for random placement; the widest queue spread "
                     f"between replicas at an arrival was {a['imbalance_max']} vs {b['imbalance_max']} requests.")
    best = []
    for rate in rates:
        cands = [by[rate, lay] for lay in cluster if (rate, lay) in by]
        if cands:  # the best, and whatever is within noise of it
            top_frac = max(r["goodput_frac"] for r in cands)
            top_tok = max(r["sustained_tok_s"] for r in cands if r["goodput_frac"] >= top_frac - 0.005)
            near = [r for r in cands
                    if r["goodput_frac"] >= top_frac - 0.005 and r["sustained_tok_s"] >= 0.99 * top_tok]
            best.append(f"{rate:g} req/s: {' & '.join(r['layout'] for r in near)} "
                        f"({100 * top_frac:.1f}% within, {top_tok:.0f} tok/s)")
    if best:
        notes.append(f"Best share within the SLO (E2E <= {slo_ms:.0f} ms), then steady throughput, ties within "
                     "0.5 points and 1% listed together — " + "; ".join(best) + ".")
    for lay in disagg:
        wins = [rate for rate in rates if (rate, lay) in by and (rate, rank_l) in by
                and by[rate, lay]["tpot_p99"] is not None and by[rate, rank_l]["tpot_p99"] is not None
                and by[rate, lay]["tpot_p99"] < by[rate, rank_l]["tpot_p99"]]
        if not wins:
            notes.append(f"{lay}: TPOT P99 is never below the rank-routed replicas' at the rates tried.")
            continue
        d, b = by[wins[-1], lay], by[wins[-1], rank_l]
        notes.append(f"{lay}: lower TPOT P99 than rank-routed replicas at {', '.join(f'{r:g}' for r in wins)} req/s "
                     f"(at {wins[-1]:g}: {_ms(d['tpot_p99'])} vs {_ms(b['tpot_p99'])} ms), with TTFT P99 "
                     f"{_ms(d['ttft_p99'])} vs {_ms(b['ttft_p99'])} ms and steady throughput "
                     f"{d['sustained_tok_s']:.0f} vs "
                     f"{b['sustained_tok_s']:.0f} tok/s.")
    hand = [r for r in rows if r["handoff_gb"]]
    if hand:
        per_req = max(r["handoff_gb"] * 1e9 / r["n_requests"] for r in hand)
        link = max(r["link_gbytes_s"] for r in hand)
        notes.append(f"Hand-off: {per_req / 1e6:.0f} MB of K/V per request on average, "
                     f"{max(r['handoff_ms'] for r in hand):.2f} ms each; the busiest prefill worker's link "
                     f"carried {link:.1f} GB/s on average while requests arrived, "
                     f"{100 * link * 1e9 / link_bytes_per_s:.0f}% of its {link_bytes_per_s / 1e9:g} GB/s.")
    return notes


def project(config: EngineConfig, cost: CostModel, workload: dict[str, Any], rates: Sequence[float],
            layouts: Sequence[Layout], slo_ms: float, seed: int = 0, seconds: float = 10.0, log: Any = None,
            **kw: Any) -> list[dict[str, Any]]:
    """Every layout at every rate. With workload["n"] 0, each point gets rate x seconds requests."""
    rows = []
    for rate in rates:
        wl = {**workload, "n": workload["n"] or max(1, round(rate * seconds))}
        for lay in layouts:
            res = run_layout(lay, config, cost, wl, rate, slo_ms, seed, **kw)
            rows.append(row_of(lay, rate, res))
            if log is not None:
                print(f"  {rate:g} req/s  {lay.label:<24} {res.wall_s:5.1f} s", file=log, flush=True)
    return rows


def report(a: argparse.Namespace, argv: Sequence[str] | None, config: EngineConfig, cost: RooflineCost,
           rates: list[float], rows: list[dict[str, Any]], table: str) -> str:
    """The markdown section: command, date, assumptions, table, observations."""
    sc = config.scheduler
    cmd = " ".join(["python -m batchserve.sim.cluster", *(argv if argv is not None else sys.argv[1:])])
    kv = kv_bytes_per_token(cost)
    link = a.link_gbps * 1e9 / 8
    lines = [
        f"## Ray: simulated projection on {a.gpus} GPUs", "",
        f"`{cmd}` ({datetime.date.today().isoformat()}; the real engine and scheduler on a virtual clock, "
        "`batchserve/sim/cluster.py`)", "",
        f"- GPU and model: {cost.name}. Step times come from the roofline model in `sim/cost.py`; its efficiency "
        "factors and 2 ms per-step overhead are assumptions (`sim/hardware.py`), not measurements. "
        f"{cost.num_blocks(config.cache.block_size)} KV blocks of {config.cache.block_size} tokens per GPU.",
        f"- Engine: policy `{sc.policy}`, max_num_seqs {sc.max_num_seqs}, max_num_batched_tokens "
        f"{sc.max_num_batched_tokens}; prefill workers hold at most {min(sc.max_num_seqs, sc.prefill_max_batch)} "
        "requests, as `serve --ray` configures them.",
        f"- Hand-off (xP+yD rows): prompt tokens x {kv} B ({kv // 1024} KiB: fp16 K and V, all layers) over "
        f"a {a.link_gbps:g} Gb/s ({link / 1e9:g} GB/s) link, plus {a.link_latency_us:g} µs per request; it "
        "adds to the gap between the first and second token. TTFT is the prefill worker's first token.",
        f"- Workload: `{a.workload}`{'' if a.scale is None else f' at scale {a.scale:g}'}, Poisson arrivals, "
        f"seed {a.seed}, "
        + (f"{a.requests} requests per point. " if a.requests else
           f"rate x {a.seconds:g} s of arrivals per point ({', '.join(str(round(r * a.seconds)) for r in rates)} "
           "requests). ")
        + f"The `{a.gpus} x 1 GPU` row is {a.gpus} separate single-engine runs, each with 1/{a.gpus} of the "
        f"requests at rate/{a.gpus}, pooled: no router, each GPU a fixed share of the traffic (statistically the "
        "same as random placement).",
        f"- Output tok/s: *steady* counts tokens delivered from {STEADY_FROM:.0%} into the arrivals to the last "
        "arrival (no warm-up, no drain); *run* is bench's figure, first arrival to last token. *Within SLO*: "
        f"share of requests that completed with E2E <= {a.slo_ms:.0f} ms (bench's goodput). Busy %: each "
        "engine's share of time in steps while requests arrive (min-max over replicas; P / D: mean over "
        "prefill / decode workers); an engine with any running request is always stepping, so for whole "
        "engines and decode workers this reads near 100% long before they saturate.",
        "- Routing: `distributed.routing.rank` on each engine's exact queue at the arrival instant (the live "
        "router's stats are up to 0.5 s old); disaggregated layouts route both stages with it.",
        "", table, "", "Read off the table:", "",
        *[f"- {n}" for n in observations(rows, a.gpus, a.slo_ms, link)], ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m batchserve.sim.cluster",
                                 description="Simulated multi-GPU projection: replicas vs disaggregated "
                                             "prefill/decode.")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--hardware", default="h100" if "h100" in GPUS else "a100-80gb")
    ap.add_argument("--model", default="llama-3-8b" if "llama-3-8b" in MODELS else "llama-2-7b")
    ap.add_argument("--workload", default="chat")
    ap.add_argument("--scale", type=float, default=None, help="multiply every length (default: the mix's own)")
    ap.add_argument("--seconds", type=float, default=10.0, help="arrivals per point: rate x this many seconds")
    ap.add_argument("--requests", type=int, default=0, help="a fixed request count per point instead")
    ap.add_argument("--rates", default="200,400,550,700", help="cluster-wide request rates (req/s)")
    ap.add_argument("--routings", default="rank,random", help=f"replica routings to compare, of {ROUTINGS}")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--prefill-max-batch", type=int, default=SchedulerConfig.prefill_max_batch)
    ap.add_argument("--link-gbps", type=float, default=8 * LINK_BYTES_PER_S / 1e9, help="hand-off link, Gbit/s")
    ap.add_argument("--link-latency-us", type=float, default=LINK_LATENCY_S * 1e6)
    ap.add_argument("--slo-ms", type=float, default=6000.0, help="end-to-end target for goodput")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="markdown file whose section this run replaces (or appends), e.g. BENCHMARKS.md")
    a = ap.parse_args(argv)

    cost = RooflineCost(a.hardware, a.model)
    config = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=a.max_num_seqs, prefill_max_batch=a.prefill_max_batch))
    rates = [float(x) for x in a.rates.split(",") if x.strip()]
    layouts = default_layouts(a.gpus, [r.strip() for r in a.routings.split(",") if r.strip()])
    workload = {"name_or_file": a.workload, "n": a.requests, "seed": a.seed, "scale": a.scale}
    link = {"link_bytes_per_s": a.link_gbps * 1e9 / 8, "link_latency_s": a.link_latency_us * 1e-6}
    t0 = time.perf_counter()
    rows = project(config, cost, workload, rates, layouts, a.slo_ms, a.seed, a.seconds, log=sys.stderr, **link)
    table = format_table(rows)
    print(table)
    print(f"[simulated in {time.perf_counter() - t0:.0f} s]", file=sys.stderr)
    if a.out:
        from batchserve.bench.foundation import write_section

        text = report(a, argv, config, cost, rates, rows, table)
        write_section(a.out, text.split("\n", 1)[0], text.rstrip() + "\n\n")  # replaces its section
        print(f"wrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
