"""Feedback controllers for request-level batching: pure functions of stats.

The dynamic policy keeps the stats (queue depth, an EWMA of arrival gaps, recent end-to-end
latencies) and asks these functions for its next window and batch cap; nothing here keeps
state or reads a clock, so each is tested alone.
"""
from __future__ import annotations

import math
from typing import Sequence


def ewma(prev: float | None, x: float, alpha: float) -> float:
    """Exponentially weighted moving average; the first sample is taken as is."""
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    return x if prev is None else alpha * x + (1.0 - alpha) * prev


def arrival_rate(mean_gap_s: float | None, since_last_s: float) -> float:
    """Requests per second from the EWMA of inter-arrival gaps. A silence longer than the
    mean gap counts as the gap, so the estimate decays when arrivals stop instead of
    remembering the last burst forever."""
    if mean_gap_s is None:
        return 0.0
    gap = max(mean_gap_s, since_last_s)
    return math.inf if gap <= 0 else 1.0 / gap


def adaptive_window(queue_depth: int, arrival_rate: float, bounds: tuple[float, float],
                    slo_left_ms: float = math.inf, target_batch: int = 32) -> float:
    """The collection window in ms.

    Wait about as long as the arrival rate needs to fill the rest of a `target_batch`
    batch: a deep queue or fast arrivals give a short window (at least bounds[0]), slow
    arrivals a long one (at most bounds[1]). The SLO has the last word: the window never
    exceeds `slo_left_ms`, the time the oldest waiting request can still spend waiting,
    even if that is below bounds[0].
    """
    lo, hi = bounds
    if lo < 0 or hi < lo:
        raise ValueError(f"bad window bounds {bounds}")
    missing = target_batch - queue_depth
    if missing <= 0:
        w = lo
    elif arrival_rate <= 0:
        w = hi
    else:
        w = 1000.0 * missing / arrival_rate
    w = min(max(w, lo), hi)
    return max(0.0, min(w, slo_left_ms))


def aimd_batch_cap(current: int, p99_ms: float, slo_ms: float, lo: int = 1, hi: int = 32,
                   service_p99_ms: float | None = None, high_water: float = 0.9, low_water: float = 0.7,
                   decrease: float = 0.75, increase: int = 1, service_share: float = 0.5) -> int:
    """The next max batch size from measured P99 end-to-end latency against the SLO.

    Additive increase, multiplicative decrease: when P99 passes `high_water` x SLO the cap
    is cut by `decrease` (32 -> 24, the seed's example); below `low_water` x SLO it grows by
    `increase`; in between it holds (a dead band, so it does not oscillate every batch).

    The batch size only controls the service part of the latency (launch to result). When
    `service_p99_ms` shows that part is under `service_share` of the P99, the time is spent
    queueing: a smaller batch would only lower throughput and lengthen the queue (plain AIMD
    collapses to 1 under overload), so the cap grows instead, to drain the queue faster.
    """
    if not 1 <= lo <= hi:
        raise ValueError(f"bad cap bounds [{lo}, {hi}]")
    if p99_ms >= high_water * slo_ms:
        queueing = service_p99_ms is not None and service_p99_ms < service_share * p99_ms
        nxt = current + increase if queueing else min(current - 1, math.floor(current * decrease))
    elif p99_ms < low_water * slo_ms:
        nxt = current + increase
    else:
        nxt = current
    return min(max(nxt, lo), hi)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation; 0.0 for no values."""
    if not values:
        return 0.0
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100.0
    f = math.floor(k)
    c = min(f + 1, len(xs) - 1)
    return xs[f] + (xs[c] - xs[f]) * (k - f)


def length_bucket(num_prompt_tokens: int, max_tokens: int) -> tuple[int, int]:
    """Power-of-two buckets of prompt and output length: requests in one bucket pad each
    other by less than 2x (sequence-level batching)."""
    return (max(1, num_prompt_tokens).bit_length(), max(1, max_tokens).bit_length())


def bucket_distance(a: tuple[int, int], b: tuple[int, int]) -> int:
    return abs(a[0] - b[0]) + abs(a[1] - b[1])
