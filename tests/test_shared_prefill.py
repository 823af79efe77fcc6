"""Copies of one prompt (a group: n > 1, best_of) prefill it once: one copy computes the
prompt, the others fork its full blocks (refcounted, read-only) and compute only the last
block and their own tokens; every block comes back, and a copy that ends early frees exactly
its own references. Then best_of over HTTP: the candidates share the prefill too, and the n
with the highest cumulative logprob are answered. Model-free (fake executors)."""
from __future__ import annotations

import asyncio
import random

import pytest
from conftest import FakeExecutor
from fake_server import MODEL, fake_engine, serve_app

from batchserve.core.batch import ScheduledBatch, StepOutput, TokenLogprob
from batchserve.request import OverloadedError, SamplingParams

PROMPT = [(7 * i) % 500 + 3 for i in range(100)]


class SeededExecutor(FakeExecutor):
    """The fake model, but each request's token is offset by its seed (so copies answer
    differently), and it checks the fork contract on every step: a seq never writes KV into
    a block another request's table also holds. `kv` is set once the engine exists."""

    def __init__(self, num_blocks: int = 64) -> None:
        super().__init__(num_blocks)
        self.kv = None
        self.shared_writes = 0

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        bs = self.kv.block_size
        for s in batch.seqs:
            first, last = s.start_pos // bs, (s.start_pos + s.num_tokens - 1) // bs
            self.shared_writes += sum(self.kv.ref_count(b) != 1 for b in s.block_table[first:last + 1])
        out = super().execute(batch)
        seeds = {s.request_id: s.params.seed or 0 for s in batch.seqs}
        out.sampled = {rid: tok + seeds[rid] for rid, tok in out.sampled.items()}
        return out


def prompt_tokens(batches: list[ScheduledBatch], n_prompt: int) -> int:
    """Prompt positions the executor computed, over every step."""
    return sum(max(0, min(s.start_pos + s.num_tokens, n_prompt) - s.start_pos) for b in batches for s in b.seqs)


def engine(make_fake_engine, **kw):
    ex = SeededExecutor(kw.pop("num_blocks", 64))
    eng = make_fake_engine(num_blocks=ex.num_blocks, block_size=16, executor=ex, **kw)
    ex.kv = eng.kv
    return eng, ex


def add_copies(eng, k: int, group: str | None = "g", max_tokens: int = 6, prompt=PROMPT, **kw) -> list[str]:
    return [eng.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=j), now=0.0,
                            request_id=f"c{j}", group=group, **kw).request_id for j in range(k)]


def run(eng, outs: dict | None = None, t: float = 0.0, limit: int = 200) -> dict:
    outs = {} if outs is None else outs
    for _ in range(limit):
        if not eng.has_unfinished:
            return outs
        for o in eng.step(now=t).outputs:
            if o.finished:
                outs[o.request_id] = o
        t += 0.01
    raise AssertionError("did not drain")


@pytest.mark.parametrize("policy", ["continuous", "chunked", "static", "cascade"])
def test_four_copies_compute_the_prompt_once(make_fake_engine, policy: str) -> None:
    eng, ex = engine(make_fake_engine, policy=policy, chunk_size=64, window_ms=0)
    add_copies(eng, 4, max_tokens=12)
    outs = run(eng)
    # one copy computes all 100; each other one only what follows the 6 full blocks it shares
    assert prompt_tokens(ex.batches, 100) == 100 + 3 * (100 - 96)
    assert eng.kv.forked_tokens == 3 * 96 and ex.shared_writes == 0
    for j in range(4):  # each its own answer: the fake model's token for each position, plus its seed
        o = outs[f"c{j}"]
        assert o.finish_reason == "length" and o.token_ids == [(p + 1) % 1000 + 3 + j for p in range(99, 111)]
    eng.kv.check_all_free()


def test_without_a_group_each_copy_prefills_alone(make_fake_engine) -> None:
    eng, ex = engine(make_fake_engine)
    add_copies(eng, 4, group=None)
    run(eng)
    assert prompt_tokens(ex.batches, 100) == 4 * 100 and eng.kv.forked_tokens == 0


def test_a_cancelled_copy_frees_only_its_own_blocks(make_fake_engine) -> None:
    eng, ex = engine(make_fake_engine)
    ids = add_copies(eng, 4, max_tokens=30)
    kv = eng.kv
    for t in range(3):  # the first copy's prompt, then the forks, then a decode each
        eng.step(now=t * 0.01)
    tables = {r: list(kv.block_table(r)) for r in ids}
    shared = tables["c0"][:6]
    assert all(tables[r][:6] == shared for r in ids) and all(kv.ref_count(b) == 4 for b in shared)
    own = {r: [b for b in tables[r] if b not in shared] for r in ids}
    assert all(kv.ref_count(b) == 1 for r in ids for b in own[r])
    free = kv.num_free_blocks
    eng.abort("c2", now=0.03)
    assert kv.num_free_blocks == free + len(own["c2"])
    assert all(kv.ref_count(b) == 3 for b in shared) and all(kv.ref_count(b) == 0 for b in own["c2"])
    assert all(kv.block_table(r) == tables[r] for r in ("c0", "c1", "c3"))
    eng.abort("c0", now=0.03)  # the copy that computed the prompt: the others keep its blocks
    assert all(kv.ref_count(b) == 2 for b in shared)
    outs = run(eng, t=0.04)
    assert outs["c0"].finish_reason == outs["c2"].finish_reason == "abort"
    for j in (1, 3):
        assert outs[f"c{j}"].token_ids == [(p + 1) % 1000 + 3 + j for p in range(99, 129)]
    assert ex.shared_writes == 0
    kv.check_all_free()


def test_the_next_copy_prefills_when_the_first_is_cancelled_before_it_is_done(make_fake_engine) -> None:
    eng, ex = engine(make_fake_engine, policy="chunked", chunk_size=32)
    add_copies(eng, 3)
    eng.step(now=0.0)  # the first copy's first chunk; the others wait for it
    assert [len(b.seqs) for b in ex.batches] == [1]
    eng.abort("c0", now=0.01)
    outs = run(eng, t=0.01)
    assert prompt_tokens(ex.batches, 100) == 32 + 100 + (100 - 96)
    assert outs["c1"].token_ids[0] == 103 + 1 and outs["c2"].token_ids[0] == 103 + 2
    assert ex.shared_writes == 0


def test_copies_with_prefix_caching_share_and_stay_cached(make_fake_engine) -> None:
    ex = SeededExecutor(64)
    eng = make_fake_engine(num_blocks=64, block_size=16, executor=ex)
    eng.kv.prefix_caching = True
    ex.kv = eng.kv
    add_copies(eng, 3)
    run(eng)
    assert prompt_tokens(ex.batches, 100) == 100 + 2 * 4 and ex.shared_writes == 0
    before = len(ex.batches)
    eng.add_request(PROMPT, SamplingParams(max_tokens=2, ignore_eos=True), now=1.0, request_id="later")
    run(eng, t=1.0)
    assert prompt_tokens(ex.batches[before:], 100) == 4  # the shared blocks were named in the prefix cache


def test_a_group_must_share_one_prompt(make_fake_engine) -> None:
    eng, _ = engine(make_fake_engine)
    eng.add_request(PROMPT, SamplingParams(max_tokens=1), now=0.0, request_id="a", group="g")
    with pytest.raises(ValueError, match="one prompt"):
        eng.add_request(PROMPT[:50], SamplingParams(max_tokens=1), now=0.0, request_id="b", group="g")
    run(eng)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_groups_under_memory_pressure_never_write_a_shared_block(make_fake_engine, seed: int) -> None:
    """Copies preempted, recomputed, aborted and finishing in any order under a tiny cache: no
    step writes a block another request holds, every held block is in a live table, and all
    blocks come back."""
    rng = random.Random(seed)
    ex = SeededExecutor(24)
    eng = make_fake_engine(num_blocks=24, block_size=4, executor=ex, max_num_seqs=6, preempt_gap=2)
    ex.kv = kv = eng.kv
    live: set[str] = set()
    t, added = 0.0, 0
    while added < 400 or eng.has_unfinished:
        if added < 400 and rng.random() < 0.4:
            prompt = [rng.randint(3, 900) for _ in range(rng.randint(1, 30))]
            for j in range(rng.choice([1, 2, 3, 4])):
                try:
                    r = eng.add_request(prompt, SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=True,
                                                               seed=j), now=t, request_id=f"r{added}-{j}",
                                        group=f"g{added}", priority=rng.randint(0, 10))
                    live.add(r.request_id)
                except OverloadedError:
                    pass
            added += 1
        if live and rng.random() < 0.1:
            eng.abort(rng.choice(sorted(live)), now=t)
        for o in eng.step(now=t).outputs:
            if o.finished:
                live.discard(o.request_id)
        sched = eng.scheduler
        holders = [*sched.running, *sched.parked.values()]
        refs = sum(kv.ref_count(b) for b in range(kv.num_blocks))
        assert refs == sum(len(kv.block_table(r.request_id)) for r in holders)
        held = {b for r in holders for b in kv.block_table(r.request_id)}
        assert kv.num_free_blocks + len(held) == kv.num_blocks
        t += 0.01
        assert t < 1000, "did not drain"
    assert ex.shared_writes == 0 and kv.forked_tokens > 0 and eng.scheduler.num_preemptions > 0
    assert not eng.scheduler.groups
    kv.check_all_free()


# --- best_of over HTTP ------------------------------------------------------------------------
class RankedExecutor(SeededExecutor):
    """A candidate's certainty by its seed: each sampled token's logprob is -|seed - 11| / 10, so
    with seed 10 and best_of 3 the second candidate (seed 11) is the best, the others tie."""

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        out = super().execute(batch)
        seeds = {s.request_id: s.params.seed or 0 for s in batch.seqs}
        if out.logprobs:
            out.logprobs = {rid: TokenLogprob(out.sampled[rid], -abs(seeds[rid] - 11) / 10) for rid in out.logprobs}
        return out


async def _complete(body: dict, ex: RankedExecutor | None = None) -> tuple[int, dict]:
    ex = ex or RankedExecutor(256)
    eng = fake_engine(ex)
    ex.kv = eng.kv
    async with serve_app(eng) as (client, _):
        r = await client.post("/v1/completions", json={"model": MODEL, "max_tokens": 5, **body})
        return r.status_code, r.json()


def _text(prompt_len: int, seed: int, n: int = 5) -> str:
    """What the fake tokenizer shows for the fake model's answer under `seed`."""
    return "".join(chr(97 + ((p + 1) % 1000 + 3 + seed) % 26) for p in range(prompt_len - 1, prompt_len - 1 + n))


def test_best_of_answers_the_candidate_with_the_highest_cumulative_logprob() -> None:
    ex = RankedExecutor(256)
    prompt = "x" * 40
    status, out = asyncio.run(_complete({"prompt": prompt, "best_of": 3, "seed": 10, "temperature": 1.0}, ex))
    assert status == 200, out
    assert [c["index"] for c in out["choices"]] == [0]
    assert out["choices"][0]["text"] == _text(40, 11) and out["choices"][0]["logprobs"] is None
    assert out["usage"] == {"prompt_tokens": 40, "completion_tokens": 3 * 5, "total_tokens": 55}
    assert prompt_tokens(ex.batches, 40) == 40 + 2 * (40 - 36)  # the candidates shared one prefill (blocks of 4)
    assert ex.shared_writes == 0


def test_best_of_with_n_and_logprobs_ranks_best_first() -> None:
    body = {"prompt": "y" * 21, "best_of": 4, "n": 2, "seed": 9, "logprobs": 0, "temperature": 1.0}
    status, out = asyncio.run(_complete(body))  # seeds 9..12: logprobs -0.2, -0.1, 0, -0.1 per token
    assert status == 200, out
    texts = [c["text"] for c in out["choices"]]
    assert texts == [_text(21, 11), _text(21, 10)]  # the best, then the earlier of the two tied next
    sums = [sum(c["logprobs"]["token_logprobs"]) for c in out["choices"]]
    assert sums == pytest.approx([0.0, -0.5])
    assert out["usage"]["completion_tokens"] == 4 * 5


def test_best_of_equal_to_n_answers_every_candidate_in_order() -> None:
    status, out = asyncio.run(_complete({"prompt": "z" * 9, "best_of": 2, "n": 2, "seed": 10}))
    assert status == 200 and [c["text"] for c in out["choices"]] == [_text(9, 10), _text(9, 11)]


@pytest.mark.parametrize("body", [
    {"prompt": "abc", "n": 3, "best_of": 2},  # fewer candidates than choices
    {"prompt": "abc", "best_of": 2, "stream": True},
    {"prompt": "abc", "best_of": 65},
    {"prompt": ["abc", "d"], "best_of": 33},  # 66 candidates in all
    {"prompt": "abc", "best_of": 0},
    {"prompt": "abc", "best_of": "2"},
], ids=["below-n", "stream", "over-cap", "over-cap-prompts", "zero", "string"])
def test_best_of_refusals_name_the_field(body: dict) -> None:
    status, out = asyncio.run(_complete(body))
    assert status == 400 and out["error"]["param"] == "best_of" and "best_of" in out["error"]["message"], out


def test_best_of_is_not_a_chat_field() -> None:
    async def go() -> tuple[int, dict]:
        async with serve_app(fake_engine()) as (client, _):
            r = await client.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "best_of": 2})
            return r.status_code, r.json()

    status, out = asyncio.run(go())
    assert status == 400 and out["error"]["param"] == "best_of"
