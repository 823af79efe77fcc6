"""logprobs: each sampled token's log-probability and the most likely alternatives, in each
endpoint's OpenAI shape, streamed and not. Model-free (the fake model's token has probability
1/2, the next ids 1/4, 1/8, ...), and the real sampler path against a log-softmax by hand."""
from __future__ import annotations

import asyncio
import json
import math

import pytest
import torch
from fake_server import MODEL, byte_tokenizer, fake_engine, serve_app

from batchserve.runner.sampler import log_probs, sample, token_logprobs

HALF = -math.log(2)


async def _post(path: str, body: dict) -> tuple[int, dict | list]:
    async with serve_app(fake_engine(tokenizer=byte_tokenizer())) as (client, _):
        r = await client.post(path, json={"model": MODEL, "max_tokens": 5, **body})
        if not body.get("stream") or r.status_code != 200:
            return r.status_code, r.json()
        return r.status_code, [json.loads(line[6:]) for line in r.text.splitlines()
                               if line.startswith("data: {")]


def test_chat_logprobs_name_each_token_and_its_alternatives() -> None:
    status, out = asyncio.run(_post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                             "logprobs": True, "top_logprobs": 3}))
    assert status == 200, out
    choice = out["choices"][0]
    content = choice["logprobs"]["content"]
    assert "".join(e["token"] for e in content) == choice["message"]["content"] and len(content) == 5
    for e in content:
        assert e["logprob"] == pytest.approx(HALF) and bytes(e["bytes"]).decode() == e["token"]
        assert [a["logprob"] for a in e["top_logprobs"]] == pytest.approx([HALF, 2 * HALF, 3 * HALF])
        assert e["top_logprobs"][0]["token"] == e["token"]
    status, out = asyncio.run(_post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}))
    assert out["choices"][0]["logprobs"] is None  # not asked for


def test_completions_logprobs_have_offsets_into_the_text() -> None:
    status, out = asyncio.run(_post("/v1/completions", {"prompt": "hello", "logprobs": 2}))
    assert status == 200, out
    choice = out["choices"][0]
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == choice["text"] and lp["token_logprobs"] == pytest.approx([HALF] * 5)
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(5)]
    assert all(len(top) == 2 and top[t] == pytest.approx(HALF) for t, top in zip(lp["tokens"], lp["top_logprobs"]))


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_logprobs_come_with_their_tokens(chat: bool) -> None:
    path, body = (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True})
                  if chat else ("/v1/completions", {"prompt": "hello", "logprobs": 0}))
    status, chunks = asyncio.run(_post(path, {**body, "stream": True}))
    assert status == 200
    text, tokens, offsets = "", [], []
    for c in chunks:
        ch = c["choices"][0]
        text += ch["delta"].get("content", "") if chat else ch["text"]
        if ch["logprobs"]:
            tokens += [e["token"] for e in ch["logprobs"]["content"]] if chat else ch["logprobs"]["tokens"]
            offsets += [] if chat else ch["logprobs"]["text_offset"]
    assert len(tokens) == 5 and "".join(tokens) == text
    assert chat or offsets == [sum(len(t) for t in tokens[:i]) for i in range(5)]


@pytest.mark.parametrize("body, param", [
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": 3}, "logprobs"),
])
def test_bad_chat_logprobs_are_a_400_naming_the_field(body: dict, param: str) -> None:
    status, out = asyncio.run(_post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                             **body}))
    assert status == 400 and out["error"]["param"] == param, out


def test_the_sampler_reports_the_raw_logits_log_softmax() -> None:
    from batchserve.request import SamplingParams

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, dtype=torch.float64) * 3
    params = [SamplingParams(max_tokens=1, temperature=0.7, logprobs=4, repetition_penalty=1.5),
              SamplingParams(max_tokens=1, temperature=0.0, logprobs=0),
              SamplingParams(max_tokens=1, temperature=1.0, logprobs=20)]
    want = torch.log_softmax(logits.float(), dim=-1)
    lp = log_probs(logits, [0, 1, 2])
    toks = sample(logits.clone(), params, [0] * 3, g, history=[([1, 2], [3])] * 3)
    entries = token_logprobs(lp, toks, [4, 0, 20])
    for i, e in enumerate(entries):
        assert e.token_id == toks[i] and e.logprob == pytest.approx(float(want[i, toks[i]]), abs=1e-6)
        top = torch.topk(want[i], len(e.top))
        assert [t for t, _ in e.top] == top.indices.tolist() and len(e.top) == (4, 0, 20)[i]


@pytest.mark.model
def test_the_real_model_logprobs_match_its_greedy_choice(llm) -> None:
    from batchserve.request import RequestSpec, SamplingParams

    eng = llm.engine
    req = eng.add(RequestSpec(SamplingParams(max_tokens=8, temperature=0.0, logprobs=3), "The capital of France is"))
    outs = []
    while eng.has_unfinished:
        outs += [o for o in eng.step().outputs if o.request_id == req.request_id and o.finished]
    (out,) = outs
    assert [e.token_id for e in out.logprobs] == out.token_ids
    for e in out.logprobs:  # greedy: the chosen token is the most likely one, and probabilities add up
        assert e.top[0][0] == e.token_id and e.logprob == pytest.approx(e.top[0][1])
        assert e.logprob <= 0 and sum(math.exp(v) for _, v in e.top) <= 1 + 1e-5


def test_echo_with_logprobs_scores_the_prompt_too() -> None:
    """What lm-evaluation-harness's loglikelihood asks: echo, logprobs, one token."""
    status, out = asyncio.run(_post("/v1/completions", {"prompt": "hello", "logprobs": 1, "echo": True,
                                                        "max_tokens": 1, "temperature": 0}))
    assert status == 200, out
    choice = out["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"].startswith("hello") and "".join(lp["tokens"]) == choice["text"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx([HALF] * 5)  # 4 prompt tokens after the first, 1 answer
    assert lp["text_offset"] == [0, 1, 2, 3, 4, 5]
    assert choice["prompt_logprobs"][0] is None and len(choice["prompt_logprobs"]) == 5
    status, out = asyncio.run(_post("/v1/completions", {"prompt": "hi", "logprobs": 1, "echo": True,
                                                        "stream": True}))
    assert status == 400 and out["error"]["param"] == "echo"


def test_prompt_logprobs_cover_every_chunk_of_a_long_prompt_once() -> None:
    """A prompt prefilled in several chunks (and past the prefix cache) is scored at every
    position, each once, the targets being the prompt's own next tokens."""
    from batchserve.engine.clock import SimClock
    from batchserve.request import RequestSpec, SamplingParams

    eng = fake_engine(tokenizer=byte_tokenizer(), policy="chunked", max_num_batched_tokens=16)
    eng.clock = SimClock()
    ids = list(range(3, 60))
    req = eng.add(RequestSpec(SamplingParams(max_tokens=2, prompt_logprobs=2), ids), now=0.0)
    t, outs = 0.0, []
    while eng.has_unfinished:
        outs += [o for o in eng.step(now=t).outputs if o.finished]
        t += 0.01
    (out,) = outs
    assert out.prompt_logprobs[0] is None
    assert [e.token_id for e in out.prompt_logprobs[1:]] == ids[1:] and all(len(e.top) == 2 for e in out.prompt_logprobs[1:])
    assert req.prompt_logprobs is not None


@pytest.mark.model
def test_the_real_models_prompt_logprobs_match_its_scoring_path(llm) -> None:
    """Prompt logprobs from the serving loop (chunked, batched beside another request) equal
    the runner's own scoring pass over the same text."""
    from batchserve.request import RequestSpec, SamplingParams

    text = "The quick brown fox jumps over the lazy dog, and the dog does not mind at all."
    want = llm.prompt_logprobs(text)
    eng = llm.engine
    other = eng.add(RequestSpec(SamplingParams(max_tokens=6, temperature=0.0), "Once upon a time"))
    req = eng.add(RequestSpec(SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0), text))
    outs = {}
    while eng.has_unfinished:
        outs.update({o.request_id: o for o in eng.step().outputs if o.finished})
    got = [e.logprob for e in outs[req.request_id].prompt_logprobs[1:]]
    assert outs[other.request_id].prompt_logprobs is None
    assert got == pytest.approx(list(want), abs=2e-3)
