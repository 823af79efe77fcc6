"""The dynamic policy's controllers as pure functions."""
from __future__ import annotations

import math

import pytest

from batchserve.core.controllers import (adaptive_window, aimd_batch_cap, arrival_rate, bucket_distance, ewma,
                                         length_bucket, percentile)

B = (15.0, 120.0)  # the seed's figures: 15 ms under load, 120 ms when quiet


def test_window_seed_figures():
    assert adaptive_window(60, 2000.0, B) == 15.0  # depth > 50: shortest
    assert adaptive_window(5, 1.0, B) == 120.0  # depth < 10, slow arrivals: longest
    assert adaptive_window(0, 0.0, B) == 120.0  # idle: no rate at all


def test_window_is_the_time_to_fill_the_batch_within_bounds():
    assert adaptive_window(12, 400.0, B, target_batch=32) == pytest.approx(50.0)  # 20 more at 400/s
    assert adaptive_window(32, 1.0, B, target_batch=32) == 15.0  # already a full batch


def test_window_monotone_in_depth_and_rate():
    by_depth = [adaptive_window(d, 300.0, B) for d in range(0, 40, 2)]
    assert all(a >= b for a, b in zip(by_depth, by_depth[1:])) and by_depth[0] > by_depth[-1]
    by_rate = [adaptive_window(4, r, B) for r in (10, 100, 300, 1000, 5000)]
    assert all(a >= b for a, b in zip(by_rate, by_rate[1:])) and by_rate[0] > by_rate[-1]
    assert all(B[0] <= w <= B[1] for w in by_depth + by_rate)


def test_window_never_beyond_the_slo():
    assert adaptive_window(1, 1.0, B, slo_left_ms=40.0) == 40.0
    assert adaptive_window(1, 1.0, B, slo_left_ms=5.0) == 5.0  # below the minimum: the SLO wins
    assert adaptive_window(1, 1.0, B, slo_left_ms=-10.0) == 0.0
    with pytest.raises(ValueError):
        adaptive_window(1, 1.0, (50.0, 10.0))


def test_arrival_rate_from_gaps_decays_when_quiet():
    assert arrival_rate(None, 0.0) == 0.0
    assert arrival_rate(0.01, 0.0) == pytest.approx(100.0)
    assert arrival_rate(0.01, 2.0) == pytest.approx(0.5)  # a 2 s silence counts as a 2 s gap
    assert arrival_rate(0.0, 0.0) == math.inf
    assert ewma(None, 4.0, 0.5) == 4.0 and ewma(4.0, 2.0, 0.5) == 3.0
    with pytest.raises(ValueError):
        ewma(1.0, 1.0, 0.0)


def test_aimd_decreases_near_slo_increases_with_headroom():
    assert aimd_batch_cap(32, p99_ms=950.0, slo_ms=1000.0) == 24  # the seed's 32 -> 24
    assert aimd_batch_cap(24, p99_ms=800.0, slo_ms=1000.0) == 24  # dead band: hold
    assert aimd_batch_cap(24, p99_ms=300.0, slo_ms=1000.0) == 25  # headroom: +1
    assert aimd_batch_cap(32, p99_ms=100.0, slo_ms=1000.0, hi=32) == 32  # never above hi
    assert aimd_batch_cap(1, p99_ms=5000.0, slo_ms=1000.0) == 1  # never below lo
    assert aimd_batch_cap(2, p99_ms=5000.0, slo_ms=1000.0) == 1  # always moves when it can


def test_aimd_recovers_after_a_spike():
    cap = 32
    for _ in range(3):
        cap = aimd_batch_cap(cap, 1200.0, 1000.0)
    assert cap == 13  # 32 -> 24 -> 18 -> 13
    steps = 0
    while cap < 32:
        cap = aimd_batch_cap(cap, 200.0, 1000.0)
        steps += 1
    assert steps == 19


def test_aimd_grows_when_the_time_is_queueing():
    assert aimd_batch_cap(16, p99_ms=3000.0, slo_ms=1000.0, service_p99_ms=400.0) == 17
    assert aimd_batch_cap(16, p99_ms=3000.0, slo_ms=1000.0, service_p99_ms=2000.0) == 12


def test_percentile_and_buckets():
    assert percentile([], 99) == 0.0
    assert percentile([5.0], 99) == 5.0
    xs = list(range(1, 101))
    assert percentile(xs, 50) == pytest.approx(50.5) and percentile(xs, 99) == pytest.approx(99.01)
    assert length_bucket(100, 20) == length_bucket(127, 31) != length_bucket(128, 20)
    assert bucket_distance(length_bucket(10, 10), length_bucket(2000, 10)) > bucket_distance(
        length_bucket(10, 10), length_bucket(30, 10))
