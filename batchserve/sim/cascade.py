"""Two-device cascade: prompts on a prefill device, decodes on a decode device, two clocks.

On one device `cascade_workers` puts both stages in every step, and the simulator charges
that as one step on one clock. Here the stages are two engines of the loop in sim/loop.py,
each over its own SimExecutor, clock and cost model (its own device: the same roofline or
another), and both run the real `cascade` policy. A request leaves the prefill engine with
its first token, so that engine only ever holds prompts and the policy's prefill stage forms
every batch there; the decode engine only adopts prefilled requests, so the policy's decode
stage forms every batch there. For a request of n prompt tokens:

    t_1  = end of the prefill step that samples its first token              (its TTFT)
    t_s  = the first of t_1 and the decode step ends after it at which
               seats_D < decode_max_batch  and  free_D >= ceil(n / block_size)
                                                                            (hand-off starts)
    d    = n * kv_bytes_per_token / link_bytes_per_s + link_latency_s       (hand-off time)
    t_a  = t_s + d                                                          (K/V on the decode device)
    t_2  = end of the first decode step that starts at or after t_a         (its second token)

    seats_D = requests the decode engine holds + hand-offs under way to it
    free_D  = free blocks of the decode device's pool (its cost model's, or `decode_blocks`)

Waiting hand-offs start first come, first served; one the decode pool could never hold to
its end goes at once, and the decode engine refuses it (an error after the first token, as in
cluster.py). From t_1 to t_a the prompt's K/V stays on the prefill device (its blocks held
there), and from t_s blocks for it are held on the decode device: a full decode device holds
prefill back (fewer free blocks to admit prompts into) rather than having prompts recomputed.
The two clocks run at once; over the run (first arrival to last end)

    span = busy_P + busy_D - overlap + idle     overlap: time both devices are in a step
                                                idle:    time neither is

so the run is shorter than the two devices' work laid end to end whenever they overlap more
than they both idle.
"""
from __future__ import annotations

import dataclasses
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Sequence

from batchserve.bench.metrics import SLO, RequestRecord, span_s, summarize
from batchserve.bench.workload import WorkItem
from batchserve.config import EngineConfig
from batchserve.core.batch import RequestOutput, StepRecord
from batchserve.sim.cluster import LINK_BYTES_PER_S, LINK_LATENCY_S, kv_bytes_per_token
from batchserve.sim.cost import CostModel
from batchserve.sim.events import KVArrival
from batchserve.sim.loop import IDLE_POLL_S, Job, Link, SimLoop, SimNode, SimulationStuck

PREFILL, DECODE = 0, 1  # node keys


def _route(stage: str, priority: int, ids: list[int]) -> list[int]:
    """New requests to the prefill device, hand-offs to the decode device."""
    return [PREFILL] if stage == "entry" else [DECODE]


def held_id(request_id: str) -> str:
    """The KV-pool name of blocks held for a request outside its engine's scheduler."""
    return f"{request_id}/handoff"


@dataclass
class Waiting:
    """A prefilled request waiting for a decode seat: workload index, first token, prompt
    length, when its first token came out, its request id."""

    index: int
    first_token: int
    tokens: int
    since: float
    request_id: str


class CascadeLoop(SimLoop):
    """The loop over [prefill node, decode node] with the hand-off rules of the module
    docstring. `ends` counts the finished outputs each request got (one each, at the end)."""

    def __init__(self, prefill: SimNode, decode: SimNode, items: Sequence[WorkItem], link: Link, seats: int,
                 **kw: Any) -> None:
        super().__init__([prefill, decode], items, _route, link=link, **kw)
        self.seats = seats
        self.waiting: deque[Waiting] = deque()
        self.incoming = 0  # hand-offs started and not yet adopted by the decode engine
        self.ends: Counter[str] = Counter()
        self.handoff["wait_s"] = 0.0  # t_s - t_1, summed

    def run(self) -> list[RequestRecord]:
        records = super().run()
        if self.waiting or self.incoming:
            w = self.waiting[0] if self.waiting else None
            need = f"; the first needs {self.nodes[DECODE].engine.kv.blocks_for(w.tokens)} blocks" if w else ""
            raise SimulationStuck(f"{len(self.waiting)} prefilled requests never got a decode seat, "
                                  f"{self.incoming} hand-offs unfinished{need}")
        return records

    def _deliver(self, node: SimNode, outs: list[RequestOutput], t: float) -> None:
        for out in outs:
            if out.finished:
                self.ends[out.request_id] += 1
        super()._deliver(node, outs, t)

    def _hand_off(self, node: SimNode, index: int, out: RequestOutput, t: float) -> None:
        """First token out: the request leaves the prefill engine, its K/V stays held there."""
        rid, n = out.request_id, len(out.prompt_token_ids)
        node.engine.hand_off(rid, now=t)
        node.engine.kv.allocate(held_id(rid), n)  # the blocks just freed: always fits
        del self._live[rid]
        self.waiting.append(Waiting(index, out.token_ids[0], n, t, rid))
        self._start_hand_offs(t)

    def _start_hand_offs(self, t: float) -> None:
        """Start every waiting hand-off, in order, that has a decode seat and blocks now."""
        dec = self.nodes[DECODE]
        sched, kv, link, h = dec.engine.scheduler, dec.engine.kv, self.link, self.handoff
        while self.waiting:
            w = self.waiting[0]
            never = kv.blocks_for(w.tokens + self.items[w.index].max_tokens) > kv.num_blocks  # refused there
            if not never and (len(sched.requests) + self.incoming >= self.seats
                              or kv.num_free_blocks < kv.blocks_for(w.tokens)):
                return
            self.waiting.popleft()
            kv.allocate(held_id(w.request_id), w.tokens)
            self.incoming += 1
            nbytes = w.tokens * link.kv_bytes
            delay = nbytes / link.bytes_per_s + link.latency_s
            h["count"] += 1
            h["tokens"] += w.tokens
            h["bytes"] += nbytes
            h["seconds"] += delay
            h["wait_s"] += t - w.since
            self.nodes[PREFILL].handoff_bytes += nbytes
            self.events.push(KVArrival(t + delay, w.index, w.first_token))

    def _kv_arrive(self, ev: KVArrival) -> None:
        """The K/V is across: its prefill-side blocks are free, which may let prompts in."""
        pre = self.nodes[PREFILL]
        pre.engine.kv.free(held_id(self._rec[ev.index].id))
        if pre.engine.has_unfinished:
            self._start_at(pre, ev.time)
        super()._kv_arrive(ev)

    def _admit(self, node: SimNode, job: Job, now: float) -> None:
        if job.first_token is not None:  # adopted now: the blocks held for it become its own
            node.engine.kv.free(held_id(self._rec[job.index].id))
            self.incoming -= 1
        super()._admit(node, job, now)
        if job.first_token is not None and self.waiting:  # a refused hand-off left its seat: the next may go
            self._start_hand_offs(now)

    def _step_end(self, ev: Any) -> None:
        super()._step_end(ev)
        if ev.node == DECODE and self.waiting:  # requests that ended left seats and blocks
            self._start_hand_offs(ev.time)


@dataclass
class CascadeResult:
    """One run: a RequestRecord per workload item (virtual times), bench's summary, per-device
    counters (`stages["prefill"]`, `stages["decode"]`), the hand-off totals, `overlap_s` (time
    both devices were in a step), `span_s` (first arrival to last end) and `ends` (finished
    outputs per request id)."""

    records: list[RequestRecord]
    summary: dict[str, Any]
    stages: dict[str, dict[str, Any]]
    handoff: dict[str, float]
    overlap_s: float
    span_s: float
    ends: dict[str, int]
    wall_s: float


def overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two sorted lists of disjoint intervals."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] <= b[j][1]:
            i += 1
        else:
            j += 1
    return total


class CascadeSimulator:
    """A prefill device and a decode device (module docstring) for a `cascade` config: the
    prefill engine holds at most `prefill_max_batch` requests, the decode device
    `decode_max_batch` seats. `decode_cost` defaults to `prefill_cost` (two of the same
    device); `prefill_blocks` / `decode_blocks` override the pools the cost models give;
    `kv_bytes` the K/V bytes per token handed over (default: the prefill cost's shape);
    `record_batches`: each device's executor keeps every batch (`executor.trace`).
    One `run` per instance: the engines keep state."""

    def __init__(self, config: EngineConfig, prefill_cost: CostModel, decode_cost: CostModel | None = None, *,
                 prefill_blocks: int | None = None, decode_blocks: int | None = None,
                 link_bytes_per_s: float = LINK_BYTES_PER_S, link_latency_s: float = LINK_LATENCY_S,
                 kv_bytes: int | None = None, token_times: bool = True, idle_poll_s: float = IDLE_POLL_S,
                 slo_ms: float | None = None, slo: SLO | None = None, class_slo: dict[str, SLO] | None = None,
                 max_idle_polls: int = 1_000_000, record_batches: bool = False) -> None:
        sc = config.scheduler
        if sc.policy != "cascade":
            raise ValueError(f"policy: the two-device cascade runs the 'cascade' policy, got {sc.policy!r}")
        if link_bytes_per_s <= 0 or link_latency_s < 0:
            raise ValueError("link: bandwidth must be > 0 and latency >= 0")
        decode_cost = decode_cost or prefill_cost
        self.config, self.seats = config, sc.decode_max_batch
        self.link = Link(kv_bytes if kv_bytes is not None else kv_bytes_per_token(prefill_cost),
                         link_bytes_per_s, link_latency_s)
        pre = dataclasses.replace(config, scheduler=dataclasses.replace(
            sc, max_num_seqs=min(sc.max_num_seqs, sc.prefill_max_batch)))
        dec = dataclasses.replace(config, scheduler=dataclasses.replace(sc, max_num_seqs=sc.decode_max_batch))
        self.prefill = SimNode(PREFILL, "prefill", pre, prefill_cost, prefill_blocks, record=record_batches,
                               name="prefill device")
        self.decode = SimNode(DECODE, "decode", dec, decode_cost, decode_blocks, record=record_batches,
                              name="decode device")
        self.nodes = [self.prefill, self.decode]
        self.loop_options = {"token_times": token_times, "idle_poll_s": idle_poll_s, "max_idle_polls": max_idle_polls}
        self.slo_ms, self.slo, self.class_slo = slo_ms, slo, class_slo

    def run(self, items: Sequence[WorkItem]) -> CascadeResult:
        wall0 = time.perf_counter()
        busy: list[list[tuple[float, float]]] = [[], []]  # each device's steps, in order

        def on_step(node: SimNode, t: float, ran: StepRecord) -> None:
            busy[node.key].append((t, t + ran.step_time))

        loop = CascadeLoop(self.prefill, self.decode, items, self.link, self.seats, on_step=on_step,
                           **self.loop_options)
        order = loop.run()
        span = span_s(order) if order else 0.0
        summary = summarize(order, span, self.slo_ms, self.slo, self.class_slo) if span > 0 else {}
        handoff = dict(loop.handoff)
        handoff["mean_ms"] = 1e3 * handoff["seconds"] / handoff["count"] if handoff["count"] else 0.0
        stages = {n.role: self._stage_stats(n, span) for n in self.nodes}
        return CascadeResult(order, summary, stages, handoff, overlap(busy[PREFILL], busy[DECODE]), span,
                             dict(loop.ends), time.perf_counter() - wall0)

    @staticmethod
    def _stage_stats(node: SimNode, span: float) -> dict[str, Any]:
        ex = node.executor
        return {"steps": ex.num_steps, "busy_s": ex.busy_time, "busy_frac": ex.busy_time / span if span > 0 else 0.0,
                "tokens_computed": ex.num_tokens, "kv_blocks": ex.num_blocks, "cost": ex.cost.name,
                "preemptions": node.engine.scheduler.num_preemptions, "handoff_bytes": node.handoff_bytes}
