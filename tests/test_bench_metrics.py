"""Bench metrics: the percentile definition against hand-computed values, summary counts."""
from __future__ import annotations

import numpy as np
import pytest

from batchserve.bench.metrics import SLO, RequestRecord, goodput, parse_slo_args, percentile, span_s, summarize


def test_percentile_hand_computed():
    xs = [15, 20, 35, 40, 50]  # sorted; n - 1 = 4
    # P40: h = 4 * 0.4 = 1.6 -> 20 + 0.6 * (35 - 20) = 29
    assert percentile(xs, 40) == pytest.approx(29.0)
    # P90: h = 3.6 -> 40 + 0.6 * (50 - 40) = 46
    assert percentile(xs, 90) == pytest.approx(46.0)
    assert percentile([50, 15, 40, 20, 35], 50) == 35  # order does not matter
    assert percentile(xs, 0) == 15 and percentile(xs, 100) == 50
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    # P99 of 1..10: h = 9 * 0.99 = 8.91 -> 9 + 0.91 * 1 = 9.91
    assert percentile(list(range(1, 11)), 99) == pytest.approx(9.91)
    rng = np.random.default_rng(0)
    v = rng.exponential(size=101).tolist()
    for q in (1, 50, 90, 99, 99.9):
        assert percentile(v, q) == pytest.approx(float(np.percentile(v, q)))
    with pytest.raises(ValueError):
        percentile(xs, 101)


def _ok(i: int, send: float, first: float, end: float, n: int, cls: str = "a", **kw) -> RequestRecord:
    times = list(np.linspace(first, end, n)) if n > 1 else [first]
    return RequestRecord(f"r{i}", cls, 5, send, first, times, end, 10, n, 200, "length", **kw)


def test_summary_counts_latencies_and_goodput():
    recs = [
        _ok(0, 0.0, 0.1, 0.5, 5),                          # e2e 500 ms, tpot 100 ms
        _ok(1, 1.0, 1.2, 2.0, 3, deadline_ms=800.0),       # misses its 800 ms deadline
        _ok(2, 2.0, 2.05, 2.25, 5, cls="b", deadline_ms=300.0),  # meets it
        RequestRecord("r3", "b", 9, 3.0, status=503, error="overloaded", retry_after_s=2.0, end_time=3.01),
        RequestRecord("r4", "b", 9, 3.0, status=504, error="deadline", end_time=3.5, deadline_ms=400.0),
        RequestRecord("r5", "a", 5, 4.0, 4.1, [4.1, 4.2], None, 10, 2, 200, None, "connection closed",
                      disconnected=True),
        RequestRecord("r6", "a", 5, 5.0, status=500, error="boom", end_time=5.1),
        RequestRecord("r7", "a", 5, 6.0, 6.2, [6.2], 6.3, 10, 1, 200, "deadline", deadline_ms=100.0),
        RequestRecord("r8", "a", 5, 7.0, 7.1, [7.1], 7.2, 10, 1, 200, "rejected"),
        RequestRecord("r9", "a", 5, 8.0, 8.1, [8.1], 8.2, 10, 1, 200, "error", "engine failed"),
    ]
    s = summarize(recs, duration_s=10.0, slo_ms=600.0)
    assert s["n_requests"] == 10 and s["n_ok"] == 3
    assert (s["n_rejected"], s["n_timeout"], s["n_disconnects"], s["n_errors"]) == (2, 2, 1, 2)
    assert (s["n_503"], s["n_504"]) == (1, 1)
    assert s["retry_after_s_mean"] == 2.0
    # good: r0 (no deadline, 500 <= SLO 600), r2 (250 <= 300); not r1 (1000 > 800)
    assert s["n_good"] == 2 and s["goodput_rps"] == pytest.approx(0.2)
    assert s["throughput_rps"] == pytest.approx(0.3)
    assert s["n_deadline_missed"] == 3  # r1 late, r4 504, r7 deadline; r2 met
    assert s["deadline_miss_rate"] == pytest.approx(3 / 4)
    assert s["output_tokens_per_s"] == pytest.approx((5 + 3 + 5 + 2 + 1 + 1 + 1) / 10)
    e2e = s["latency"]["e2e_ms"]
    assert e2e["n"] == 3 and e2e["p50"] == pytest.approx(500.0)
    assert e2e["p90"] == pytest.approx(500 + 0.8 * 500)  # of [250, 500, 1000]: h = 1.8
    ttft = s["latency"]["ttft_ms"]
    assert ttft["mean"] == pytest.approx((100 + 200 + 50) / 3)
    tpot = s["latency"]["tpot_ms"]
    assert sorted([tpot["p50"]]) == [pytest.approx(100.0)]  # of [100, 400, 50]
    assert s["latency"]["itl_ms"]["n"] == 4 + 2 + 4
    assert s["finish_reasons"]["length"] == 3 and s["status_codes"] == {"200": 7, "500": 1, "503": 1, "504": 1}
    a, b = s["per_class"]["a"], s["per_class"]["b"]
    assert (a["n_requests"], a["n_ok"], b["n_requests"], b["n_ok"]) == (7, 2, 3, 1)
    assert b["n_rejected"] == 1 and b["n_timeout"] == 1 and b["priority"] == [5, 9]
    assert b["latency"]["e2e_ms"]["p99"] == pytest.approx(250.0)
    # no SLO: every completed request without a deadline is good
    assert summarize(recs, 10.0)["n_good"] == 2


def test_summary_edge_cases():
    s = summarize([RequestRecord("x", status=503, end_time=1.0)], 1.0)
    assert s["n_ok"] == 0 and s["latency"]["e2e_ms"] == {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None}
    assert s["deadline_miss_rate"] is None
    with pytest.raises(ValueError):
        summarize([], 0.0)
    r = RequestRecord("y", send_time=2.0, end_time=5.0)
    assert span_s([r, RequestRecord("z", send_time=1.0)]) == 4.0
    assert RequestRecord.from_dict(r.to_dict()) == r


def test_slo_parse_and_scopes():
    assert SLO.parse("ttft_ms=500,tpot_ms=50") == SLO(ttft_ms=500.0, tpot_ms=50.0)
    assert SLO.parse("ttft:300 e2el:2000") == SLO(ttft_ms=300.0, e2e_ms=2000.0)  # vllm's spelling
    glob, per = parse_slo_args(["e2e_ms=4000", "high:ttft_ms=200", "e2e=5000"])
    assert glob == SLO(e2e_ms=5000.0) and per == {"high": SLO(ttft_ms=200.0)}  # the last global wins
    for bad in ("ttft_ms", "latency=3", "ttft_ms=abc", "ttft_ms=-1", ""):
        with pytest.raises(ValueError):
            SLO.parse(bad)


def _rec(i: int, cls: str, ttft: float, e2e: float, n: int = 5, **kw) -> RequestRecord:
    """A completed request sent at 0: first token at ttft s, last at e2e s, n tokens."""
    return RequestRecord(f"r{i}", cls, 5, 0.0, ttft, list(np.linspace(ttft, e2e, n)), e2e, 10, n, 200, "length", **kw)


def test_goodput_judges_each_class_by_its_own_slo_and_counts_failures_as_misses():
    recs = [
        _rec(0, "high", 0.1, 0.5),            # TTFT 100 ms, TPOT 100 ms, E2E 500 ms
        _rec(1, "high", 0.3, 0.7),            # TTFT 300: misses high's 200 ms TTFT
        _rec(2, "low", 0.3, 0.7),             # the same request in low: only E2E <= 1000 counts
        _rec(3, "low", 0.1, 1.3),             # E2E 1300 > 1000
        _rec(4, "low", 0.05, 0.05, n=1),      # one token: no TPOT, meets any TPOT target
        _rec(5, "low", 0.1, 0.4, deadline_ms=300.0),  # meets the SLO, misses its own deadline
        RequestRecord("r6", "high", 9, 0.0, status=503, error="full", end_time=0.01),
        RequestRecord("r7", "low", 1, 0.0, status=504, error="deadline", end_time=0.2),
    ]
    glob, per = SLO(e2e_ms=1000.0, tpot_ms=150.0), {"high": SLO(ttft_ms=200.0)}
    g = goodput(recs, 4.0, glob, per)
    assert (g["n_requests"], g["n_good"]) == (8, 3)  # r0, r2, r4
    assert g["attainment"] == pytest.approx(3 / 8) and g["goodput_rps"] == pytest.approx(3 / 4)
    assert g["misses"] == {"deadline": 1, "e2e_ms": 1, "failed": 2, "tpot_ms": 1, "ttft_ms": 1}  # r3 misses two
    hi, lo = g["per_class"]["high"], g["per_class"]["low"]
    assert hi["slo"] == {"ttft_ms": 200.0} and lo["slo"] == {"tpot_ms": 150.0, "e2e_ms": 1000.0}
    assert (hi["n_good"], hi["n_requests"], lo["n_good"], lo["n_requests"]) == (1, 3, 2, 5)
    assert hi["goodput_rps"] == pytest.approx(0.25) and lo["attainment"] == pytest.approx(0.4)
    s = summarize(recs, 4.0, slo=glob, class_slo=per)  # the summary's goodput is this function's
    assert (s["n_good"], s["goodput_frac"], s["goodput"]) == (3, pytest.approx(3 / 8), g)
    assert s["per_class"]["high"]["n_good"] == 1 and s["per_class"]["low"]["goodput_rps"] == pytest.approx(0.5)
    # a tighter TPOT: r0 (100 ms a token) now misses too, in every class that is judged by it
    assert goodput(recs, 4.0, SLO(tpot_ms=90.0))["n_good"] == 1  # r4 alone (r5 late for its deadline)
    # no SLO at all: every completed request within its deadline is good
    assert goodput(recs, 4.0)["n_good"] == 5


def test_a_completed_request_with_no_first_token_seen_is_judged_by_its_end():
    """A stream whose text stayed empty until it ended records no first token; its TTFT
    target is judged at its end, not passed for want of a time."""
    quiet = RequestRecord("q", send_time=0.0, end_time=3.0, output_tokens=4, status=200, finish_reason="stop")
    assert quiet.ok and quiet.ttft is None
    assert quiet.misses(SLO(ttft_ms=1000.0)) == ["ttft_ms"]
    assert quiet.misses(SLO(ttft_ms=5000.0)) == []
