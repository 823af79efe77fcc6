"""The simulator's one event loop: N engine nodes on one virtual clock.

Each node is the real LLMEngine over its own SimExecutor and SimClock, stepped as the async
engine's thread steps its engine (drain the inbox, step, and when a step runs nothing wait
for new work or the policy's next due time), only in virtual time. The single-engine
simulator is a loop over one node; the cluster simulator a loop over several. Events
(events.py) are all that moves work between nodes:

- ARRIVAL at t: a workload item reaches the server. `route` ranks the entry nodes; the
  request goes to the first. It is added at t if that node is idle; if a step is in flight it
  waits in the node's inbox and is added when the step ends (the engine thread adds requests
  between steps), with that time as its engine-side arrival — the client-side send time stays
  t, as in `bench`. A node that refuses it (OverloadedError) passes it to the next node in
  the ranking; when none is left the client gets a 503; a RequestError is a 400 at once.
- KV_ARRIVAL at t: a request prefilled on a prefill node reaches the decode side after the
  link's delay; it is routed over the decode nodes and placed as above, adopted there with
  `LLMEngine.add_prefilled`.
- STEP_START at t on a node: `engine.step(now=t)`. Only the newest start queued for a node is
  live (its generation). If a batch ran, a STEP_END follows at t + step_time; if nothing ran
  (a window is collecting), the next try is at `engine.next_step_due(t)`, or after
  `idle_poll_s` (the live loop's poll) when the policy cannot say, or at the next arrival,
  whichever comes first. `max_idle_polls` such steps in a row raise SimulationStuck.
- STEP_END at t: the step's outputs reach the clients (token and end times = t); on a prefill
  node a request's first token hands it off (`LLMEngine.hand_off` ends it there, a KV_ARRIVAL
  is queued); inbox requests are added; a STEP_START at t follows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from batchserve.bench.metrics import RequestRecord
from batchserve.bench.workload import WorkItem
from batchserve.config import EngineConfig
from batchserve.core.batch import RequestOutput, StepRecord
from batchserve.distributed.routing import PER_WAITING
from batchserve.engine.clock import SimClock
from batchserve.engine.engine import LLMEngine
from batchserve.request import OverloadedError, RequestError, SamplingParams
from batchserve.sim.cost import CostModel
from batchserve.sim.events import Arrival, EventQueue, KVArrival, StepEnd, StepStart
from batchserve.sim.executor import STOP_TOKEN, TOKEN_BASE, SimExecutor

IDLE_POLL_S = 0.002  # the async engine's wait when a step runs nothing (engine/async_engine.py)
MIN_WAKE_S = 1e-6  # a due time at or before `now` (rounding) is retried this much later

Route = Callable[[str, int, list[int]], list[int]]  # (stage, priority, prompt ids) -> node keys, best first
OnStep = Callable[["SimNode", float, StepRecord], None]  # (node, start time, what ran)
OnDelivered = Callable[[float, int], None]  # (time, new tokens that reached open requests)


class SimulationStuck(RuntimeError):
    """Work is left but nothing can run and nothing will arrive."""


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


def prompt_ids(item: WorkItem, index: int) -> list[int]:
    """The item's token ids, or (a text prompt and no tokenizer here) `prompt_len` ordinary
    ids unique to the request, so prefix caching shares nothing by accident."""
    if item.prompt_token_ids is not None:
        return item.prompt_token_ids
    base = TOKEN_BASE + (index * 7919) % 20000
    return [base + (k * 31) % 9973 for k in range(item.prompt_len)]


@dataclass(frozen=True)
class KVStandIn:
    """What a decode engine adopts in place of the K/V tensor: only its shape
    [layers, 2, tokens, kv_heads, head_dim] matters (add_prefilled checks the token count)."""

    tokens: int

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (0, 2, self.tokens, 0, 0)


@dataclass(frozen=True)
class Link:
    """The prefill-to-decode link: handing over n prompt tokens takes
    n * kv_bytes / bytes_per_s + latency_s."""

    kv_bytes: int  # K/V bytes per token
    bytes_per_s: float
    latency_s: float


@dataclass
class Job:
    """A request on its way into a node: new (first_token None) or prefilled."""

    index: int
    first_token: int | None
    rest: list[int]  # nodes the router ranked and not yet tried, best first
    cost: int  # what the router counts it as until the engine shows it (prompt-token units)
    priority: int


class SimNode:
    """One engine and its loop state: inbox, whether a step is in flight, the live STEP_START.
    `role` is "both" (whole engine), "prefill" or "decode"; `name` labels it in errors."""

    def __init__(self, key: int, role: str, config: EngineConfig, cost: CostModel, num_blocks: int | None,
                 *, record: bool = False, name: str | None = None) -> None:
        self.key, self.role = key, role
        self.name = f"engine {key}" if name is None else name
        self.executor = SimExecutor(cost, config.cache.block_size, num_blocks or config.cache.num_blocks,
                                    record=record)
        self.clock = SimClock()
        self.engine = LLMEngine(config, self.executor, tokenizer=None, eos_token_id=None, clock=self.clock)
        self.routed = 0  # requests placed here (refusals included)
        self.handoff_bytes = 0  # K/V this (prefill) node sent
        self.reset()

    def reset(self) -> None:
        """Loop state as at the start of a run (the engine keeps its own)."""
        self.inbox: list[Job] = []
        self.busy = False
        self.generation = 0  # only the newest STEP_START is live
        self.pending_start: float | None = None
        self.idle_polls = 0


class SimLoop:
    """One run of `items` over `nodes` (node key = index in the list). `route(stage, priority,
    ids)` ranks node keys for a new request (stage "entry") or a hand-off ("decode"); `link`
    is needed when a node has role "prefill". Hooks: `on_step(node, t, ran)` after every step
    that ran, `on_delivered(t, tokens)` after every delivery of outputs."""

    def __init__(self, nodes: Sequence[SimNode], items: Sequence[WorkItem], route: Route, *,
                 token_times: bool = True, idle_poll_s: float = IDLE_POLL_S, max_idle_polls: int = 1_000_000,
                 link: Link | None = None, on_step: OnStep | None = None,
                 on_delivered: OnDelivered | None = None) -> None:
        self.nodes, self.items, self.route, self.link = list(nodes), items, route, link
        self.token_times, self.idle_poll_s, self.max_idle_polls = token_times, idle_poll_s, max_idle_polls
        self.on_step, self.on_delivered = on_step, on_delivered
        self.events = EventQueue()
        self.records: list[RequestRecord] = []  # in arrival order
        self.handoff = {"count": 0, "tokens": 0, "bytes": 0, "seconds": 0.0}
        self._rec: list[RequestRecord | None] = [None] * len(items)
        self._ids: dict[int, list[int]] = {}
        self._live: dict[str, int] = {}  # request id -> workload index, while a node holds it
        self._arrival_order = sorted(range(len(items)), key=lambda k: items[k].arrival)  # stable: ties keep order
        self._next_item = 0
        self._handlers = {Arrival: self._arrive, KVArrival: self._kv_arrive, StepStart: self._step_start,
                          StepEnd: self._step_end}
        self._ends: dict[str, int] = {}  # request id -> the position of its last output token, where it ends early
        for node in self.nodes:
            node.reset()
            node.executor.ends = self._ends

    def run(self) -> list[RequestRecord]:
        """Every event to the last; the records, one per item. Raises SimulationStuck when
        work is left with no event to move it."""
        self._push_arrival()
        events, handlers = self.events, self._handlers
        while len(events):
            ev = events.pop()
            handlers[type(ev)](ev)
        left = [n.key for n in self.nodes if n.engine.has_unfinished]
        if left or self._live:
            raise SimulationStuck(f"engines {left} unfinished, {len(self._live)} requests open with no event left")
        return self.records

    # --- events -----------------------------------------------------------------------------
    def _push_arrival(self) -> None:
        """Queue the next client arrival: one pending at a time keeps the heap small."""
        if self._next_item < len(self.items):
            k = self._arrival_order[self._next_item]
            self.events.push(Arrival(self.items[k].arrival, k))
            self._next_item += 1

    def _arrive(self, ev: Arrival) -> None:
        self._push_arrival()
        i, item = ev.index, self.items[ev.index]
        rec = RequestRecord(id=f"r{i}", cls=item.cls, priority=item.priority, send_time=item.arrival,
                            prompt_tokens=item.prompt_len, deadline_ms=item.deadline_ms,
                            deadline_kind=item.deadline_kind)
        self._rec[i] = rec
        self.records.append(rec)
        self._ids[i] = ids = prompt_ids(item, i)
        if item.eos_after is not None:
            self._ends[rec.id] = len(ids) + item.eos_after - 1
        keys = self.route("entry", item.priority, ids)
        self._place(Job(i, None, keys, len(ids) + PER_WAITING, item.priority), ev.time)

    def _kv_arrive(self, ev: KVArrival) -> None:
        item = self.items[ev.index]
        keys = self.route("decode", item.priority, self._ids[ev.index])
        self._place(Job(ev.index, ev.first_token, keys, PER_WAITING, item.priority), ev.time)

    def _step_start(self, ev: StepStart) -> None:
        node = self.nodes[ev.node]
        if ev.generation == node.generation:
            node.pending_start = None
            node.clock.set(ev.time)
            self._step(node, ev.time)

    def _step_end(self, ev: StepEnd) -> None:
        node = self.nodes[ev.node]
        node.busy = False
        node.clock.set(ev.time)
        self._deliver(node, ev.outputs, ev.time)
        jobs, node.inbox = node.inbox, []
        for job in jobs:
            self._admit(node, job, ev.time)
        if node.engine.has_unfinished:
            self._start_at(node, ev.time)

    # --- one node ---------------------------------------------------------------------------
    def _start_at(self, node: SimNode, t: float) -> None:
        """Wake `node` at t, unless a step is in flight or a wake-up no later is queued."""
        if node.busy or (node.pending_start is not None and node.pending_start <= t):
            return
        node.generation += 1
        node.pending_start = t
        self.events.push(StepStart(t, node.generation, node.key))

    def _step(self, node: SimNode, t: float) -> None:
        eng = node.engine
        step = eng.step(now=t)
        ran = step.ran
        if ran is not None:
            node.busy, node.idle_polls = True, 0
            if self.on_step is not None:
                self.on_step(node, t, ran)
            self.events.push(StepEnd(t + ran.step_time, t, step.outputs, node.key))
            return
        self._deliver(node, step.outputs, t)
        if eng.has_unfinished:
            node.idle_polls += 1
            if node.idle_polls > self.max_idle_polls:
                where = f"{node.name} at" if node.name else "at"
                raise SimulationStuck(f"{where} t={t:.3f}s: {len(eng.scheduler.requests)} requests left, "
                                      f"{self.max_idle_polls} steps in a row ran nothing")
            due = eng.next_step_due(t)
            self._start_at(node, t + self.idle_poll_s if due is None else max(due, t + MIN_WAKE_S))

    def _place(self, job: Job, now: float) -> None:
        """Hand `job` to its next choice: added now when that node is idle, else queued for
        its next step boundary."""
        node = self.nodes[job.rest.pop(0)]
        node.routed += 1
        if node.busy:
            node.inbox.append(job)
        else:
            self._admit(node, job, now)
            self._start_at(node, now)

    def _admit(self, node: SimNode, job: Job, now: float) -> None:
        item, rec = self.items[job.index], self._rec[job.index]
        ids = self._ids[job.index]
        params = SamplingParams(max_tokens=item.max_tokens, temperature=0.0, ignore_eos=True,
                                stop_token_ids=() if item.eos_after is None else (STOP_TOKEN,))
        opts = {"now": now, "request_id": rec.id, "priority": item.priority, "deadline_ms": item.deadline_ms,
                "deadline_kind": item.deadline_kind}
        try:
            if job.first_token is None:
                node.engine.add_request(ids, params, **opts)
            else:
                node.engine.add_prefilled(ids, job.first_token, KVStandIn(len(ids)), params,
                                          arrival=item.arrival, **opts)  # deadlines count from arrival
        except OverloadedError as e:
            if job.rest:  # the router's next choice
                self._place(job, now)
                return
            self._refuse(rec, now, e)
            return
        except RequestError as e:
            self._refuse(rec, now, e)
            return
        rec.status = 200
        self._live[rec.id] = job.index

    def _refuse(self, rec: RequestRecord, now: float, e: Exception) -> None:
        """A request no node took: a 503/400 before any output, an error after one."""
        self._live.pop(rec.id, None)
        rec.end_time, rec.error = now, str(e)
        if rec.status == 200:  # refused on the decode side: the stream had started
            rec.finish_reason = "error"
        elif isinstance(e, OverloadedError):
            rec.status, rec.retry_after_s = 503, e.retry_after_s
        else:
            rec.status = 400

    def _deliver(self, node: SimNode, outs: list[RequestOutput], t: float) -> None:
        """Outputs reach their clients at t; a prefill node hands a first token off."""
        live, recs, count = self._live, self._rec, self.on_delivered is not None
        prefill, token_times = node.role == "prefill", self.token_times  # read once: this runs per output
        tokens = 0
        for out in outs:
            index = live.get(out.request_id)
            if index is None:
                continue
            if count:
                tokens += len(out.new_token_ids)
            if record_output(recs[index], out, t, token_times):
                del live[out.request_id]
            elif prefill and out.new_token_ids:
                self._hand_off(node, index, out, t)
        if count:
            self.on_delivered(t, tokens)

    def _hand_off(self, node: SimNode, index: int, out: RequestOutput, t: float) -> None:
        """The first token is out: free the request here, send its K/V to the decode side."""
        first, n = out.token_ids[0], len(out.prompt_token_ids)
        node.engine.hand_off(out.request_id, now=t)
        del self._live[out.request_id]
        link = self.link
        nbytes = n * link.kv_bytes
        delay = nbytes / link.bytes_per_s + link.latency_s
        h = self.handoff
        h["count"] += 1
        h["tokens"] += n
        h["bytes"] += nbytes
        h["seconds"] += delay
        node.handoff_bytes += nbytes
        self.events.push(KVArrival(t + delay, index, first))
