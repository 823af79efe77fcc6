"""The field table (batchserve/server/fields.py) against the running app, model-free: every field
it lists for an endpoint is either answered (honoured, or default-only at its default) or refused
with a 400 naming it; nothing is accepted and ignored. docs/api-fields.md is the table's output."""
from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from fake_server import MODEL, byte_tokenizer, fake_engine, serve_app

from batchserve.server import fields
from batchserve.server.fields import CHAT, COMPLETIONS, FIELDS, Status

BASE = {COMPLETIONS: {"model": MODEL, "prompt": "hello", "max_tokens": 2},
        CHAT: {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}
PATH = {COMPLETIONS: "/v1/completions", CHAT: "/v1/chat/completions"}
# Candidates for a value a field does not default to, by JSON type: the first not among its defaults.
_CANDIDATES = {"boolean": (True, False), "integer": (7, 2), "number": (0.5, 1.5), "string": ("x", "y"),
               "object": ({"x": 1}, {"y": 2}), "array": ([1], [2])}
# What an honoured field needs beside it to be valid.
_WITH = {"stream_options": {"stream": True}, "top_logprobs": {"logprobs": True}, "tools": {"tool_choice": "required"}}


def non_default(f: fields.FieldSpec) -> Any:
    for t in f.type.split("|"):
        for v in _CANDIDATES[t]:
            if not any(fields.same_value(v, d) for d in f.values):
                return v
    raise AssertionError(f"no non-default value for {f.name}")


def cases(status: set[Status]) -> list[tuple[str, fields.FieldSpec]]:
    return [(ep, f) for f in FIELDS for ep in sorted(f.endpoints) if f.status in status]


async def _answers(bodies: list[tuple[str, dict]]) -> list[tuple[int, dict]]:
    out = []
    async with serve_app(fake_engine(tokenizer=byte_tokenizer())) as (client, _):  # structured outputs need a real one
        for ep, body in bodies:
            r = await client.post(PATH[ep], content=json.dumps(body).encode(),
                                  headers={"content-type": "application/json"})
            out.append((r.status_code, r.json() if r.headers.get("content-type", "").startswith("application/json")
                        else {}))
    return out


def test_the_table_lists_each_field_once_per_endpoint() -> None:
    for ep in (COMPLETIONS, CHAT):
        names = [f.name for f in FIELDS if ep in f.endpoints]
        assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    for f in FIELDS:
        assert f.vllm in "✓◐✗" and f.llama_cpp in "✓◐✗" and f.note and f.type
        assert set(f.type.split("|")) <= set(_CANDIDATES), f.name
        assert f.status is Status.REFUSED or f.values, f.name  # an example, or the defaults accepted


def test_every_refused_or_limited_field_is_a_400_naming_it() -> None:
    todo = cases({Status.REFUSED, Status.DEFAULT_ONLY})
    bodies = [(ep, {**BASE[ep], f.name: non_default(f)}) for ep, f in todo]
    for (ep, f), (status, body) in zip(todo, asyncio.run(_answers(bodies))):
        assert status == 400, (ep, f.name, body)
        err = body["error"]
        assert err["param"] == f.name and f.name in err["message"], (ep, err)
        assert err["code"] == "unsupported_parameter", (ep, err)


def test_every_default_of_a_limited_field_and_null_are_answered() -> None:
    todo = [(ep, f, v) for ep, f in cases({Status.DEFAULT_ONLY}) for v in f.values]
    todo += [(ep, f, None) for ep, f in cases({Status.REFUSED})]
    bodies = [(ep, {**BASE[ep], f.name: v}) for ep, f, v in todo]
    for (ep, f, v), (status, body) in zip(todo, asyncio.run(_answers(bodies))):
        assert status == 200, (ep, f.name, v, body)


def test_every_honoured_field_is_answered() -> None:
    todo = cases({Status.HONOURED})
    bodies = [(ep, {**BASE[ep], **_WITH.get(f.name, {}), f.name: MODEL if f.name == "model" else f.values[0]})
              for ep, f in todo]
    for (ep, f), (status, body) in zip(todo, asyncio.run(_answers(bodies))):
        assert status == 200, (ep, f.name, body)


def test_a_field_of_the_other_endpoint_is_unknown() -> None:
    names = {ep: {f.name for f in FIELDS if ep in f.endpoints} for ep in (COMPLETIONS, CHAT)}
    only = [(ep, f) for f in FIELDS if len(f.endpoints) == 1 for ep in (COMPLETIONS, CHAT)
            if ep not in f.endpoints and f.name not in names[ep]]  # (logprobs: a row per endpoint)
    assert only
    bodies = [(ep, {**BASE[ep], f.name: f.values[0] if f.values else "x"}) for ep, f in only]
    for (ep, f), (status, body) in zip(only, asyncio.run(_answers(bodies))):
        if f.name in ("prompt", "messages"):  # the other endpoint's required field is what is missing
            continue
        assert status == 400 and body["error"]["param"] == f.name and body["error"]["code"] == "unknown_field", \
            (ep, f.name, body)


def test_a_true_is_not_a_default_one_nor_a_zero_false() -> None:
    assert not fields.same_value(True, 1) and not fields.same_value(0, False)
    assert fields.same_value(0, 0.0) and fields.same_value({"type": "text"}, {"type": "text"})
    assert not fields.same_value([1], [True])


@pytest.mark.parametrize("chat", [False, True])
def test_the_validator_knows_exactly_the_table(chat: bool) -> None:
    from batchserve.server import protocol

    assert protocol._NAMES[chat] == {f.name for f in FIELDS if (CHAT if chat else COMPLETIONS) in f.endpoints}


def test_the_conformance_doc_is_up_to_date() -> None:
    assert fields.DOC.read_text() == fields.markdown(), \
        "docs/api-fields.md is stale: run python -m batchserve.server.fields --markdown"
