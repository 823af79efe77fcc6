"""With the real model: greedy outputs are identical under every batching policy, and with
prefix caching on or off (scheduling must never change results). One model, loaded once;
each policy gets its own engine (fresh scheduler and KV bookkeeping) over the shared runner,
one engine running at a time."""
from __future__ import annotations

import pytest

from batchserve.config import CacheConfig, EngineConfig, SchedulerConfig
from batchserve.core.policies import POLICIES
from batchserve.engine.clock import SimClock
from batchserve.engine.engine import LLMEngine
from batchserve.request import SamplingParams

pytestmark = pytest.mark.model

SYSTEM = ("You are a careful assistant. Answer briefly and precisely, and say so when you do not "
          "know something. Question: ")
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Why is the sky blue?",
    "Write a haiku about autumn leaves falling on a quiet pond in the evening.",
    "What is 12 times 12?",
    "Who wrote Hamlet?",
]


class Recording:
    """The real runner, remembering each batch's shape: (num_tokens, sample) per seq."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.num_blocks, self.max_model_len, self.cfg = runner.num_blocks, runner.max_model_len, runner.cfg
        self.shapes: list[list[tuple[int, bool]]] = []
        self.padding_rows = 0

    def execute(self, batch):
        self.shapes.append([(s.num_tokens, s.sample) for s in batch.seqs])
        self.padding_rows += len(batch.padding)
        return self.runner.execute(batch)


def run(runner, tok, eos, prompts, arrivals, max_tokens, policy, prefix_caching=False, **sched):
    cfg = EngineConfig(cache=CacheConfig(block_size=runner.block_size, prefix_caching=prefix_caching),
                       scheduler=SchedulerConfig(policy=policy, **sched))
    eng = LLMEngine(cfg, Recording(runner), tok, eos, clock=SimClock())
    pending = sorted(zip(arrivals, range(len(prompts))))
    done = {}
    while pending or eng.has_unfinished:
        now = eng.clock.now()
        while pending and pending[0][0] <= now:
            _, i = pending.pop(0)
            eng.add_request(prompts[i], SamplingParams(max_tokens=max_tokens[i], temperature=0.0, ignore_eos=True),
                            now=now, request_id=f"q{i}")
        for out in eng.step(now=now).outputs:
            if out.finished:
                done[out.request_id] = out
        eng.clock.advance(0.01)
    eng.kv.check_all_free()
    return [done[f"q{i}"].token_ids for i in range(len(prompts))], eng


@pytest.fixture(scope="module")
def setup(llm):
    runner = llm.engine.executor
    tok = llm.tokenizer
    prompts = [tok.encode(SYSTEM + q) for q in QUESTIONS]
    arrivals = [0.0, 0.0, 0.02, 0.05, 0.05, 0.12]
    max_tokens = [6, 20, 12, 16, 3, 9]
    return runner, tok, llm.engine.eos_token_id, prompts, arrivals, max_tokens


SETTINGS = {
    "static": dict(window_ms=10.0, max_batch=3),
    "dynamic": dict(window_max_ms=20.0, max_batch=4, bucket_by_length=True),
    "continuous": dict(),
    "chunked": dict(chunk_size=7, max_num_batched_tokens=24),
    "cascade": dict(prefill_max_batch=2, decode_max_batch=3, cascade_ratio=2),
}


def test_every_policy_gives_the_same_greedy_tokens(setup):
    assert set(SETTINGS) == set(POLICIES)
    runner, tok, eos, prompts, arrivals, max_tokens = setup
    ref, _ = run(runner, tok, eos, prompts, [0.0] * len(prompts), max_tokens, "continuous")
    assert [len(t) for t in ref] == max_tokens
    for name, kw in SETTINGS.items():
        got, eng = run(runner, tok, eos, prompts, arrivals, max_tokens, name, **kw)
        assert got == ref, name
        shapes = eng.executor.shapes
        if name == "chunked":  # prompts really went in 7-token chunks next to decodes
            assert any((7, False) in b and (1, True) in b for b in shapes)
        if name == "cascade":
            assert all(len({n == 1 for n, _ in b}) == 1 for b in shapes)


def test_paying_padding_keeps_static_tokens(setup):
    """pay_padding runs the padding rows through the model next to the batch (their K/V in the
    runner's scratch block): the members' tokens are those of the ragged run."""
    runner, tok, eos, prompts, arrivals, max_tokens = setup
    ragged, _ = run(runner, tok, eos, prompts, arrivals, max_tokens, "static", **SETTINGS["static"])
    padded, eng = run(runner, tok, eos, prompts, arrivals, max_tokens, "static", pay_padding=True,
                      **SETTINGS["static"])
    assert padded == ragged
    assert eng.scheduler.policy.padding_tokens > 0 and eng.executor.padding_rows > 0


@pytest.mark.parametrize("policy", sorted(SETTINGS))
def test_prefix_caching_keeps_outputs_and_hits(setup, policy):
    runner, tok, eos, prompts, arrivals, max_tokens = setup
    late = [0.0] + [0.2 + 0.01 * i for i in range(len(prompts) - 1)]  # the first one fills the cache
    off, _ = run(runner, tok, eos, prompts, late, max_tokens, policy, **SETTINGS[policy])
    on, eng = run(runner, tok, eos, prompts, late, max_tokens, policy, prefix_caching=True, **SETTINGS[policy])
    assert on == off
    assert eng.kv.prefix_hit_rate > 0.3
