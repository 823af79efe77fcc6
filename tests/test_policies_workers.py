"""`--cascade-workers`: prefill and decode in two worker processes with the KV blocks handed
across. On a small random-weight model: the same greedy tokens as the one-process cascade
(with prefix caching on, so shared blocks cross too), a measured hand-off, and a control
showing the test would catch a missing hand-off."""
from __future__ import annotations

import dataclasses
import random

import pytest

from batchserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from batchserve.engine.clock import SimClock
from batchserve.engine.engine import LLMEngine
from batchserve.request import SamplingParams
from batchserve.runner.profiler import TINY_MODEL

pytestmark = pytest.mark.kernel

SYSTEM = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]  # a shared prefix of three 4-token blocks


def config(workers: bool, prefix_caching: bool, kv_cache_dtype: str = "auto") -> EngineConfig:
    int8 = kv_cache_dtype == "int8"  # its kernels want head_dim 64 and blocks of 16
    model = dict(TINY_MODEL, num_hidden_layers=3, **({"hidden_size": 128, "num_attention_heads": 2} if int8 else {}))
    return EngineConfig(
        model=ModelConfig(model="dummy", dummy_config=model, num_threads=1),
        cache=CacheConfig(block_size=16 if int8 else 4, num_blocks=256, prefix_caching=prefix_caching,
                          kv_cache_dtype=kv_cache_dtype),
        scheduler=SchedulerConfig(policy="cascade", prefill_max_batch=2, decode_max_batch=3, cascade_ratio=2,
                                  max_num_batched_tokens=32, cascade_workers=workers))


def workload():
    rng = random.Random(5)
    return [(0.0 if i == 0 else 0.05 + 0.01 * i, SYSTEM + [rng.randint(20, 500) for _ in range(rng.randint(1, 30))],
             rng.randint(2, 14)) for i in range(10)]


def run(eng: LLMEngine) -> dict[str, list[int]]:
    pending = list(enumerate(workload()))
    done = {}
    while pending or eng.has_unfinished:
        now = eng.clock.now()
        while pending and pending[0][1][0] <= now:
            i, (_, prompt, m) = pending.pop(0)
            eng.add_request(prompt, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True), now=now,
                            request_id=f"r{i}")
        for o in eng.step(now=now).outputs:
            if o.finished:
                done[o.request_id] = o.token_ids
        eng.clock.advance(0.01)
    assert not eng.scheduler.has_unfinished
    eng.kv.check_all_free()
    return done


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    return run(LLMEngine.from_config(config(False, False), clock=SimClock()))


def run_workers(cfg: EngineConfig) -> tuple[dict[str, list[int]], dict, LLMEngine]:
    """`run` on an engine with cascade workers, which are shut down after; and their stats."""
    eng = LLMEngine.from_config(cfg, clock=SimClock())
    try:
        got = run(eng)
        stats = eng.executor.stats()
    finally:
        eng.executor.close()
    return got, stats, eng


def test_workers_give_the_same_tokens_and_measure_the_handoff(reference):
    got, stats, eng = run_workers(config(True, True))
    assert got == reference
    assert eng.kv.prefix_hit_rate > 0
    assert stats["prefill_steps"] > 0 and stats["decode_steps"] > 0
    # every request's prompt blocks crossed from prefill to decode at least once
    assert stats["handoffs"] >= 10 and stats["handoff_blocks"] >= 10
    assert stats["handoff_bytes"] == stats["handoff_blocks"] * eng.executor.block_bytes
    assert stats["handoff_seconds"] > 0


def test_without_the_handoff_the_tokens_differ(reference):
    """Control: the decode worker reading a pool the prefill worker never shared."""
    eng = LLMEngine.from_config(config(True, False), clock=SimClock())
    eng.executor._handoff = lambda to, seqs: None
    try:
        got = run(eng)
    finally:
        eng.executor.close()
    assert got != reference


def test_workers_hand_off_an_int8_cache():
    """The int8 cache's blocks (values and scales, K and V rows of different widths) cross intact:
    the same greedy tokens as the one-process cascade on an int8 cache."""
    from batchserve.runner.kernels import fused_ops_ext, paged_attention_ext

    kernel = paged_attention_ext()
    if kernel is None or fused_ops_ext() is None or not kernel.prefill_supported(64):
        pytest.skip("the int8 cache's C++ kernels do not run here")
    want = run(LLMEngine.from_config(config(False, False, "int8"), clock=SimClock()))
    got, stats, _ = run_workers(config(True, False, "int8"))
    assert got == want
    assert stats["handoff_blocks"] >= 10


def test_workers_need_the_cascade_policy():
    from batchserve.config import ConfigError

    with pytest.raises(ConfigError, match="cascade_workers"):
        dataclasses.replace(SchedulerConfig(), cascade_workers=True)
