"""Prometheus metrics, all named `batchserve:*` and labelled with the served `model_name` (as
vLLM's are), in a registry of their own per app (so tests can build several apps in one
process). Times are in seconds, token counts are counters (rates come from the scraper).

Counters and histograms are fed from the engine thread (`observe_step`, `observe_finish`;
prometheus-client metrics are thread-safe). Gauges of engine state (queue lengths, running,
KV usage, the policy's window and batch cap) come from an EngineSnapshot that /metrics takes
on the engine thread between steps, so a scrape never reads state while it is being changed.
"""
from __future__ import annotations

import logging
import threading
from typing import Iterable, Iterator

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from batchserve.core.batch import RequestOutput, StepRecord
from batchserve.core.stats import EngineSnapshot
from batchserve.engine.client import EngineHealth
from batchserve.request import FinishReason

log = logging.getLogger("batchserve.requests")
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_TPOT = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
_BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_TOKENS = (1, 4, 16, 64, 256, 1024, 4096, 16384)
_ANSWERED = frozenset({FinishReason.STOP, FinishReason.LENGTH, FinishReason.TRUNCATED})


class _SnapshotCollector:
    """Yields the gauge families of the latest snapshot."""

    def __init__(self) -> None:
        self.snapshot: EngineSnapshot | None = None
        self.health: EngineHealth | None = None

    def collect(self) -> Iterator[Metric]:
        h = self.health
        if h is not None:  # the watchdog's view; read without the engine thread, so always there
            yield GaugeMetricFamily("batchserve:engine_up", "1 while the engine serves (not stalled, dead or "
                                    "loading)", value=1 if h.state == "ok" else 0)
            yield GaugeMetricFamily("batchserve:engine_step_running_seconds", "How long the current model step "
                                    "has run (0 between steps)", value=h.step_running_s)
            yield CounterMetricFamily("batchserve:engine_stalls", "Model steps that ran past --step-timeout-s",
                                      value=h.stalls)
            yield CounterMetricFamily("batchserve:engine_failed_steps", "Model steps the executor raised on "
                                      "(then bisected to the requests at fault)", value=h.failed_steps)
            yield CounterMetricFamily("batchserve:requests_isolated", "Requests failed alone because the model "
                                      "step failed on them", value=h.isolated_requests)
            yield CounterMetricFamily("batchserve:requests_failed_by_watchdog", "Requests failed because the "
                                      "engine stalled or died", value=h.watchdog_failed)
        s = self.snapshot
        if s is None:
            return
        g = GaugeMetricFamily("batchserve:requests_waiting", "Requests in the admission queue, by level",
                              labels=["level"])
        for level, n in sorted(s.waiting.items()):
            g.add_metric([level], n)
        yield g
        yield GaugeMetricFamily("batchserve:requests_running", "Requests in the running batch", value=s.running)
        yield GaugeMetricFamily("batchserve:kv_cache_usage", "Fraction of KV blocks in use (0-1)", value=s.kv_usage)
        yield GaugeMetricFamily("batchserve:kv_cache_free_blocks", "KV blocks free or evictable",
                                value=s.kv_free_blocks)
        yield GaugeMetricFamily("batchserve:kv_cache_blocks", "KV blocks in the pool", value=s.kv_blocks)
        yield CounterMetricFamily("batchserve:preemptions", "Requests preempted (by recompute)", value=s.preemptions)
        yield CounterMetricFamily("batchserve:interjected_steps", "Steps run between two layers of a running step, "
                                  "for a tenant served less", value=s.interjections)
        yield CounterMetricFamily("batchserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                  value=s.prefix_queries)
        yield CounterMetricFamily("batchserve:prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                  value=s.prefix_hits)
        yield GaugeMetricFamily("batchserve:prefix_cache_hit_rate", "Prompt tokens found in the prefix cache since "
                                "start (0-1; the counters give it over any interval)", value=s.prefix_hit_rate)
        if s.window_ms is not None:
            yield GaugeMetricFamily("batchserve:scheduling_window_seconds", "The policy's current collection window",
                                    value=s.window_ms / 1000)
        if s.max_batch is not None:
            yield GaugeMetricFamily("batchserve:max_batch", "The policy's current batch cap", value=s.max_batch)
        if s.queue is not None:
            yield from _level_counters(s.queue)


def _level_counters(q) -> Iterator[Metric]:
    """Per-level scheduling counters of the admission queue (core/stats.py QueueStats)."""
    pre = CounterMetricFamily("batchserve:preemptions_by_level", "Running requests preempted, by level and reason "
                              "(priority: for a more important request; memory: KV blocks ran out)",
                              labels=["level", "reason"])
    fams = {k: CounterMetricFamily(f"batchserve:{k}", h, labels=["level"]) for k, h in (
        ("recomputed_tokens", "Tokens whose KV a preemption dropped, to be computed again"),
        ("computed_tokens", "Tokens computed for finished requests"),
        ("deadline_wasted_tokens", "Tokens computed for requests that then missed a hard deadline"))}
    for name, lv in sorted(q.levels.items()):
        for reason, n in sorted(lv.preemptions.items()):
            pre.add_metric([name, reason], n)
        fams["recomputed_tokens"].add_metric([name], lv.recomputed_tokens)
        fams["computed_tokens"].add_metric([name], lv.computed_tokens)
        fams["deadline_wasted_tokens"].add_metric([name], lv.deadline_wasted_tokens)
    yield pre
    yield from fams.values()
    if q.tenants:
        reqs = CounterMetricFamily("batchserve:tenant_requests", "Finished requests, by tenant (the request's "
                                   "`user`)", labels=["tenant"])
        toks = CounterMetricFamily("batchserve:tenant_tokens", "Tokens computed for finished requests, by tenant",
                                   labels=["tenant"])
        for tenant, (n, tokens) in sorted(q.tenants.items()):
            reqs.add_metric([tenant], n)
            toks.add_metric([tenant], tokens)
        yield reqs
        yield toks


class _TokenHistogram:
    """A histogram observed many values at a time (numpy bucket counts): the inter-token
    latency gets one value per token of every step, too many for one observe() each."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...]) -> None:
        self.name, self.doc, self.bounds = name, doc, np.asarray(buckets)
        self.counts = np.zeros(len(buckets) + 1, dtype=np.int64)
        self.total = 0.0
        self._lock = threading.Lock()

    def observe_many(self, values: list[float]) -> None:
        if not values:
            return
        v = np.asarray(values)
        idx = np.bincount(np.searchsorted(self.bounds, v, side="left"), minlength=len(self.counts))
        with self._lock:
            self.counts += idx
            self.total += float(v.sum())

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            cum, total = np.cumsum(self.counts), self.total
        buckets = [(repr(float(b)), int(c)) for b, c in zip(self.bounds, cum[:-1])] + [("+Inf", int(cum[-1]))]
        yield HistogramMetricFamily(self.name, self.doc, buckets=buckets, sum_value=total)


class _Labelled:
    """Every sample of `registry`, with model_name=`model` added to its labels."""

    def __init__(self, registry: CollectorRegistry, model: str) -> None:
        self.registry, self.model = registry, model

    def collect(self) -> Iterable[Metric]:
        for fam in self.registry.collect():
            fam.samples = [s._replace(labels={"model_name": self.model, **s.labels}) for s in fam.samples]
            yield fam


class ServerMetrics:
    """Every metric of one server, and the per-request log line."""

    def __init__(self, model_name: str = "") -> None:
        r = self._inner = CollectorRegistry()
        self.registry = CollectorRegistry()
        self.registry.register(_Labelled(r, model_name))
        self.queue_time = Histogram("batchserve:request_queue_time_seconds", "Arrival to first scheduled",
                                    buckets=_LATENCY, registry=r)
        self.ttft = Histogram("batchserve:time_to_first_token_seconds", "Arrival to first token",
                              buckets=_LATENCY, registry=r)
        self.tpot = Histogram("batchserve:time_per_output_token_seconds", "Mean gap between output tokens, "
                              "per answered request", buckets=_TPOT, registry=r)
        self.itl = _TokenHistogram("batchserve:inter_token_latency_seconds", "Time from a request's token to its "
                                   "next, per token", _TPOT)
        r.register(self.itl)
        self.prefill_time = Histogram("batchserve:request_prefill_time_seconds", "First scheduled to first token",
                                      buckets=_LATENCY, registry=r)
        self.decode_time = Histogram("batchserve:request_decode_time_seconds", "First token to last (answered "
                                     "requests)", buckets=_LATENCY, registry=r)
        self.e2e = Histogram("batchserve:e2e_request_latency_seconds", "Arrival to last token (answered requests)",
                             buckets=_LATENCY, registry=r)
        self.batch_size = Histogram("batchserve:batch_size", "Requests per model step", buckets=_BATCH, registry=r)
        self.batch_tokens = Histogram("batchserve:batch_tokens", "Tokens per model step", buckets=_TOKENS, registry=r)
        self.step_time = Histogram("batchserve:step_time_seconds", "Model step time", buckets=_TPOT, registry=r)
        self.requests = Counter("batchserve:requests", "Finished requests, by finish reason", ["finish_reason"],
                                registry=r)
        self.prompt_tokens = Counter("batchserve:prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("batchserve:generation_tokens", "Tokens generated", registry=r)
        self.rejected = Counter("batchserve:requests_rejected", "Requests refused (queue_full, shutting_down) or "
                                "dropped from a full queue (dropped)", ["reason", "level"], registry=r)
        self.deadline_misses = Counter("batchserve:deadline_misses", "Deadlines missed: hard (failed, 504) or "
                                       "soft (truncated answer)", ["kind"], registry=r)
        self.http_errors = Counter("batchserve:http_errors", "Error responses, by HTTP status", ["status"], registry=r)
        self._gauges = _SnapshotCollector()
        r.register(self._gauges)

    def render(self, snapshot: EngineSnapshot | None, health: EngineHealth | None = None) -> bytes:
        """The text exposition, with gauges from `snapshot` (None: engine not up) and `health`."""
        self._gauges.snapshot, self._gauges.health = snapshot, health
        return generate_latest(self.registry)

    # --- fed from the engine thread --------------------------------------------------------
    def observe_step(self, rec: StepRecord) -> None:
        self.batch_size.observe(rec.num_seqs)
        self.batch_tokens.observe(rec.num_tokens)
        self.step_time.observe(rec.step_time)
        self.generation_tokens.inc(rec.num_sampled)
        self.itl.observe_many(rec.token_gaps)

    def observe_finish(self, out: RequestOutput) -> None:
        reason = out.finish_reason or "unknown"
        level = out.level or "default"
        self.requests.labels(reason).inc()
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        if reason == "deadline":
            self.deadline_misses.labels("hard").inc()
        elif reason == "deadline_truncated":
            self.deadline_misses.labels("soft").inc()
        elif reason == "rejected":
            self.rejected.labels("dropped", level).inc()
        t0 = out.arrival_time
        queue = out.first_scheduled_time - t0 if out.first_scheduled_time is not None else None
        ttft = out.first_token_time - t0 if out.first_token_time is not None else None
        e2e = out.finish_time - t0 if out.finish_time is not None else None
        if queue is not None:
            self.queue_time.observe(queue)
        if ttft is not None:
            self.ttft.observe(ttft)
            if queue is not None:
                self.prefill_time.observe(ttft - queue)
        n = len(out.token_ids)
        if reason in _ANSWERED and e2e is not None:
            self.e2e.observe(e2e)
            if out.first_token_time is not None:
                self.decode_time.observe(out.finish_time - out.first_token_time)
            if n > 1 and out.first_token_time is not None:
                self.tpot.observe((out.finish_time - out.first_token_time) / (n - 1))
        log.info("request %s level=%s priority=%d%s prompt_tokens=%d completion_tokens=%d queue_ms=%s ttft_ms=%s "
                 "e2e_ms=%s preempted=%d finish=%s%s", out.request_id, level, out.priority,
                 "" if out.tenant is None else f" tenant={out.tenant!r}", len(out.prompt_token_ids),
                 n, _ms(queue), _ms(ttft), _ms(e2e), out.num_preemptions, reason,
                 f" error={out.error!r}" if out.error else "")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"
