"""The adaptive benchmark's method, without a model: what a seed replays, and the held-out pick."""
from __future__ import annotations

import statistics

import pytest

from batchserve.bench.traces import sample_path
from benchmarks.adaptive import compare, held_out, regime_items, trace_draw


def test_seed_zero_replays_the_packaged_sample_and_others_a_fresh_draw(tmp_path):
    with open(trace_draw("burstgpt", 0, str(tmp_path)), "rb") as a, open(sample_path("burstgpt"), "rb") as b:
        assert a.read() == b.read()
    zero, one = (regime_items("BurstGPT replay", 6.0, 1000, s) for s in (0, 1))
    assert 350 < len(one) <= 400 and 350 < len(zero) <= 400  # 400 rows, less those with no response
    assert [w.arrival for w in zero] != [w.arrival for w in one]
    assert [w.max_tokens for w in zero] != [w.max_tokens for w in one]
    again = regime_items("BurstGPT replay", 6.0, 1000, 1)
    assert [(w.arrival, w.prompt_len) for w in again] == [(w.arrival, w.prompt_len) for w in one]


def test_held_out_judges_each_pick_on_the_seed_it_did_not_see():
    # "lucky" wins one seed by a mile and loses the others; "steady" is second everywhere
    goodputs = {"lucky": [9.0, 1.0, 1.0], "steady": [2.0, 2.0, 2.0]}
    assert max(goodputs, key=lambda k: statistics.fmean(goodputs[k])) == "lucky"  # hindsight: 3.67 against 2
    # leaving seed 0 out picks steady (2), leaving 1 or 2 out picks lucky (5 on the others), judged at 1.0
    assert held_out(goodputs, statistics.fmean) == pytest.approx((2.0 + 1.0 + 1.0) / 3)
    assert held_out(goodputs) == 1.0  # medians, as the live rounds use
    assert held_out({"a": [1.0], "b": [2.0]}) is None


@pytest.mark.slow
def test_compare_picks_the_grid_point_with_the_most_goodput():
    one, two = (compare("night", 1.0, 5000.0, 40, seeds) for seeds in ([0], [0, 1]))
    assert one["held_out"] is None and two["held_out"] is not None  # nothing to leave out with one seed
    for row in (one, two):
        assert row["best"] not in ("adaptive", "continuous") and row["best_goodput"] >= row["default"][0]
        assert row["adaptive_goodput"] > 0 and row["continuous"][0] > 0  # the token-level reference beside


def test_the_tpot_comparison_judges_every_point_by_the_same_targets():
    from benchmarks.adaptive_tpot import compare as compare_tpot

    row = compare_tpot("short-long", 20.0, 3000.0, 40.0, 1.0, 0.5, 40, [0, 1])
    assert row["e2e_ms"] == 3000.0 and row["tpot_ms"] == 40.0  # the end-to-end target: 1x the P99 given
    assert tuple(row["best"]) not in (("adaptive",), ("continuous",)) and row["held_out"] is not None
    for who in ("best", "adaptive"):  # goodput per second of offered traffic, attainment per request
        assert row[f"{who}_goodput"] > 0 and 0 < row[f"{who}_attainment"] <= 1
    assert row["continuous"]["goodput"] > 0 and 0 < row["continuous"]["attainment"] <= 1  # the reference beside


def test_the_tpot_table_puts_continuous_beside_the_grid():
    from benchmarks.adaptive_tpot import markdown

    row = {"mix": "chat", "tpot_ms": 20.0, "e2e_ms": None, "share": 0.7, "rate": 18.3, "best": [10.0, 4],
           "best_goodput": 12.0, "best_attainment": 0.67, "best_p99": 40000.0, "adaptive_goodput": 6.0,
           "adaptive_attainment": 0.3, "adaptive_p99": 5000.0, "held_out": 12.0, "run_best": [10.0, 32],
           "run_best_goodput": 5.0, "run_adaptive_goodput": 5.5,
           "continuous": {"goodput": 18.0, "attainment": 0.98, "run_goodput": 17.5, "p99": 1500.0}}
    meta = {"calibration": {"chat": (27.5, 2900.0)}, "n": 300, "seeds": [0], "eos_cap": 512}
    text = markdown([row], meta, None, "before")
    head, line = text.splitlines()[-3], text.splitlines()[-1]
    assert head.endswith("| `continuous`: goodput, per second of the run, worst P99 (ms) |")
    assert line.endswith("| 10 ms, 32: 5.00; 1.100x | 18.00 (98%); 17.50; 1,500 |")
    assert "token level with 128 seats" in text
    without = markdown([{k: v for k, v in row.items() if k != "continuous"}], meta, None, "before")
    assert "continuous" not in without  # rows written before the column have none
