"""Every batching policy with the fake executor and a virtual clock: schedule -> fake output ->
update -> assert. No model. The conftest fixture checks every engine for leaked KV blocks."""
from __future__ import annotations

import pytest

from batchserve.config import CacheConfig, EngineConfig, SchedulerConfig
from batchserve.core.policies import POLICIES, make_policy
from batchserve.engine.clock import SimClock
from batchserve.engine.engine import LLMEngine
from batchserve.request import SamplingParams
from tests.conftest import FakeExecutor
from tests.policy_helpers import drive, expected_tokens, mixed_workload, req

ALL = sorted(POLICIES)


# --- registry ------------------------------------------------------------------------------
def test_registry_and_config_reach_the_policy():
    assert set(ALL) >= {"static", "dynamic", "continuous", "chunked", "cascade"}
    cfg = SchedulerConfig(policy="static", window_ms=7.0, max_batch=3)
    p = make_policy("static", cfg)
    assert p.window_ms == 7.0 and p.max_batch == 3
    with pytest.raises(ValueError, match="unknown"):
        make_policy("nope")


# --- static ----------------------------------------------------------------------------------
def test_static_waits_for_window_then_returns_batch_together(make_fake_engine):
    eng = make_fake_engine(policy="static", window_ms=50.0, max_batch=8)
    for rid, plen, m in (("a", 3, 2), ("b", 5, 6), ("c", 4, 9)):
        eng.add_request(now=0.0, **req(rid, plen, m))
    assert eng.step(now=0.0).outputs == [] and eng.step(now=0.049).outputs == []  # window still open
    assert not eng.executor.batches
    eng.clock.set(0.05)
    done = drive(eng, [(0.06, req("late", 3, 2))])  # arrives while the batch runs
    first = [s.request_id for s in eng.executor.batches[0].seqs]
    assert first == ["a", "b", "c"]
    # all three come back in the same step, when the longest (9 tokens) ends
    assert done["a"][1] == done["b"][1] == done["c"][1]
    assert done["a"][0].finish_time == done["c"][0].finish_time
    assert done["a"][0].token_ids == expected_tokens(3, 2) and done["c"][0].token_ids == expected_tokens(4, 9)
    # "late" joined no batch of the first group
    batches = eng.executor.batches
    late_first = next(i for i, b in enumerate(batches) if any(s.request_id == "late" for s in b.seqs))
    assert all(s.request_id != "late" for b in batches[:late_first] for s in b.seqs)
    assert late_first >= 9 and done["late"][1] > done["c"][1]


def test_static_full_batch_launches_at_once_and_caps_size(make_fake_engine):
    eng = make_fake_engine(policy="static", window_ms=1000.0, max_batch=3)
    for i in range(7):
        eng.add_request(now=0.0, **req(f"r{i}", 4, 3))
    drive(eng)
    sizes = [b.num_seqs for b in eng.executor.batches]
    assert eng.executor.batches[0].num_seqs == 3 and max(sizes) == 3
    # batches of 3, 3, then the last request alone after the window (1 s of virtual time)
    assert eng.scheduler.policy.num_batches == 3


def test_static_padding_accounting(make_fake_engine):
    eng = make_fake_engine(policy="static", window_ms=0.0, max_batch=8)
    lens = [(2, 1), (6, 4), (4, 7)]  # (prompt, output)
    for i, (p, m) in enumerate(lens):
        eng.add_request(now=0.0, **req(f"r{i}", p, m))
    drive(eng)
    pol = eng.scheduler.policy
    b, max_p, max_o = len(lens), 6, 7
    useful = sum(p + m - 1 for p, m in lens)  # prompts, then one token per decode step
    assert pol.useful_tokens == useful
    assert pol.padding_tokens == b * (max_p + max_o - 1) - useful
    assert sum(x.num_padding_tokens for x in eng.executor.batches) == pol.padding_tokens
    assert eng.executor.batches[0].num_padding_tokens == (6 - 2) + (6 - 4)  # prompt padding
    assert 0 < pol.padding_fraction < 1
    assert all(len(s.token_ids) > 0 for x in eng.executor.batches for s in x.seqs)  # never padded for real


def test_static_abort_of_a_member_still_releases_the_rest(make_fake_engine):
    eng = make_fake_engine(policy="static", window_ms=0.0)
    eng.add_request(now=0.0, **req("a", 3, 2))
    eng.add_request(now=0.0, **req("b", 3, 20))
    outs = {}
    for t in range(4):
        outs.update({o.request_id: o for o in eng.step(now=t * 0.01).outputs if o.finished})
    assert not outs  # "a" is done but held for the batch
    eng.abort("b", now=0.04)
    outs = {o.request_id: o for o in eng.step(now=0.05).outputs if o.finished}
    assert outs["a"].finish_reason == "length" and outs["b"].finish_reason == "abort"
    assert outs["a"].token_ids == expected_tokens(3, 2)


# --- chunked -----------------------------------------------------------------------------------
def test_chunked_budget_no_padding_and_decodes_never_stall(make_fake_engine):
    eng = make_fake_engine(policy="chunked", max_num_batched_tokens=16, chunk_size=8, num_blocks=256)
    eng.add_request(now=0.0, **req("short", 4, 12))
    eng.step(now=0.0)
    eng.add_request(now=0.01, **req("long", 100, 3))
    eng.add_request(now=0.01, **req("long2", 60, 3))
    done = drive(eng)
    batches = eng.executor.batches
    assert all(b.num_tokens <= 16 and b.num_padding_tokens == 0 for b in batches)
    assert all(s.num_tokens <= 8 for b in batches for s in b.seqs)
    # "short" decoded in every step from its first token to its last: never stalled
    with_short = [i for i, b in enumerate(batches) if any(s.request_id == "short" for s in b.seqs)]
    assert with_short == list(range(12))
    assert done["short"][0].token_ids == expected_tokens(4, 12)
    assert done["long"][0].token_ids == expected_tokens(100, 3)
    # the long prompt went in chunks mixed with decodes
    mixed = [b for b in batches if len({s.is_decode for s in b.seqs}) == 2]
    assert mixed


def test_chunked_request_leaves_as_soon_as_done(make_fake_engine):
    eng = make_fake_engine(policy="chunked", chunk_size=4)
    eng.add_request(now=0.0, **req("s", 3, 2))
    eng.add_request(now=0.0, **req("l", 3, 8))
    done = drive(eng)
    assert done["s"][1] == 1 and done["l"][1] == 7


# --- cascade -----------------------------------------------------------------------------------
def test_cascade_respects_both_caps_and_matches_continuous(make_fake_engine):
    eng = make_fake_engine(policy="cascade", prefill_max_batch=3, decode_max_batch=5, cascade_ratio=2,
                           max_num_batched_tokens=64, num_blocks=512)
    done = drive(eng, mixed_workload())
    batches = eng.executor.batches
    kinds = []
    for b in batches:
        dec = [s for s in b.seqs if s.is_decode]
        assert len(dec) in (0, b.num_seqs), "a cascade step is one stage only"
        kinds.append("d" if dec else "p")
        assert b.num_seqs <= (5 if dec else 3) and b.num_tokens <= 64
    assert "dp" in "".join(kinds) and "pd" in "".join(kinds)  # the stages alternate
    assert max(b.num_seqs for b in batches if kinds[batches.index(b)] == "d") == 5
    ref = make_fake_engine(policy="continuous", max_num_batched_tokens=64, num_blocks=512)
    ref_done = drive(ref, mixed_workload())
    assert {k: v[0].token_ids for k, v in done.items()} == {k: v[0].token_ids for k, v in ref_done.items()}
    pol = eng.scheduler.policy
    assert pol.num_prefill_steps > 0 and pol.num_decode_steps > 0


def test_cascade_workers_schedule_carries_both_stages(make_fake_engine):
    eng = make_fake_engine(policy="cascade", cascade_workers=True, prefill_max_batch=2, decode_max_batch=4,
                           num_blocks=512)
    done = drive(eng, mixed_workload(20))
    assert len(done) == 20
    both = 0
    for b in eng.executor.batches:
        dec = [s for s in b.seqs if s.is_decode]
        assert len(dec) <= 4 and b.num_seqs - len(dec) <= 2
        both += bool(dec) and len(dec) < b.num_seqs
    assert both > 0  # prefill and decode in the same step (the two workers run at once)


# --- every policy --------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ALL)
def test_every_policy_finishes_everything_with_correct_tokens_under_pressure(make_fake_engine, policy):
    """Random arrivals, priorities and an abort, with a KV pool small enough to force
    preemption under the paged policies: all requests end, tokens are right, no block leaks."""
    eng = make_fake_engine(policy=policy, num_blocks=24, block_size=4, max_num_batched_tokens=48,
                           window_ms=5.0, max_batch=6, chunk_size=8, prefill_max_batch=4, decode_max_batch=4)
    arrivals = mixed_workload(30, seed=7)
    eng.add_request(now=0.0, **req("victim", 5, 50))
    done = {}
    for t in range(3):
        done.update({o.request_id: (o, t) for o in eng.step(now=t * 0.01).outputs if o.finished})
    eng.abort("victim", now=0.03)
    eng.clock.set(0.03)
    done.update(drive(eng, [(a[0] + 0.03, a[1]) for a in arrivals]))
    assert done["victim"][0].finish_reason == "abort"
    for t, kw in arrivals:
        out = done[kw["request_id"]][0]
        assert out.token_ids == expected_tokens(len(kw["prompt"]), kw["params"].max_tokens), kw["request_id"]
        assert out.finish_reason == "length"


@pytest.mark.parametrize("policy", ALL)
def test_prefix_caching_same_outputs_and_hits(policy):
    """Shared prefixes: identical outputs with and without prefix caching, fewer prompt
    tokens computed, and a hit rate above zero."""
    system = list(range(100, 132))  # a 32-token shared "system prompt"
    arrivals = [(i * 0.02, req(f"r{i}", 0, 4 + i % 5) | {"prompt": system + [200 + i, 300 + i, 7]})
                for i in range(12)]
    results = {}
    for caching in (False, True):
        cfg = EngineConfig(cache=CacheConfig(block_size=4, num_blocks=256, prefix_caching=caching),
                           scheduler=SchedulerConfig(policy=policy, window_ms=0.0, max_batch=4, chunk_size=16))
        eng = LLMEngine(cfg, FakeExecutor(256), clock=SimClock())
        done = drive(eng, arrivals)
        prompt_tokens = sum(s.num_tokens for b in eng.executor.batches for s in b.seqs if not s.is_decode)
        results[caching] = ({k: v[0].token_ids for k, v in done.items()}, prompt_tokens, eng.kv.prefix_hit_rate)
        assert not eng.scheduler.has_unfinished
        eng.kv.check_all_free()
    assert results[True][0] == results[False][0]
    assert results[False][2] == 0.0 and results[True][2] > 0.5
    assert results[True][1] < results[False][1]


def test_chunked_starts_a_prompt_only_when_all_its_blocks_fit(make_fake_engine):
    # 6 prompts of 40 tokens (10 blocks each) in a 24-block pool, chunks of 8 tokens: starting
    # every prompt on its first chunk alone would make them preempt each other repeatedly.
    eng = make_fake_engine(num_blocks=24, block_size=4, policy="chunked", chunk_size=8,
                           max_num_batched_tokens=64)
    for i in range(6):
        eng.add_request(list(range(1, 41)), SamplingParams(max_tokens=2), now=0.0, request_id=f"r{i}")
    step = 0
    while eng.has_unfinished:
        eng.step(now=float(step))
        step += 1
        assert len(eng.scheduler.running) <= 2
    assert eng.scheduler.num_preemptions == 0
