"""The `dynamic` policy with the fake executor and a virtual clock: the adaptive window, the
SLO-steered batch cap and length bucketing."""
from __future__ import annotations

import random

import pytest

from tests.policy_helpers import SizedFakeExecutor, drive, req


def test_dynamic_window_shrinks_under_load_and_grows_when_idle(make_fake_engine):
    eng = make_fake_engine(policy="dynamic", window_min_ms=10.0, window_max_ms=1000.0, max_batch=32,
                           slo_p99_ms=60_000.0, num_blocks=512)
    pol = eng.scheduler.policy
    eng.add_request(now=0.0, **req("idle0", 4, 2))
    eng.step(now=0.0)
    assert pol.window_ms == 1000.0  # no arrival rate yet: idle, longest window
    drive(eng)
    # a burst: 40 requests 1 ms apart -> fast arrivals and a deep queue
    t0 = eng.clock.now()
    for i in range(40):
        eng.add_request(now=t0 + i * 0.001, **req(f"b{i}", 4, 2))
    eng.step(now=t0 + 0.04)
    assert pol.window_ms == 10.0
    drive(eng)
    # a steady 50 requests/s with a shallow queue: about the time to fill the batch at that rate
    windows = []
    for i in range(40):
        t = eng.clock.now()
        eng.add_request(now=t, **req(f"m{i}", 4, 2))
        eng.step(now=t)
        if i >= 20 and len(eng.scheduler.waiting):
            windows.append((len(eng.scheduler.waiting), pol.window_ms))
        eng.clock.advance(0.02)
    drive(eng)
    assert windows and all(10.0 < w < 1000.0 for _, w in windows)
    pairs = [(a, b) for a, b in zip(windows, windows[1:]) if b[0] > a[0]]
    assert len(pairs) > 5 and all(b[1] < a[1] for a, b in pairs)  # a deeper queue: a shorter window
    # idle again: a lone request after a long silence gets the long window back
    t2 = eng.clock.now() + 30.0
    eng.clock.set(t2)
    eng.add_request(now=t2, **req("idle1", 4, 2))
    eng.step(now=t2)
    assert pol.window_ms == 1000.0
    drive(eng)


def test_dynamic_window_never_exceeds_what_the_slo_leaves(make_fake_engine):
    eng = make_fake_engine(policy="dynamic", window_min_ms=10.0, window_max_ms=500.0, slo_p99_ms=200.0,
                           max_batch=32)
    pol = eng.scheduler.policy
    eng.add_request(now=0.0, **req("a", 4, 10))
    eng.step(now=0.0)
    assert pol.window_ms == 200.0  # the SLO, not window_max_ms
    done = drive(eng)
    assert pol.service_ms == pytest.approx(100.0, abs=20.0)  # measured: 10 steps of 10 ms
    t = eng.clock.now() + 1.0
    eng.clock.set(t)
    eng.add_request(now=t, **req("b", 4, 10))
    eng.step(now=t)
    assert pol.window_ms == pytest.approx(200.0 - pol.service_ms)
    done.update(drive(eng))
    assert set(done) == {"a", "b"}


def test_dynamic_batch_cap_falls_near_slo_and_recovers(make_fake_engine):
    eng = make_fake_engine(policy="dynamic", max_batch=16, slo_p99_ms=1000.0, window_min_ms=0.0,
                           window_max_ms=20.0, num_blocks=1024)
    eng.executor = SizedFakeExecutor(1024)  # a step of 16 seqs takes 36 ms, of 8 seqs 20 ms
    pol = eng.scheduler.policy
    # heavy phase: bursts of 16 with 40-token outputs: a batch of 16 takes 40 x 36 ms = 1.4 s,
    # over the SLO on its own (service, not queueing), so the cap must fall
    heavy = [(k * 1.5 + i * 0.001, req(f"h{k}-{i}", 4, 40)) for k in range(6) for i in range(16)]
    drive(eng, heavy)
    assert pol.cap_changes and pol.cap_changes[0][1] == 12  # multiplicative: 16 -> 12
    low = pol.max_batch
    assert low < 16
    assert pol.p99_ms >= 900.0 or pol.cap_changes[-1][1] == low
    # light phase: short outputs, spaced out -> lots of headroom, the cap climbs back
    t = eng.clock.now()
    light = [(t + i * 0.05, req(f"l{i}", 4, 2)) for i in range(200)]
    drive(eng, light)
    assert pol.max_batch > low
    assert pol.max_batch == 16 and pol.cap_changes[-1][1] == 16


def test_dynamic_cap_holds_when_queueing_not_batch_size_is_the_problem(make_fake_engine):
    """Overload with cheap batches: P99 is over the SLO because of the queue; cutting the
    batch would lower throughput, so the cap must not collapse."""
    eng = make_fake_engine(policy="dynamic", max_batch=8, slo_p99_ms=300.0, window_min_ms=0.0,
                           window_max_ms=10.0, num_blocks=1024)
    pol = eng.scheduler.policy
    drive(eng, [(i * 0.004, req(f"r{i}", 4, 5)) for i in range(300)])  # 250/s, serves ~160/s
    assert pol.p99_ms > 300.0
    assert pol.max_batch == 8 and not pol.cap_changes


def test_dynamic_length_buckets_cut_padding(make_fake_engine):
    def run(bucket: bool) -> float:
        eng = make_fake_engine(policy="dynamic", max_batch=4, window_min_ms=50.0, window_max_ms=50.0,
                               bucket_by_length=bucket, num_blocks=1024, slo_p99_ms=1e6)
        rng = random.Random(1)
        arrivals = []
        for i in range(32):  # two classes, interleaved
            short = i % 2 == 0
            plen, m = (rng.randint(3, 6), rng.randint(2, 4)) if short else (rng.randint(40, 60), rng.randint(20, 30))
            arrivals.append((0.0, req(f"r{i}", plen, m)))
        done = drive(eng, arrivals)
        assert len(done) == 32
        return eng.scheduler.policy.padding_fraction

    plain, bucketed = run(False), run(True)
    assert bucketed < 0.5 * plain
