"""Queue metrics: counters the admission queue and the scheduler feed, and a plain
snapshot (`QueueStats`) that the engine, the HTTP /metrics endpoint and the benchmarks read.

Field names (read by name, so keep them stable):

QueueStats
    levels              dict level name -> LevelStats
    length              requests queued, all levels
    urgent_length       of those, in the urgent lane
    wait_p50_ms, wait_p99_ms, wait_mean_ms
                        queue wait (arrival -> first scheduled) over a window of recent requests
    rejected            refused at admission (level full, policy `reject`: HTTP 503)
    dropped             removed from a full level for a newer request (policy `drop_oldest`)
    promotions          dict reason -> count: "wait" (waited past urgent_after_ms),
                        "slack" (slack under urgent_slack_ms)
    deadline_misses     dict kind -> count: "hard" (ended with finish reason `deadline`),
                        "soft" (truncated, finished after its deadline, or ended with
                        `deadline` because it passed before a first token)
    truncated           soft-deadline requests whose max_tokens was cut (`deadline_truncated`)
    finished            requests that ended for any reason after entering the queue
    timeout_rate        deadline_misses (both kinds) / finished
    preemptions         dict reason -> count: "priority" (made room for a more important
                        request), "fairness" (for a tenant holding fewer of its level's seats),
                        "memory" (KV blocks ran out)
    recomputed_tokens   tokens whose KV was dropped by a preemption and must be computed again
    computed_tokens     tokens the model computed for requests that have finished
    deadline_wasted_tokens
                        of those, the tokens of requests that then ended with `deadline`
    tenants             dict tenant -> (finished requests, computed tokens), for requests that
                        named one (the first MAX_TENANTS seen; later ones count as "other")
LevelStats
    name, length, urgent_length, oldest_wait_ms, wait_p50_ms, wait_p99_ms, wait_mean_ms,
    rejected, dropped, promotions, finished, deadline_misses (dict), timeout_rate,
    preemptions (dict), recomputed_tokens, computed_tokens, deadline_wasted_tokens
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterable

from batchserve.request import Request, RequestStatus


def percentile(values: Iterable[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); 0.0 for no values."""
    xs = sorted(values)
    if not xs:
        return 0.0
    k = max(0, min(len(xs) - 1, int(-(-q * len(xs) // 100)) - 1))
    return xs[k]


@dataclass(frozen=True)
class LevelStats:
    name: str
    length: int = 0
    urgent_length: int = 0
    oldest_wait_ms: float = 0.0
    wait_p50_ms: float = 0.0
    wait_p99_ms: float = 0.0
    wait_mean_ms: float = 0.0
    rejected: int = 0
    dropped: int = 0
    promotions: int = 0
    finished: int = 0
    deadline_misses: dict[str, int] = field(default_factory=lambda: {"hard": 0, "soft": 0})
    timeout_rate: float = 0.0
    preemptions: dict[str, int] = field(default_factory=lambda: {"priority": 0, "fairness": 0, "memory": 0})
    recomputed_tokens: int = 0
    computed_tokens: int = 0
    deadline_wasted_tokens: int = 0


@dataclass(frozen=True)
class QueueStats:
    levels: dict[str, LevelStats]
    length: int = 0
    urgent_length: int = 0
    wait_p50_ms: float = 0.0
    wait_p99_ms: float = 0.0
    wait_mean_ms: float = 0.0
    rejected: int = 0
    dropped: int = 0
    promotions: dict[str, int] = field(default_factory=lambda: {"wait": 0, "slack": 0})
    deadline_misses: dict[str, int] = field(default_factory=lambda: {"hard": 0, "soft": 0})
    truncated: int = 0
    finished: int = 0
    timeout_rate: float = 0.0
    preemptions: dict[str, int] = field(default_factory=lambda: {"priority": 0, "fairness": 0, "memory": 0})
    recomputed_tokens: int = 0
    computed_tokens: int = 0
    deadline_wasted_tokens: int = 0
    tenants: dict[str, tuple[int, int]] = field(default_factory=dict)


MAX_TENANTS = 1000  # tenants counted by name; the rest share "other" (bounded label cardinality)


class _LevelCounters:
    def __init__(self, window: int) -> None:
        self.waits: deque[float] = deque(maxlen=window)
        self.rejected = 0
        self.dropped = 0
        self.promotions = 0
        self.finished = 0
        self.misses = {"hard": 0, "soft": 0}
        self.num_waits = 0
        self.p50, self.p50_at = 0.0, 0
        self.preemptions = {"priority": 0, "fairness": 0, "memory": 0}
        self.recomputed = 0
        self.computed = 0
        self.wasted = 0


class QueueMetrics:
    """Counters, fed by the queue (rejects, drops, promotions) and the scheduler (waits,
    finishes). Waits are kept in a bounded window per level, so percentiles track recent load."""

    def __init__(self, levels: Iterable[str], window: int = 2048) -> None:
        self._lv = {name: _LevelCounters(window) for name in levels}
        self._all_waits: deque[float] = deque(maxlen=window)
        self.promotions = {"wait": 0, "slack": 0}
        self.truncated = 0
        self.tenants: dict[str, list[int]] = {}  # tenant -> [finished requests, computed tokens]

    def _level(self, name: str | None) -> _LevelCounters:
        return self._lv[name] if name in self._lv else next(iter(self._lv.values()))

    def on_wait(self, level: str | None, seconds: float) -> None:
        c = self._level(level)
        c.waits.append(seconds)
        c.num_waits += 1
        self._all_waits.append(seconds)

    def wait_p50(self, level: str | None) -> float:
        """Median recent wait of a level, seconds (cached until a new wait arrives)."""
        c = self._level(level)
        if c.p50_at != c.num_waits:
            c.p50, c.p50_at = percentile(c.waits, 50), c.num_waits
        return c.p50

    def on_reject(self, level: str | None) -> None:
        self._level(level).rejected += 1

    def on_drop(self, level: str | None) -> None:
        self._level(level).dropped += 1

    def on_promote(self, level: str | None, reason: str) -> None:
        self._level(level).promotions += 1
        self.promotions[reason] = self.promotions.get(reason, 0) + 1

    def on_truncate(self) -> None:
        self.truncated += 1

    def on_preempt(self, level: str | None, reason: str, recomputed_tokens: int) -> None:
        c = self._level(level)
        c.preemptions[reason] += 1
        c.recomputed += recomputed_tokens

    def on_recompute(self, level: str | None, tokens: int) -> None:
        """A preempted request that had kept its KV lost it (memory ran short): `tokens` to redo."""
        self._level(level).recomputed += tokens

    def on_finish(self, req: Request) -> None:
        """A request that had entered the queue ended (any reason)."""
        lv = self._level(req.level)
        lv.finished += 1
        lv.computed += req.work_tokens
        if req.tenant is not None:
            t = self.tenants.get(req.tenant)
            if t is None:
                t = self.tenants.setdefault(req.tenant if len(self.tenants) < MAX_TENANTS else "other", [0, 0])
            t[0] += 1
            t[1] += req.work_tokens
        if req.status == RequestStatus.FINISHED_DEADLINE:
            lv.misses["hard" if req.hard_deadline else "soft"] += 1
            lv.wasted += req.work_tokens
        elif req.deadline is not None and req.deadline_kind == "soft" and (
                req.status == RequestStatus.FINISHED_TRUNCATED
                or (req.finish_time is not None and req.finish_time > req.deadline)):
            lv.misses["soft"] += 1

    def snapshot(self, lengths: dict[str, int], urgent: dict[str, int],
                 oldest_wait_s: dict[str, float]) -> QueueStats:
        levels = {}
        for name, c in self._lv.items():
            ws = list(c.waits)
            misses = dict(c.misses)
            levels[name] = LevelStats(
                name=name, length=lengths.get(name, 0), urgent_length=urgent.get(name, 0),
                oldest_wait_ms=1000 * oldest_wait_s.get(name, 0.0),
                wait_p50_ms=1000 * percentile(ws, 50), wait_p99_ms=1000 * percentile(ws, 99),
                wait_mean_ms=1000 * sum(ws) / len(ws) if ws else 0.0,
                rejected=c.rejected, dropped=c.dropped, promotions=c.promotions, finished=c.finished,
                deadline_misses=misses, timeout_rate=sum(misses.values()) / c.finished if c.finished else 0.0,
                preemptions=dict(c.preemptions), recomputed_tokens=c.recomputed, computed_tokens=c.computed,
                deadline_wasted_tokens=c.wasted)
        ws = list(self._all_waits)
        finished = sum(lv.finished for lv in levels.values())
        misses = {k: sum(lv.deadline_misses[k] for lv in levels.values()) for k in ("hard", "soft")}
        return QueueStats(
            levels=levels, length=sum(lengths.values()), urgent_length=sum(urgent.values()),
            wait_p50_ms=1000 * percentile(ws, 50), wait_p99_ms=1000 * percentile(ws, 99),
            wait_mean_ms=1000 * sum(ws) / len(ws) if ws else 0.0,
            rejected=sum(lv.rejected for lv in levels.values()),
            dropped=sum(lv.dropped for lv in levels.values()), promotions=dict(self.promotions),
            deadline_misses=misses, truncated=self.truncated, finished=finished,
            timeout_rate=sum(misses.values()) / finished if finished else 0.0,
            preemptions={k: sum(lv.preemptions[k] for lv in levels.values()) for k in ("priority", "fairness", "memory")},
            recomputed_tokens=sum(lv.recomputed_tokens for lv in levels.values()),
            computed_tokens=sum(lv.computed_tokens for lv in levels.values()),
            deadline_wasted_tokens=sum(lv.deadline_wasted_tokens for lv in levels.values()),
            tenants={k: (v[0], v[1]) for k, v in self.tenants.items()})


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine state at one instant (`LLMEngine.snapshot`), taken between steps: the gauges
    /metrics reports."""

    waiting: dict[str, int] = field(default_factory=dict)
    running: int = 0
    kv_usage: float = 0.0
    kv_free_blocks: int = 0
    kv_blocks: int = 0
    preemptions: int = 0
    interjections: int = 0  # steps run between two layers of another (Scheduler.interjection)
    prefix_hit_rate: float = 0.0
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache, since start
    prefix_hits: int = 0  # of those, found cached
    window_ms: float | None = None
    max_batch: int | None = None
    queue: QueueStats | None = None  # the admission queue's counters, by level
