"""`dynamic`: request-level batches like `static`, with two controllers.

- Window: from queue depth and an EWMA of arrival gaps (`controllers.adaptive_window`):
  short when the queue is deep or arrivals are fast, long when idle, within
  [window_min_ms, window_max_ms], and never longer than the SLO leaves once the expected
  batch service time is taken off. A request with a deadline launches the batch early
  when waiting longer would leave it less than that service time.
- Max batch: AIMD on the P99 end-to-end latency of recent requests against `slo_p99_ms`
  (`controllers.aimd_batch_cap`), bounded by the configured `max_batch` and, when the
  engine hands it a profiled latency model, by that profile's throughput knee. The cap is judged only on batches
  formed under it, and holds rather than falls when the latency is queueing, not service
  (a smaller batch would only lengthen the queue).
- `bucket_by_length`: the batch is filled with the requests closest in (prompt, output)
  length bucket to the head of the queue, which cuts padding (sequence-level batching).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from batchserve.config import SchedulerConfig
from batchserve.core.controllers import (adaptive_window, aimd_batch_cap, arrival_rate, bucket_distance,
                                         ewma, length_bucket, percentile)
from batchserve.core.latency import LatencyModel, ProfiledLatencyModel
from batchserve.core.policies.request_level import RequestLevelPolicy
from batchserve.request import Request, RequestStatus

if TYPE_CHECKING:
    from batchserve.core.scheduler import Scheduler

GAP_ALPHA = 0.2  # weight of the newest arrival gap
SERVICE_ALPHA = 0.3  # weight of the newest batch's service time
MIN_SAMPLES = 8  # completions needed (since the last cap change) before the cap moves again
MAX_SAMPLES = 128


class DynamicPolicy(RequestLevelPolicy):
    name = "dynamic"

    def __init__(self, config: SchedulerConfig | None = None, latency: LatencyModel | None = None) -> None:
        """`latency`: the engine's step-time model; a profiled one (`batchserve profile`) caps the
        batch at its knee and seeds the expected batch service time. The online model knows
        nothing yet when the policy starts, so it is not read here."""
        super().__init__(config)
        cfg = self.config
        self.window_ms = cfg.window_max_ms
        self.cap_max = cfg.max_batch
        self.service_ms = 0.0  # expected time from batch launch to its results
        if isinstance(latency, ProfiledLatencyModel):
            if latency.knee_batch:
                self.cap_max = max(1, min(self.cap_max, latency.knee_batch))
            # a prior until batches are measured: one prefill plus decodes of a typical batch
            self.service_ms = 1000.0 * latency.predict_batch(self.cap_max, prompt_len=128, output_len=64)
        self.max_batch = self.cap_max
        self.mean_gap_s: float | None = None
        self.last_arrival: float | None = None
        self.samples: list[float] = []  # end-to-end ms of requests since the cap last changed
        self.service_samples: list[float] = []  # their batch's launch-to-result ms
        self.p99_ms = 0.0
        self.cap_changes: list[tuple[float, int]] = []  # (time, new cap)

    def on_add(self, sched: "Scheduler", req: Request, now: float) -> None:
        if self.last_arrival is not None:
            self.mean_gap_s = ewma(self.mean_gap_s, max(0.0, now - self.last_arrival), GAP_ALPHA)
        self.last_arrival = now

    def arrival_rate(self, now: float) -> float:
        since = 0.0 if self.last_arrival is None else now - self.last_arrival
        return arrival_rate(self.mean_gap_s, since)

    def update_controls(self, sched: "Scheduler", now: float) -> None:
        cfg = self.config
        self.window_ms = adaptive_window(len(sched.waiting), self.arrival_rate(now),
                                         (cfg.window_min_ms, cfg.window_max_ms),
                                         slo_left_ms=cfg.slo_p99_ms - self.service_ms,
                                         target_batch=self.max_batch)

    def should_launch(self, sched: "Scheduler", now: float) -> bool:
        depth = len(sched.waiting)
        if depth == 0:
            return False
        if depth >= self.max_batch:
            return True
        for req in sched.waiting:
            waited = (now - req.arrival_time) * 1000.0
            if waited >= self.window_ms:
                return True
            if req.deadline_ms is not None and waited >= req.deadline_ms - self.service_ms:
                return True
        return False

    def next_step_due(self, sched: "Scheduler", now: float) -> float | None:
        """The window closing, or a deadline forcing an early launch (see should_launch).
        The window only grows while no request arrives, so this is never late."""
        due = super().next_step_due(sched, now)
        if due is None:
            return None
        for req in sched.waiting:
            if req.deadline_ms is not None:
                due = min(due, req.arrival_time + (req.deadline_ms - self.service_ms) / 1000.0)
        return due

    def candidates(self, sched: "Scheduler") -> Iterable[Request]:
        order = list(sched.waiting)
        if not self.config.bucket_by_length or len(order) < 2:
            return order
        head = length_bucket(order[0].num_prompt_tokens, order[0].max_tokens)
        rank = {r.request_id: i for i, r in enumerate(order)}
        rest = sorted(order[1:], key=lambda r: (bucket_distance(head, length_bucket(r.num_prompt_tokens,
                                                                                     r.max_tokens)),
                                                rank[r.request_id]))
        return [order[0]] + rest

    def on_batch_end(self, sched: "Scheduler", members: list[Request], now: float) -> None:
        service = (now - self.batch_start) * 1000.0
        self.service_ms = ewma(self.service_ms or None, service, SERVICE_ALPHA)
        if self.cap_changes and self.batch_start < self.cap_changes[-1][0]:
            return  # formed under the previous cap: judge the new cap on its own batches
        ok = [r for r in members if r.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)]
        self.samples.extend((now - r.arrival_time) * 1000.0 for r in ok)
        self.service_samples.extend(service for _ in ok)
        del self.samples[:-MAX_SAMPLES], self.service_samples[:-MAX_SAMPLES]
        if len(self.samples) < min(MIN_SAMPLES, self.max_batch):
            return
        self.p99_ms = percentile(self.samples, 99)
        cap = aimd_batch_cap(self.max_batch, self.p99_ms, self.config.slo_p99_ms, lo=1, hi=self.cap_max,
                             service_p99_ms=percentile(self.service_samples, 99))
        if cap != self.max_batch:
            self.max_batch = cap
            self.samples, self.service_samples = [], []
            self.cap_changes.append((now, cap))
