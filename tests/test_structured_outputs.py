"""Structured outputs: answers held to a JSON schema, a regex, a choice or a grammar. Model-free
(a real byte-level Hugging Face tokenizer, the fake executor sampling within the mask, the real
sampler on random logits) except the last test, which asks the real model for JSON."""
from __future__ import annotations

import asyncio
import json
import re

import numpy as np
import pytest
import torch
from fake_server import MODEL, byte_tokenizer, fake_engine, serve_app

from batchserve.engine.clock import SimClock
from batchserve.request import Constraint, RequestError, RequestSpec, SamplingParams
from batchserve.runner.sampler import sample

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "population": {"type": "integer"}},
          "required": ["city", "population"], "additionalProperties": False}


def run(constraint: Constraint, max_tokens: int = 200, **spec) -> tuple[str, str]:
    eng = fake_engine(tokenizer=byte_tokenizer())
    eng.clock = SimClock()
    eng.add(RequestSpec(SamplingParams(max_tokens=max_tokens, temperature=0.0), "Answer:", constraint=constraint,
                        **spec), now=0.0)
    t, outs = 0.0, []
    while eng.has_unfinished:
        outs += [o for o in eng.step(now=t).outputs if o.finished]
        t += 0.01
    (out,) = outs
    return out.text, out.finish_reason


def test_a_json_schema_answer_parses_and_fits_the_schema() -> None:
    text, reason = run(Constraint("json", SCHEMA))
    value = json.loads(text)
    assert reason == "stop" and set(value) == {"city", "population"}
    assert isinstance(value["city"], str) and len(value["city"]) <= 12 and isinstance(value["population"], int)
    assert re.fullmatch(r'\{"city": ".*", "population": -?\d+\}', text)  # the separators, no other whitespace


def test_a_regex_and_a_choice_are_matched_whole() -> None:
    text, reason = run(Constraint("regex", r"[0-9]{3}-[a-z]{2,5}"))
    assert reason == "stop" and re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", text), text
    text, reason = run(Constraint("choice", ("maybe", "yes \"quoted\"", "no")))
    assert reason == "stop" and text in ("maybe", "yes \"quoted\"", "no")
    text, reason = run(Constraint("grammar", 'start: "<" NUM ("," NUM)* ">"\nNUM: /[0-9]{1,3}/'))
    assert reason == "stop" and re.fullmatch(r"<[0-9]{1,3}(,[0-9]{1,3})*>", text), text
    text, reason = run(Constraint("grammar", 'root ::= "ab" [0-9]'))  # GBNF, as llama.cpp writes it
    assert reason == "stop" and re.fullmatch(r"ab[0-9]", text), text


def test_max_tokens_still_ends_an_answer_as_a_prefix_of_a_valid_one() -> None:
    text, reason = run(Constraint("json", SCHEMA), max_tokens=5)
    assert reason == "length" and '{"city": "'.startswith(text[:10]) and len(text) == 5


def test_a_bad_constraint_is_a_request_error_naming_its_field() -> None:
    eng = fake_engine(tokenizer=byte_tokenizer())
    for c, says in [(Constraint("json", {"type": "strin"}, "response_format.json_schema.schema"), "strin"),
                    (Constraint("regex", "[a-", "structured_outputs.regex"), "regex"),
                    (Constraint("grammar", "start: undefined_rule", "guided_grammar"), "grammar")]:
        with pytest.raises(RequestError) as e:
            eng.prepare(RequestSpec(SamplingParams(max_tokens=4), "x", constraint=c))
        assert e.value.param == c.field and says in e.value.message
    with pytest.raises(RequestError) as e:  # the fake tokenizer is no Hugging Face one
        fake_engine().prepare(RequestSpec(SamplingParams(max_tokens=4), "x", constraint=Constraint("regex", "a")))
    assert "fast Hugging Face tokenizer" in e.value.message
    with pytest.raises(RequestError):
        Constraint("choice", ())


@pytest.mark.parametrize("dtype", [torch.float64, pytest.param(torch.float32, marks=pytest.mark.kernel)])
def test_the_sampler_never_picks_a_token_the_mask_leaves_out(dtype) -> None:  # PyTorch ops; the C++ kernel
    g = torch.Generator().manual_seed(0)
    V, rng = 300, np.random.default_rng(0)
    for trial in range(20):
        allowed = rng.random(V) < 0.05
        allowed[rng.integers(V)] = True
        words = np.packbits(np.r_[allowed, np.zeros(-V % 32, bool)], bitorder="little").view(np.int32)
        params = [SamplingParams(max_tokens=1, temperature=t, top_k=k) for t, k in ((0.0, 0), (1.0, 0), (1.5, 5))]
        params.append(SamplingParams(max_tokens=1, temperature=0.0))  # an unconstrained row
        logits = (torch.randn(4, V) * 4).to(dtype)
        want_free = int(logits[3].argmax())
        toks = sample(logits.clone(), params, [0] * 4, g, allowed=[words, words, words, None])
        assert all(allowed[t] for t in toks[:3]), (trial, toks)
        assert toks[0] == int(torch.where(torch.from_numpy(allowed), logits[0], -torch.inf).argmax())
        assert toks[3] == want_free


async def _post(body: dict) -> tuple[int, dict]:
    async with serve_app(fake_engine(tokenizer=byte_tokenizer())) as (client, _):
        r = await client.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 200,
                                                            "messages": [{"role": "user", "content": "hi"}], **body})
        return r.status_code, r.json()


@pytest.mark.parametrize("body", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}},
    {"structured_outputs": {"json": SCHEMA}},
    {"guided_json": json.dumps(SCHEMA)},
])
def test_over_http_every_form_of_a_schema_is_honoured(body: dict) -> None:
    status, out = asyncio.run(_post(body))
    assert status == 200, out
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop" and set(json.loads(choice["message"]["content"])) == {"city", "population"}


def test_over_http_json_object_gives_an_object() -> None:  # (the fake model writes one endless key)
    status, out = asyncio.run(_post({"response_format": {"type": "json_object"}}))
    assert status == 200 and out["choices"][0]["message"]["content"].startswith('{"')


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"structured_outputs": {"regex": "[0-9]+", "choice": ["a"]}}, "structured_outputs.choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"structured_outputs": {"structural_tag": {}}}, "structured_outputs.structural_tag"),
    ({"guided_choice": "yes"}, "guided_choice"),
])
def test_over_http_a_bad_constraint_is_a_400_naming_it(body: dict, param: str) -> None:
    status, out = asyncio.run(_post(body))
    assert status == 400 and out["error"]["param"] == param, out


@pytest.mark.model
def test_the_real_model_answers_in_the_schema(llm) -> None:
    eng = llm.engine
    spec = RequestSpec(SamplingParams(max_tokens=60, temperature=0.0),
                       messages=[{"role": "user", "content": "Which city is the capital of France? Answer in JSON."}],
                       constraint=Constraint("json", {"type": "object", "properties": {"city": {"type": "string"}},
                                                      "required": ["city"], "additionalProperties": False}))
    req = eng.add(spec)
    outs = []
    while eng.has_unfinished:
        outs += [o for o in eng.step().outputs if o.request_id == req.request_id and o.finished]
    value = json.loads(outs[0].text)
    assert outs[0].finish_reason == "stop" and set(value) == {"city"} and value["city"]
