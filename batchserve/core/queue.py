"""The admission queue: priority levels with caps and an overflow policy, an urgent lane,
and one global order:

    (level, lane, -priority, deadline, arrival)

Higher levels first (levels rank by their highest priority); within a level the urgent lane
first, then higher priority, then the earlier deadline (none counts as infinitely late), then
earlier arrival — and between tenants (`Request.tenant`) of one level, lane and priority, the
tenant served the fewest tokens in that level lately first: a virtual token counter as in
VTC, whose tokens decay with time constant `tenant_memory_s`,

    served(tenant, t) = sum over its served tokens k of  exp(-(t - t_k) / tenant_memory_s)

so a tenant sending more waits for its own backlog, not the others', and one that was idle
for a while is not owed the past. A tenant new to a level starts from the least counter of the
tenants queued there (none queued: the counter of the tenant whose last request left the
queue), as VTC lifts a client that joins: service others got before it came is not held
against them (else a newcomer would hold the level until its counter caught up with theirs).
A known tenant keeps its own counter when it comes back: what it is owed is what the decay
leaves of the others' lead, so a light tenant goes ahead of a heavy one's backlog. All counters decay alike, so their order is kept by the
undecayed sums scaled by exp(t_k / tenant_memory_s) (renormalized now and then). Urgency by slack stays
inside the request's level: a low request about to miss
its deadline goes first among the low ones, never ahead of a higher level, so splitting traffic
into levels cannot cost the most important one. Urgency by wait (aging, `urgent_after_ms`) is
the one way across levels: an aged request goes ahead of every level, which bounds starvation.
Each tenant's requests are one heap; a heap of the tenants' heads, re-keyed lazily (counters
only grow, so a head whose key has gone stale is found when it reaches the top), gives the
order. With one tenant it is one heap and a head. Side heaps, all with lazy deletion, answer the other
questions in O(log n): the oldest request of a level (drop_oldest), the oldest non-urgent
request (promotion by wait), and the next request whose deadline needs a look (promotion by
slack, hard-deadline misses). Nothing here reads the clock: `offer` and `refresh` take `now`.
"""
from __future__ import annotations

import heapq
import itertools
import math
from typing import Callable, Iterable, Iterator

from batchserve.config import LevelConfig, QueueConfig
from batchserve.core.stats import QueueMetrics, QueueStats
from batchserve.request import MAX_PRIORITY, OverloadedError, Request

# (level rank: -1 aged / 0 the highest level..., lane: 0 urgent / 1 normal, -priority, deadline,
#  arrival_time, push token, request)
_Entry = tuple[int, int, int, float, float, int, Request]
_AGED = -1
_TenantKey = tuple[str, object]  # (level name, tenant)
# a tenant's head: (rank, lane, -priority, tenant's counter, deadline, arrival, push token, tenant key)
_Head = tuple[int, int, int, float, float, float, int, _TenantKey]
_Side = tuple[float, int, Request]  # (time key, push token, request)


class AdmissionQueue:
    """Waiting requests, in the order the scheduler should take them.

    `offer(req, now)` is admission: it applies the level's cap and overflow policy.
    `push(req)` re-queues unconditionally (preempted requests are never refused).
    `refresh(now, service_time)` promotes to the urgent lane and returns the hard-deadline
    requests that can no longer make it; the scheduler calls it before every step.
    """

    def __init__(self, config: QueueConfig | None = None) -> None:
        self.config = config or QueueConfig()
        self.levels: dict[str, LevelConfig] = {lv.name: lv for lv in self.config.levels}
        self._level_of = {p: lv for lv in self.config.levels for p in lv.priorities}
        ranked = sorted(self.config.levels, key=lambda lv: -max(lv.priorities))
        self._rank = {lv.name: i for i, lv in enumerate(ranked)}
        self._tq: dict[_TenantKey, list[_Entry]] = {}  # each tenant's queued requests
        self._heads: list[_Head] = []  # tenants by their best request; stale entries re-keyed lazily
        self._head_of: dict[_TenantKey, _Head] = {}  # each tenant's current head entry
        self._num_entries = 0  # entries in the tenant heaps, live or not
        self.served: dict[_TenantKey, float] = {}  # the tenants' counters, scaled by exp(-_epoch / memory)
        self._epoch = 0.0  # the time the counters are scaled to
        self.fair = False  # a request naming a tenant has been queued: the scheduler credits tokens
        self._backlog: dict[_TenantKey, int] = {}  # named tenants' queued requests
        self._last_left: dict[str, _TenantKey] = {}  # level -> the tenant whose queue emptied last
        self._live: dict[str, _Entry] = {}  # request id -> its current heap entry
        self._count = {name: 0 for name in self.levels}
        self._prompt_at = [0] * (MAX_PRIORITY + 1)  # by priority: prompt tokens queued, still to compute
        self._queued_at = [0] * (MAX_PRIORITY + 1)  # by priority: requests queued
        self._prompt_of: dict[str, tuple[int, int]] = {}  # request id -> (priority, its share of those)
        self._urgent = {name: 0 for name in self.levels}
        self._oldest: dict[str, list[_Side]] = {name: [] for name in self.levels}
        self._by_arrival: list[_Side] = []  # non-urgent requests, for promotion by wait
        self._checks: list[_Side] = []  # requests with deadlines, by when to look again
        self._tokens = itertools.count()
        self.metrics = QueueMetrics(self.levels)

    # --- the interface policies use --------------------------------------------------------
    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._live

    def prompt_work_from(self, priority: int) -> tuple[int, int]:
        """(prompt tokens still to compute, requests) queued at `priority` or above: the work
        that may join the running steps ahead of, or beside, a running request of that priority."""
        return sum(self._prompt_at[priority:]), sum(self._queued_at[priority:])

    def __iter__(self) -> Iterator[Request]:
        """Queued requests in scheduling order (a sorted copy: O(n log n), for inspection)."""
        served = self.served
        return iter([e[-1] for e in sorted(self._live.values(), key=lambda e: (
            e[0], e[1], e[2], served.get((e[-1].level, e[-1].tenant), 0.0), e[3], e[4], e[5]))])

    def peek(self) -> Request | None:
        heads, live, head_of = self._heads, self._live, self._head_of
        while heads:
            h = heads[0]
            tk = h[7]
            if head_of.get(tk) is not h:  # a tenant's older head, replaced by a better one since
                heapq.heappop(heads)
                continue
            q = self._tq[tk]
            while q and live.get(q[0][-1].request_id) is not q[0]:
                heapq.heappop(q)  # left the queue (admitted, ended, or promoted: a newer entry)
                self._num_entries -= 1
            if not q:
                heapq.heappop(heads)
                del head_of[tk], self._tq[tk]
                continue
            e = q[0]
            key = (e[0], e[1], e[2], self.served.get(tk, 0.0), e[3], e[4], e[5], tk)
            if key == h:
                return e[-1]
            head_of[tk] = key  # its counter grew, or its best request left: re-key
            heapq.heapreplace(heads, key)
        return None

    def pop(self) -> Request:
        req = self.peek()
        if req is None:
            raise IndexError("pop from an empty queue")
        self._forget(req)
        return req

    def credit(self, req: Request, tokens: int, now: float) -> None:
        """The scheduler served `tokens` of `req` in the step that ended at `now`."""
        x = (now - self._epoch) / self.config.tenant_memory_s
        if x > 300:  # keep the scaled counters finite: rescale to now and re-key every head
            self.served = {k: v * math.exp(-x) for k, v in self.served.items()}
            self._epoch, x = now, 0.0
            self._rebuild()
        tk = (req.level, req.tenant)
        self.served[tk] = self.served.get(tk, 0.0) + tokens * math.exp(x)

    def decay(self, now: float) -> float:
        """What turns a raw counter in `served` into decayed service (tokens) at `now`."""
        return math.exp(-(now - self._epoch) / self.config.tenant_memory_s)

    def tenant_service(self, now: float) -> dict[_TenantKey, float]:
        """Each tenant's decayed service (tokens) at `now`, by (level, tenant)."""
        f = self.decay(now)
        return {k: v * f for k, v in self.served.items()}

    def remove(self, request_id: str) -> Request | None:
        """Take a request out wherever it is (admission, abort, deadline); heap entries die lazily."""
        entry = self._live.get(request_id)
        if entry is None:
            return None
        self._forget(entry[-1])
        return entry[-1]

    def push(self, req: Request) -> None:
        """Queue a request without any cap check: re-queueing after preemption, which keeps
        the request's place (its key depends only on what it was given at arrival, and on
        whether it was promoted)."""
        if req.request_id in self._live:
            raise ValueError(f"request {req.request_id} already queued")
        level = self.resolve(req)
        tok = next(self._tokens)
        entry = self._entry(req, tok)
        self._live[req.request_id] = entry
        tk = (level.name, req.tenant)
        if req.tenant is not None:
            self.fair = True
            n = self._backlog.get(tk, 0)
            if not n and tk not in self.served:
                self._lift(tk)
            self._backlog[tk] = n + 1
        self._push_entry(entry, tk)
        heapq.heappush(self._oldest[level.name], (req.arrival_time, tok, req))
        self._count[level.name] += 1
        todo = max(0, req.num_tokens - req.num_computed_tokens)
        self._prompt_of[req.request_id] = (req.priority, todo)
        self._prompt_at[req.priority] += todo
        self._queued_at[req.priority] += 1
        if req.urgent:
            self._urgent[level.name] += 1
        if not req.aged and self.config.urgent_after_ms is not None:
            heapq.heappush(self._by_arrival, (req.arrival_time, tok, req))
        if req.deadline is not None:
            heapq.heappush(self._checks, (-math.inf, tok, req))  # looked at on the next refresh

    # --- admission ---------------------------------------------------------------------------
    def resolve(self, req: Request) -> LevelConfig:
        """The request's level. The first call (when the request enters the scheduler) sets
        `req.level` and fills the deadline fields the request left unset from the level's
        defaults; later calls only look the level up."""
        if req.level is not None:
            return self.levels[req.level]
        level = self._level_of[req.priority]
        req.level = level.name
        if req.deadline_ms is None:
            req.deadline_ms = level.deadline_ms
        if req.deadline_kind is None:
            req.deadline_kind = level.deadline_kind
        return level

    def offer(self, req: Request, now: float) -> Request | None:
        """Admit a new request under its level's cap. A full level either raises
        OverloadedError (`reject`) or removes and returns its oldest queued request, with
        `error` set, for the caller to end as rejected (`drop_oldest`)."""
        level = self.resolve(req)
        name = level.name
        dropped = None
        if level.capacity is not None and self._count[name] >= level.capacity:
            if level.overflow == "reject":
                self.metrics.on_reject(name)
                raise OverloadedError(
                    f"queue level {name!r} is full ({level.capacity} requests waiting); retry later",
                    retry_after_s=self.retry_after(name), level=name)
            dropped = self._oldest_of(name)
            if dropped is not None:
                self._forget(dropped)
                dropped.error = (f"dropped from the full queue level {name!r} (capacity {level.capacity}) "
                                 f"to make room for a newer request")
                self.metrics.on_drop(name)
        self.push(req)
        return dropped

    def retry_after(self, level: str) -> float:
        """A Retry-After hint: the level's median recent wait, at least the configured floor."""
        return max(self.config.retry_after_s, self.metrics.wait_p50(level))

    # --- urgency and deadlines --------------------------------------------------------------
    def refresh(self, now: float, service_time: Callable[[Request], float]) -> list[Request]:
        """Promote requests that waited past `urgent_after_ms` or whose slack
        (deadline - now - service_time(req)) is under `urgent_slack_ms`, and return the queued
        requests whose deadline is lost: hard ones that cannot make it (now + service_time >=
        deadline), soft ones whose deadline has passed. Those stay queued: the caller ends them."""
        after = self.config.urgent_after_ms
        if after is not None:
            h = self._by_arrival
            while h and (now - h[0][0]) * 1000 > after:
                _, tok, req = heapq.heappop(h)
                if self._valid(req, tok) and not req.aged:
                    self._promote(req, "wait")
        slack_ms = self.config.urgent_slack_ms
        doomed = []
        checks = self._checks
        while checks and checks[0][0] <= now:
            _, tok, req = heapq.heappop(checks)
            if not self._valid(req, tok):
                continue
            s = service_time(req)
            left = req.deadline - now - s
            if (left <= 0 and req.hard_deadline) or now >= req.deadline:  # soft: passed with no token
                doomed.append(req)
                continue
            if slack_ms is not None and not req.urgent and left * 1000 <= slack_ms:
                self._promote(req, "slack")
            nxt = self._next_check(req, s, slack_ms)
            # a later, larger prediction is still seen no later than this time, which is
            # never after the deadline: a hard request is never scheduled past it
            heapq.heappush(checks, (max(nxt, math.nextafter(now, math.inf)), tok, req))
        self._maybe_compact()
        return doomed

    @property
    def has_deadline_checks(self) -> bool:
        """Whether any queued request's deadline is waiting to be looked at again (some entries
        may belong to requests that have left; that only means a look that finds nothing)."""
        return bool(self._checks)

    def recheck_all(self) -> None:
        """Look at every queued deadline again on the next refresh: the predictions the
        current look-at times came from have grown (O(n), and rare)."""
        self._checks = [(-math.inf, tok, req) for _, tok, req in self._checks if self._valid(req, tok)]
        heapq.heapify(self._checks)

    @staticmethod
    def _next_check(req: Request, s: float, slack_ms: float | None) -> float:
        times = []
        if slack_ms is not None and not req.urgent:
            times.append(req.deadline - s - slack_ms / 1000)
        times.append(req.deadline - s if req.hard_deadline else req.deadline)
        return min(times)

    def _entry(self, req: Request, tok: int) -> _Entry:
        d = req.deadline
        rank = _AGED if req.aged else self._rank[req.level]
        return (rank, 0 if req.urgent else 1, -req.priority, math.inf if d is None else d, req.arrival_time, tok, req)

    def _promote(self, req: Request, reason: str) -> None:
        old = self._live[req.request_id]
        if not req.urgent:
            self._urgent[req.level] += 1
        req.urgent = True
        req.aged = req.aged or reason == "wait"
        entry = self._entry(req, old[5])
        self._live[req.request_id] = entry
        self._push_entry(entry, (req.level, req.tenant))
        self.metrics.on_promote(req.level, reason)

    # --- metrics ---------------------------------------------------------------------------
    def lengths_by_level(self) -> dict[str, int]:
        return dict(self._count)

    def stats(self, now: float) -> QueueStats:
        """A snapshot of the queue metrics (see core/stats.py for the field names)."""
        oldest = {}
        for name in self.levels:
            req = self._oldest_of(name)
            oldest[name] = max(0.0, now - req.arrival_time) if req is not None else 0.0
        return self.metrics.snapshot(self.lengths_by_level(), dict(self._urgent), oldest)

    def queued_tenants(self) -> Iterable[_TenantKey]:
        """The (level, tenant) of every named tenant with requests in the queue."""
        return self._backlog.keys()

    # --- internals ---------------------------------------------------------------------------
    def _valid(self, req: Request, tok: int) -> bool:
        entry = self._live.get(req.request_id)
        return entry is not None and entry[5] == tok

    def _lift(self, tk: _TenantKey) -> None:
        """A tenant new to its level is about to queue: start its counter at the floor (the
        module docstring)."""
        level, served = tk[0], self.served
        queued = [served.get(k, 0.0) for k, n in self._backlog.items() if n and k[0] == level]
        if queued:
            floor = min(queued)
        else:
            last = self._last_left.get(level)
            floor = served.get(last, 0.0) if last is not None else 0.0
        served[tk] = floor

    def _forget(self, req: Request) -> None:
        del self._live[req.request_id]
        self._count[req.level] -= 1
        if req.tenant is not None:
            tk = (req.level, req.tenant)
            n = self._backlog[tk] - 1
            if n:
                self._backlog[tk] = n
            else:
                del self._backlog[tk]
                self._last_left[req.level] = tk
        p, todo = self._prompt_of.pop(req.request_id)
        self._prompt_at[p] -= todo
        self._queued_at[p] -= 1
        if req.urgent:
            self._urgent[req.level] -= 1
        self._maybe_compact()

    def _rebuild(self) -> None:
        """The tenant heaps and heads anew from the live entries."""
        self._tq, self._heads, self._head_of, self._num_entries = {}, [], {}, 0
        for e in self._live.values():
            self._push_entry(e, (e[-1].level, e[-1].tenant))

    def _push_entry(self, e: _Entry, tk: _TenantKey) -> None:
        """Into its tenant's heap; a new head entry when it may be the tenant's best."""
        heapq.heappush(self._tq.setdefault(tk, []), e)
        self._num_entries += 1
        key = (e[0], e[1], e[2], self.served.get(tk, 0.0), e[3], e[4], e[5], tk)
        cur = self._head_of.get(tk)
        if cur is None or key < cur:
            self._head_of[tk] = key
            heapq.heappush(self._heads, key)

    def _oldest_of(self, level: str) -> Request | None:
        h = self._oldest[level]
        while h and not self._valid(h[0][2], h[0][1]):
            heapq.heappop(h)
        return h[0][2] if h else None

    def _maybe_compact(self) -> None:
        """Drop dead entries once they outnumber live ones: keeps memory O(n) and the
        amortized cost per operation O(log n)."""
        bound = 2 * len(self._live) + 1024
        if self._num_entries > bound or len(self._heads) > bound:
            self._rebuild()
        for side in (self._by_arrival, self._checks, *self._oldest.values()):
            if len(side) > bound:
                side[:] = [e for e in side if self._valid(e[2], e[1])]
                heapq.heapify(side)
