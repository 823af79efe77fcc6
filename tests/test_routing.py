"""The pieces of `serve --ray` that need no Ray: routing decisions, the prefix hashes a router
computes, and the KV hand-off between two engines (export on one, adopt on another)."""
from __future__ import annotations

import random

import pytest

from batchserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from batchserve.core.kv_cache import prefix_hashes
from batchserve.distributed.routing import Candidate, load, prefix_match, rank
from batchserve.engine.engine import LLMEngine
from batchserve.request import SamplingParams
from batchserve.runner.profiler import TINY_MODEL


def cand(key: int, waiting_tokens: dict[int, int] | None = None, running: int = 0,
         prefix: frozenset[int] | None = None) -> Candidate:
    wt, w = [0] * 11, [0] * 11
    for p, n in (waiting_tokens or {}).items():
        wt[p] += n
        w[p] += 1
    return Candidate(key, wt, w, running, prefix=prefix)


def test_load_counts_only_work_at_or_above_the_priority():
    c = cand(0, {2: 500, 8: 100})
    assert load(c, 9) == 0
    assert load(c, 8) == 100 + 32
    assert load(c, 0) == 600 + 64
    c.pending[9] = 50
    assert load(c, 9) == 50


def test_power_of_two_choices_takes_the_less_loaded_of_the_pair():
    busy, idle = cand(0, {5: 2000}), cand(1)
    rng = random.Random(0)
    for _ in range(20):  # with two replicas the pair is both of them: the idle one always wins
        order = rank([busy, idle], 5, rng=rng)
        assert order == [1, 0]


def test_a_high_priority_request_ignores_low_priority_backlog():
    low_backlog, high_backlog = cand(0, {1: 5000}), cand(1, {9: 300})
    assert rank([low_backlog, high_backlog], 9, rng=random.Random(1))[0] == 0
    assert rank([low_backlog, high_backlog], 1, rng=random.Random(1))[0] == 1


def test_burst_spreads_when_pending_work_is_counted():
    cands = [cand(k) for k in range(4)]
    rng = random.Random(3)
    counts = [0] * 4
    for _ in range(40):  # the router adds each placed request's cost to `pending`
        key = rank(cands, 5, rng=rng)[0]
        counts[key] += 1
        cands[key].pending[5] += 100
    assert max(counts) - min(counts) <= 3, counts


def test_prefix_holder_wins_unless_its_backlog_outweighs_the_saving():
    tokens = list(range(1000))
    hashes = prefix_hashes(tokens, 16)  # 62 full blocks: 992 tokens the holder need not compute
    holder = cand(0, {5: 300}, prefix=frozenset(hashes))
    others = [cand(k) for k in (1, 2, 3)]
    assert prefix_match(holder, hashes) == len(hashes) == 62
    for seed in range(10):  # the holder joins whichever pair is sampled
        assert rank([holder] + others, 5, hashes, random.Random(seed), len(tokens), 16)[0] == 0
    swamped = cand(0, {5: 5000}, prefix=frozenset(hashes))
    assert rank([swamped] + others, 5, hashes, random.Random(0), len(tokens), 16)[0] != 0
    short = prefix_hashes(tokens[:100], 16)  # 6 blocks: 96 tokens saved do not pay for 332 queued
    assert rank([holder, others[0]], 5, short, random.Random(0), 100, 16)[0] == 1
    partial = cand(2, prefix=frozenset(hashes[:2]))
    assert prefix_match(partial, hashes) == 2


def test_router_hashes_match_the_blocks_an_engine_caches(make_fake_engine):
    eng = make_fake_engine(num_blocks=64, block_size=4)
    eng.kv.prefix_caching = True
    prompt = list(range(10, 31))  # 21 tokens: 5 full blocks
    eng.add_request(prompt, SamplingParams(max_tokens=2, temperature=0.0))
    while eng.has_unfinished:
        eng.step()
    cached = eng.kv.cached_hashes()
    assert set(prefix_hashes(prompt, 4)) <= cached
    assert len(prefix_hashes(prompt, 4)) == 5
    assert set(prefix_hashes(prompt[:-1] + [999], 4)[:4]) <= cached  # same first 4 blocks


# --- KV hand-off between two engines ----------------------------------------------------------
def tiny_engine(num_blocks: int = 64, **sched) -> LLMEngine:
    from batchserve.runner.loader import load_model
    from batchserve.runner.model_runner import ModelRunner

    cfg = EngineConfig(model=ModelConfig(model="dummy", dummy_config=TINY_MODEL, num_threads=1),
                       cache=CacheConfig(block_size=4, num_blocks=num_blocks), scheduler=SchedulerConfig(**sched))
    runner = ModelRunner(load_model(cfg.model), cfg.model, cfg.cache)
    return LLMEngine(cfg, runner, None, None)


def run_all(eng: LLMEngine) -> dict[str, list[int]]:
    done = {}
    while eng.has_unfinished:
        for out in eng.step().outputs:
            if out.finished:
                done[out.request_id] = out.token_ids
    eng.kv.check_all_free()
    return done


def prefill_and_export(eng: LLMEngine, prompt: list[int], params: SamplingParams):
    """Run `prompt` on `eng` to its first token; return (first token, K/V); the request leaves."""
    req = eng.add_request(prompt, params, request_id="x")
    while not req.output_token_ids:
        eng.step()
    kv = eng.executor.export_kv(eng.kv.block_table("x"), len(prompt))
    first = req.output_token_ids[0]
    eng.abort("x")
    run_all(eng)
    return first, kv


@pytest.mark.kernel
@pytest.mark.parametrize("decode_blocks", [64, 12])
def test_adopted_request_continues_exactly_as_one_engine(decode_blocks):
    """Prefill on one engine, decode on another from the handed-over K/V: the same greedy
    tokens as a single engine. With 12 blocks the decode engine is too full to adopt the K/V
    (another request holds most blocks), so it queues the request and recomputes its prompt."""
    params = SamplingParams(max_tokens=12, temperature=0.0)
    prompts = [list(range(3, 30)), list(range(40, 47))]
    single = tiny_engine()
    for i, p in enumerate(prompts):
        single.add_request(p, params, request_id=f"r{i}")
    want = run_all(single)

    prefill, decode = tiny_engine(), tiny_engine(num_blocks=decode_blocks)
    blocker = decode.add_request(list(range(100, 128)), SamplingParams(max_tokens=4, temperature=0.0))
    decode.step()  # the blocker holds 7 blocks now
    got = {}
    for i, p in enumerate(prompts):
        first, kv = prefill_and_export(prefill, p, params)
        assert tuple(kv.shape) == (2, 2, len(p), 2, 16)
        decode.add_prefilled(p, first, kv, params, request_id=f"r{i}")
        got.update(run_all(decode))
    assert blocker.finished
    assert {k: got[k] for k in want} == want
    if decode_blocks == 12:
        assert decode.scheduler.requests == {}  # nothing stuck; blocks checked in run_all


@pytest.mark.kernel
def test_adopt_rejects_kv_of_another_shape():
    eng = tiny_engine()
    import torch

    with pytest.raises(ValueError, match="KV hand-off: K/V for 4 positions, prompt has 5"):
        eng.add_prefilled(list(range(5)), 7, torch.zeros(2, 2, 4, 2, 16), SamplingParams(max_tokens=3))
    with pytest.raises(ValueError, match="does not match this model"):
        eng.add_prefilled(list(range(5)), 7, torch.zeros(2, 2, 5, 3, 16), SamplingParams(max_tokens=3),
                          request_id="y")
    eng.step()
    assert not eng.has_unfinished
    eng.kv.check_all_free()
