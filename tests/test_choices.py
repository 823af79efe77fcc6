"""Several choices in one request: `n`, a list of prompts, and echo — indexed in OpenAI's order
(prompt i's j-th choice is i * n + j), streamed and not, usage counting each prompt once, and
nothing left behind when one choice fails or the client leaves. Model-free."""
from __future__ import annotations

import asyncio
import json

import pytest
from fake_server import MODEL, fake_engine, serve_app



async def _post(path: str, body: dict, engine=None) -> tuple[int, dict | list]:
    async with serve_app(engine or fake_engine()) as (client, _):
        r = await client.post(path, json={"model": MODEL, "max_tokens": 4, **body})
        if not body.get("stream"):
            return r.status_code, r.json()
        return r.status_code, [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")] \
            + ([None] if r.text.rstrip().endswith("data: [DONE]") else [])


def test_n_choices_for_each_of_several_prompts() -> None:
    status, out = asyncio.run(_post("/v1/completions", {"prompt": ["ab", "abcdef", [5, 6, 7]], "n": 2,
                                                        "temperature": 1.0, "seed": 3}))
    assert status == 200, out
    assert [c["index"] for c in out["choices"]] == list(range(6))
    assert out["usage"] == {"prompt_tokens": 2 + 6 + 3, "completion_tokens": 24, "total_tokens": 35}
    assert all(c["finish_reason"] == "length" and len(c["text"]) == 4 for c in out["choices"])


def test_echo_starts_each_choice_with_its_prompt() -> None:
    status, out = asyncio.run(_post("/v1/completions", {"prompt": ["Hello", "Bye"], "echo": True}))
    assert status == 200
    assert out["choices"][0]["text"].startswith("Hello") and out["choices"][1]["text"].startswith("Bye")
    assert len(out["choices"][0]["text"]) == 5 + 4
    status, chunks = asyncio.run(_post("/v1/completions", {"prompt": "Hello", "echo": True, "stream": True}))
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1] if c["choices"]).startswith("Hello")


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_choices_interleave_and_end_once(chat: bool) -> None:
    path, body = (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}) if chat
                  else ("/v1/completions", {"prompt": ["a", "bb"]}))
    status, chunks = asyncio.run(_post(path, {**body, "n": 3 if chat else 2, "stream": True,
                                              "stream_options": {"include_usage": True}}))
    assert status == 200 and chunks[-1] is None  # one [DONE], at the very end
    usage = [c for c in chunks[:-1] if not c["choices"]]
    assert len(usage) == 1 and usage[0]["usage"]["completion_tokens"] == (3 if chat else 4) * 4
    text: dict[int, str] = {}
    finished = []
    for c in chunks[:-1]:
        for ch in c["choices"]:
            text[ch["index"]] = text.get(ch["index"], "") + (ch["delta"].get("content", "") if chat else ch["text"])
            if ch["finish_reason"]:
                finished.append(ch["index"])
    assert sorted(finished) == list(range(3 if chat else 4)) and all(len(t) == 4 for t in text.values())


def test_too_many_choices_and_an_empty_prompt_are_400s() -> None:
    status, out = asyncio.run(_post("/v1/completions", {"prompt": ["a"] * 9, "n": 8}))
    assert status == 400 and out["error"]["param"] == "n"
    status, out = asyncio.run(_post("/v1/completions", {"prompt": ["a", ""]}))
    assert status == 400 and out["error"]["param"] == "prompt[1]"


def test_a_choice_that_cannot_be_added_fails_the_request_and_frees_the_others() -> None:
    status, out = asyncio.run(_post("/v1/completions", {"prompt": ["abc", "x" * 5000], "n": 2}))
    assert status == 400 and "prompt" in out["error"]["param"], out  # the leak check finds nothing left


def test_the_choices_of_a_prompt_prefill_it_once() -> None:
    from conftest import FakeExecutor

    ex = FakeExecutor(256)
    status, out = asyncio.run(_post("/v1/completions", {"prompt": ["p" * 30, "q" * 30], "n": 4}, fake_engine(ex)))
    assert status == 200 and len(out["choices"]) == 8
    # per prompt: one choice computes its 30 tokens, each other one the 2 after its 7 shared blocks of 4
    computed = sum(max(0, min(s.start_pos + s.num_tokens, 30) - s.start_pos) for b in ex.batches for s in b.seqs)
    assert computed == 2 * (30 + 3 * 2)
    assert out["usage"]["prompt_tokens"] == 60 and out["usage"]["completion_tokens"] == 8 * 4
