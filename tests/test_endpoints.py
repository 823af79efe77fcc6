"""The endpoints beside generation, model-free (tests/fake_server.py): /tokenize and /detokenize
(vLLM's), /version, and /openapi.json with /docs, whose request bodies come from the field table."""
from __future__ import annotations

import asyncio
import json

from conftest import FakeExecutor
from fake_server import MODEL, FakeTokenizer, fake_engine, serve_app

import batchserve
from batchserve.server import fields
from batchserve.server.config import ServerConfig

VOCAB = 0x110000 + 3  # every code point


class TextTokenizer(FakeTokenizer):
    """One token per character, reversible (ids 3..VOCAB-1); decode refuses ids it never makes."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        text.encode("utf-8")
        return [ord(c) + 3 for c in text]

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        return self.encode("".join(f"<{m['role']}>{m['content']}" for m in messages)
                           + ("<assistant>" if add_generation_prompt else ""))

    def decode(self, ids, skip_special_tokens=True):
        if any(not 3 <= t < VOCAB for t in ids):
            raise IndexError("unknown id")
        return "".join(chr(t - 3) for t in ids)


def run(coro):
    return asyncio.run(coro)


def app(config: ServerConfig | None = None):
    return serve_app(fake_engine(FakeExecutor(step_time=0.0), tokenizer=TextTokenizer()), config)


def test_tokenize_then_detokenize_round_trips_text():
    async def go():
        async with app() as (c, _):
            text = "Héllo, wörld ✓"
            r = await c.post("/tokenize", json={"model": MODEL, "prompt": text})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["count"] == len(body["tokens"]) == len(text) and body["max_model_len"] == 4096
            r = await c.post("/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
            assert r.status_code == 200 and r.json() == {"prompt": text}
    run(go())


def test_tokenize_messages_through_the_template():
    async def go():
        async with app() as (c, _):
            msgs = [{"role": "user", "content": "hi"}]
            with_gen = (await c.post("/tokenize", json={"messages": msgs})).json()
            without = (await c.post("/tokenize", json={"messages": msgs, "add_generation_prompt": False})).json()
            assert with_gen["count"] == len("<user>hi<assistant>") and without["count"] == len("<user>hi")
            back = (await c.post("/detokenize", json={"tokens": without["tokens"]})).json()
            assert back == {"prompt": "<user>hi"}
    run(go())


def test_bad_input_is_a_400_naming_the_field():
    cases = [("/tokenize", {"prompt": 5}, "prompt"), ("/tokenize", {}, "prompt"),
             ("/tokenize", {"prompt": "x", "extra": 1}, "extra"),
             ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
             ("/tokenize", {"messages": [], "add_generation_prompt": True}, "messages"),
             ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": 1},
              "add_generation_prompt"),
             ("/tokenize", {"prompt": "x", "add_special_tokens": True}, "add_special_tokens"),
             ("/tokenize", {"prompt": "\ud800"}, "prompt"),
             ("/detokenize", {"tokens": [1, "2"]}, "tokens"), ("/detokenize", {"tokens": [True]}, "tokens"),
             ("/detokenize", {}, "tokens"), ("/detokenize", {"tokens": [-1]}, "tokens"),
             ("/detokenize", {"tokens": [VOCAB + 1]}, "tokens")]

    async def go():
        async with app() as (c, _):
            for path, body, param in cases:
                r = await c.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
                assert r.status_code == 400, (path, body, r.text)
                assert r.json()["error"]["param"] == param, (path, body, r.text)
            r = await c.post("/tokenize", json={"model": "other", "prompt": "x"})
            assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    run(go())


def test_tokenizer_routes_need_the_key_when_one_is_set():
    async def go():
        async with app(ServerConfig(api_key="k")) as (c, _):
            for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [100]})):
                assert (await c.post(path, json=body)).status_code == 401
                r = await c.post(path, json=body, headers={"Authorization": "Bearer k"})
                assert r.status_code == 200, r.text
    run(go())


def test_version():
    async def go():
        async with app() as (c, _):
            r = await c.get("/version")
            assert r.status_code == 200 and r.json() == {"version": batchserve.__version__}
    run(go())


def test_openapi_bodies_follow_the_field_table():
    async def go():
        async with app() as (c, _):
            spec = (await c.get("/openapi.json")).json()
            docs = await c.get("/docs")
            assert docs.status_code == 200 and "swagger" in docs.text.lower()
            return spec
    spec = run(go())
    assert {"/tokenize", "/detokenize", "/version", "/v1/completions", "/v1/chat/completions"} <= set(spec["paths"])
    for path, chat in (("/v1/completions", False), ("/v1/chat/completions", True)):
        op = spec["paths"][path]["post"]
        props = op["requestBody"]["content"]["application/json"]["schema"]["properties"]
        assert set(props) == set(fields.for_endpoint(chat))
        for name, f in fields.for_endpoint(chat).items():
            if f.status is fields.Status.DEFAULT_ONLY:
                assert props[name]["enum"] == [*f.values, None], name
            elif f.status is fields.Status.REFUSED:
                assert props[name]["enum"] == [None], name
            else:
                assert "enum" not in props[name] or name == "deadline_kind", name
        assert "error" in op["responses"]["400"]["content"]["application/json"]["schema"]["properties"]
        assert "200" in op["responses"] and "5XX" in op["responses"]
