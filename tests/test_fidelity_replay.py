"""The fidelity benchmark's speed replay, without a model: the curve it measures from a live
run's steps, and the cost that prices simulated steps by it."""
from __future__ import annotations

import json
import statistics

import pytest

from batchserve.bench.workload import make_workload
from batchserve.config import EngineConfig, SchedulerConfig
from batchserve.core.batch import ScheduledBatch, ScheduledSeq
from batchserve.engine.clock import SimClock
from batchserve.request import SamplingParams
from batchserve.sim.cost import ProfiledCost
from batchserve.sim.simulator import Simulator
from benchmarks.fidelity import ReplayedSpeed, speed_curve

P = SamplingParams()
COEF = {"const": 0.005, "decode_seq": 1e-3, "prompt": 0.01, "mixed": 0.004}


@pytest.fixture
def profile(tmp_path) -> str:
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"fit": {"coef": COEF, "context_len": 128}, "num_blocks": 4096}))
    return str(path)


def decode(b: int) -> ScheduledBatch:
    return ScheduledBatch([ScheduledSeq(f"d{i}", [5], 100, [], True, P, 1) for i in range(b)])


def test_the_curve_is_measured_over_priced_time_per_window_and_bridges_gaps() -> None:
    steps = [(0.5, 0.02, 0.01, False), (1.9, 0.06, 0.02, True), (4.5, 0.01, 0.01, False)]
    price = lambda p, prompt: p * (1.5 if prompt else 1.0)  # noqa: E731
    curve = speed_curve(steps, price, window_s=2.0)
    # window 0: (0.02 + 0.06) / (0.01 + 0.03); window 1 has no step and keeps it; window 2: 1
    assert curve == pytest.approx([2.0, 2.0, 1.0])
    assert speed_curve([], price, window_s=2.0) == [1.0]


def test_a_replayed_step_is_priced_at_its_windows_speed(profile) -> None:
    base = ProfiledCost(profile, overhead_s=0.001, scale=0.5)
    clock = SimClock()
    cost = ReplayedSpeed(base, [3.0, 1.0], clock, window_s=2.0)
    runner = base.step_time(decode(2)) - 0.001
    assert runner == pytest.approx(0.5 * 0.007)
    clock.set(1.0)
    assert cost.step_time(decode(2)) == pytest.approx(3 * runner + 0.001)
    clock.set(2.5)
    assert cost.step_time(decode(2)) == pytest.approx(runner + 0.001)
    clock.set(60.0)  # past the live run's end: its last window
    assert cost.step_time(decode(2)) == pytest.approx(runner + 0.001)
    flat = ReplayedSpeed(base, [3.0, 1.0], SimClock(), flat=0.004, window_s=2.0)
    assert flat.step_time(decode(1)) == flat.step_time(decode(8)) == pytest.approx(0.012 + 0.001)


def test_a_constant_replayed_speed_simulates_as_the_same_scale(profile) -> None:
    cfg = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=16))
    items = make_workload("chat", 60, 20.0, seed=3, scale=0.2)
    scaled = Simulator(cfg, ProfiledCost(profile, scale=1.7)).run(items).summary
    sim = Simulator(cfg, ProfiledCost(profile))
    sim.executor.cost = ReplayedSpeed(ProfiledCost(profile), [1.7] * 4, sim.clock)
    replayed = sim.run(items).summary
    assert replayed["latency"]["e2e_ms"] == pytest.approx(scaled["latency"]["e2e_ms"])
    assert replayed["throughput_rps"] == pytest.approx(scaled["throughput_rps"])


def test_the_paired_table_pools_every_speed_curve_and_names_the_best_fixed_point() -> None:
    from benchmarks.adaptive_paired import configs, markdown

    names = list(configs())
    assert names[0] == "adaptive" and len(names) == 5

    def row(ran: str, live: float, adaptive: float, fixed: dict[str, float]) -> dict:
        rep = {k: (fixed.get(k, 1.0), 0.0) for k in names}
        rep["adaptive"] = (adaptive, 0.0)
        return {"round": 1, "ran": ran, "live": (live, 2000.0), "calibration": {"scale": 0.8}, "curve": [0.7, 1.2],
                "replayed": rep}

    rows = [row("adaptive", 3.0, 6.0, {"50 ms / 32": 5.0}), row("50 ms / 32", 5.0, 4.0, {"50 ms / 32": 4.5})]
    text = markdown(rows, {"cap": 10.0, "slo_ms": 2000.0, "regime": "day", "n": 160, "rounds": 1, "seed": 0})
    # replayed: 6 + 4 against 5 + 4.5 for 50 ms / 32; live: 3 against 5
    assert "adaptive 10.00 against 9.50 for 50 ms / 32 (**1.053x**)" in text
    assert "curves only: 4.00 against 4.50 for 50 ms / 32 (0.889x)" in text
    assert "adaptive 3.00 against 5.00 for 50 ms / 32 (0.600x)" in text
    assert "| 1.200x |" in text and "| 0.889x |" in text  # each curve: adaptive over that curve's best fixed point


def test_jittered_steps_keep_their_mean_and_draw_the_set_spread(profile) -> None:
    base = ProfiledCost(profile, overhead_s=0.001)
    runner = base.step_time(decode(4)) - 0.001
    draws = [ReplayedSpeed(base, [2.0], SimClock(), jitter=0.1, seed=7) for _ in range(2)]
    times = [[(c.step_time(decode(4)) - 0.001) / (2.0 * runner) for _ in range(4000)] for c in draws]
    assert times[0] == times[1]  # the same seed draws the same steps
    assert statistics.fmean(times[0]) == pytest.approx(1.0, abs=0.01)
    assert statistics.pstdev(times[0]) == pytest.approx(0.1, abs=0.01)
    a, b = (ReplayedSpeed(base, [2.0], SimClock(), jitter=0.1, seed=s) for s in (7, 8))
    assert [a.step_time(decode(4)) for _ in range(3)] != [b.step_time(decode(4)) for _ in range(3)]
    still = ReplayedSpeed(base, [2.0], SimClock())
    assert still.step_time(decode(4)) == pytest.approx(2.0 * runner + 0.001)


def test_the_curves_spread_is_the_median_over_curves_of_each_ones_draws() -> None:
    from benchmarks.adaptive_curves import spread

    groups = [[{"a": 1.0}, {"a": 3.0}], [{"a": 2.0}, {"a": 2.0}], [{"a": 4.0}, {"a": 6.0}]]
    # per curve: 1/2, 0, 1/5 -> median 0.2
    assert spread(groups, "a") == pytest.approx(0.2)


def test_the_live_best_fixed_point_is_also_judged_on_rounds_it_was_not_picked_on() -> None:
    from benchmarks.adaptive import held_out, table

    # (0, 16) looks best on every round but the second, where its luck ran out
    runs = {(0.0, 16): [10.0, 6.0, 9.0], (50.0, 32): [8.0, 8.0, 8.0]}
    # round 1: picked on rounds 2, 3 -> (50, 32) (median 8 vs 7.5), it ran 8; round 2: picked on
    # 1, 3 -> (0, 16), it ran 6; round 3: on 1, 2 -> (0, 16) (8 vs 8, the first), 9 -> median 8
    assert held_out(runs) == 8.0
    assert held_out({(0.0, 16): [10.0]}) is None
    row = {"regime": "day", "rate": 12.0, "slo_ms": 1100.0, "best": (0.0, 16), "best_goodput": 9.0,
           "best_p99": 1500.0, "default": (8.0, 1400.0), "adaptive_goodput": 8.4, "adaptive_p99": 2000.0,
           "round_goodputs": [(8.0, 10.0), (8.4, 6.0), (9.0, 9.0)], "held_out": 8.0}
    line = table([row], slo=True, p99="P99")[2]
    assert "| 0.933x | 0.80, 1.40, 1.00 | 1.050x (8.00) |" in line
    # simulated rows have neither rounds nor a held-out pick
    simulated = {k: v for k, v in row.items() if k not in ("round_goodputs", "held_out")}
    head, _, line = table([simulated], slo=True, p99="P99")
    assert "picked on the other rounds" not in head and "| 0.933x | 1,500 / 2,000 | 8.00 |" in line
    head, _, line = table([{**simulated, "continuous": (11.5, 900.0)}], slo=True, p99="P99")
    assert head.endswith("| `continuous` goodput, worst P99 (ms) |") and line.endswith("| 8.00 | 11.50, 900 |")


def test_fidelity_names_an_unknown_warmup_protocol() -> None:
    from benchmarks.fidelity import run_fidelity

    with pytest.raises(ValueError, match="warmup: 'twice' is not one of once, each"):
        run_fidelity(None, "no-profile.json", 10, [1.0], warmup="twice")
