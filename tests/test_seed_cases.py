"""The seed's scenarios on a Backend: the same scenario whoever runs it (the simulator on any
cost model, or the live engine of benchmarks.seed_cases), at the size and lengths asked."""
from __future__ import annotations

import statistics

import pytest

from batchserve.config import CacheConfig, EngineConfig, LevelConfig, ModelConfig, QueueConfig, SchedulerConfig
from batchserve.scenarios import SIM, Backend, scenario_result
from batchserve.scenarios.common import GPU, MODEL
from batchserve.sim.cost import RooflineCost
from batchserve.sim.runner import simulate


def _figures(res) -> list[tuple]:
    return [(r.metric, r.seed_before, r.seed_after, r.sim_before, r.sim_after) for r in res.rows]


@pytest.mark.parametrize("name", ["priority-flood", "static-vs-continuous"])
def test_a_backend_runs_the_scenario_the_simulator_runs(name: str) -> None:
    cost = RooflineCost(GPU, MODEL)
    calls: list[tuple[EngineConfig, list]] = []

    def run(config, items, slo_ms=None):
        calls.append((config, list(items)))
        return simulate(config, cost, items, slo_ms)

    mine = scenario_result(name, None, 0, Backend("mine", run=run, size=0.02))
    again = scenario_result(name, None, 0, Backend("sim", cost=cost, size=0.02))
    assert _figures(mine) == _figures(again)  # its own run, or the simulator's: the same figures
    n = {"priority-flood": 160, "static-vs-continuous": 40}[name]
    assert calls and all(len(items) == n for _, items in calls)  # 8000 / 2000 requests x 0.02
    assert {c.scheduler.policy for c, _ in calls} >= {"continuous"}
    assert "| mine: " in mine.markdown() and not mine.notes  # the A100's notes are not about this backend
    assert SIM.seed_hardware and again.label == "sim"


def test_the_cascade_runs_with_continuous_s_seats() -> None:
    cost = RooflineCost(GPU, MODEL)
    seen: dict[str, EngineConfig] = {}

    def run(config, items, slo_ms=None):
        seen[config.scheduler.policy] = config
        return simulate(config, cost, items, slo_ms)

    scenario_result("static-vs-continuous", None, 0, Backend("mine", run=run, size=0.02))
    # a cascade with fewer decode seats than continuous has loses throughput to the cap, not to cascading
    assert seen["cascade"].scheduler.decode_max_batch == seen["continuous"].scheduler.max_num_seqs


def test_a_backend_scales_lengths_and_loads_follow_its_capacity() -> None:
    cost = RooflineCost(GPU, MODEL)
    seen: dict[float, list] = {}

    def run(scale):
        def go(config, items, slo_ms=None):
            seen.setdefault(scale, []).append(items)
            return simulate(config, cost, items, slo_ms)
        return go

    full = scenario_result("priority-flood", None, 0, Backend(run=run(1.0), size=0.02))
    half = scenario_result("priority-flood", None, 0, Backend(run=run(0.5), size=0.02, scale=0.5))
    prompt = {s: statistics.fmean(w.prompt_len for w in items[0]) for s, items in seen.items()}
    assert 0.4 < prompt[0.5] / prompt[1.0] < 0.6
    assert "lengths here x0.5" in half.setup[0]
    # the base rate is the same share of each side's saturation throughput: shorter requests, more of them
    assert half.runs["levels"][0] > full.runs["levels"][0]


TINY = {"vocab_size": 32768, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048}


@pytest.fixture(scope="module")
def live():
    from batchserve.runner.loader import load_model
    from batchserve.runner.model_runner import ModelRunner
    from benchmarks.seed_cases import Live

    mcfg = ModelConfig(model="dummy", dummy_config=TINY, num_threads=1)
    ccfg = CacheConfig(block_size=16, kv_cache_gb=0.02)
    loaded = load_model(mcfg)
    return Live(ModelRunner(loaded, mcfg, ccfg), loaded.tokenizer, loaded.config.eos_token_id)


@pytest.mark.kernel
def test_live_backend_ends_every_request_and_frees_every_block(live) -> None:
    """A queue cap refuses with 503 and Retry-After; every accepted request is answered with
    its full length; the engine's pool is whole again."""
    from batchserve.bench.workload import make_workload

    items = make_workload("priority-flood", 30, 1e4, seed=3, scale=0.25)
    cfg = EngineConfig(cache=CacheConfig(block_size=16),
                       scheduler=SchedulerConfig(policy="continuous", max_num_seqs=4),
                       queue=QueueConfig(levels=(LevelConfig("all", tuple(range(0, 11)), capacity=6),)))
    res = live.run(cfg, items)
    refused = [r for r in res.records if r.status == 503]
    done = [r for r in res.records if r.status == 200]
    assert len(res.records) == 30 and refused and done and len(refused) + len(done) == 30
    assert all(r.retry_after_s is not None for r in refused)
    want = {f"r{k}": w.max_tokens for k, w in enumerate(items)}
    assert all(r.output_tokens == want[r.id] and r.end_time >= r.first_token_time > r.send_time for r in done)
    assert res.summary["n_rejected"] == len(refused)
    assert res.engine_stats["tokens_computed"] >= sum(w.prompt_len + w.max_tokens - 1 for w in items
                                                      if f"r{items.index(w)}" in {r.id for r in done})
    kv = live.last_engine.kv
    assert kv.num_free_blocks == kv.num_blocks


@pytest.mark.kernel
def test_live_backend_runs_a_scenario(live) -> None:
    res = scenario_result("adaptive-window", None, 0, Backend("live", run=live.run, size=0.01))
    assert res.label == "live" and len(res.rows) == 7
    assert any(r.metric.startswith("day goodput") for r in res.rows)
    for label, (_, run) in res.runs.items():
        assert run.summary["n_ok"] == len(run.records), label  # no SLO failure here is an error
        assert run.num_steps > 0 and run.busy_s > 0
