"""The fidelity benchmark's speed replay, without a model: the curve it measures from a live
run's steps, and the cost that prices simulated steps by it."""
from __future__ import annotations

import json

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
