"""Function calling: tools with tool_choice "auto", "required" or a named function, answered
through structured outputs, in OpenAI's message and stream shapes; tools described in a system
message to a template that does not render them; earlier
calls in the history kept for templates that know nothing of them. Model-free (a real
byte-level tokenizer; the fake model samples within the grammar), and one real-model call."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from fake_server import MODEL, byte_tokenizer, fake_engine, serve_app

from batchserve.engine.engine import tools_text
from batchserve.server.responses import ChunkWriter
from batchserve.server.tools import parse_tools, tool_message

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the forecast",
    "parameters": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}, "days": {"type": "integer", "minimum": 0,
                                                                                            "maximum": 9}},
                   "required": ["unit", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False}}}
ASK = [{"role": "user", "content": "weather in Paris?"}]


async def _post(body: dict) -> tuple[int, dict | list]:
    async with serve_app(fake_engine(tokenizer=byte_tokenizer())) as (client, _):
        r = await client.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 100, "messages": ASK,
                                                            **body})
        if not body.get("stream"):
            return r.status_code, r.json()
        return r.status_code, [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def _args_ok(call: dict) -> None:
    args = json.loads(call["function"]["arguments"])
    assert call["type"] == "function" and call["id"].startswith("call_")
    if call["function"]["name"] == "get_weather":
        assert args["unit"] in ("c", "f") and 0 <= args["days"] <= 9 and set(args) == {"unit", "days"}
    else:
        assert call["function"]["name"] == "get_time" and args["zone"] in ("utc", "cet")


def test_a_named_function_is_called_with_arguments_in_its_schema() -> None:
    status, out = asyncio.run(_post({"tools": [WEATHER, TIME],
                                     "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}))
    assert status == 200, out
    choice = out["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert choice["message"]["content"] is None and choice["finish_reason"] == "stop"
    assert call["function"]["name"] == "get_weather"
    _args_ok(call)


def test_required_makes_calls_and_finishes_with_tool_calls() -> None:
    status, out = asyncio.run(_post({"tools": [WEATHER, TIME], "tool_choice": "required",
                                     "parallel_tool_calls": False}))
    assert status == 200, out
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and len(choice["message"]["tool_calls"]) == 1
    _args_ok(choice["message"]["tool_calls"][0])


def test_required_allows_several_calls_unless_parallel_calls_are_off() -> None:
    eng = fake_engine(tokenizer=byte_tokenizer())
    two = '[{"name": "get_time", "arguments": {"zone": "utc"}}, {"name": "get_weather", "arguments": ' \
          '{"unit": "c", "days": 3}}]'
    for parallel, fits in ((True, True), (False, False)):
        _, calling = parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required",
                                  "parallel_tool_calls": parallel})
        g = eng.compile(calling.constraint)
        assert all(g.accept(b) for b in two.encode()) == fits


def test_a_streamed_call_arrives_whole_before_the_finish() -> None:
    status, chunks = asyncio.run(_post({"tools": [WEATHER], "stream": True,
                                        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}))
    assert status == 200
    deltas = [c["choices"][0]["delta"] for c in chunks]
    calls = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert len(calls) == 1 and calls[0][0]["index"] == 0
    _args_ok(calls[0][0])
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert not any(d.get("content") for d in deltas)  # no arguments leak out as text


def test_auto_holds_the_answer_to_prose_or_tagged_calls() -> None:
    eng = fake_engine(tokenizer=byte_tokenizer())
    call = '<tool_call>{"name": "get_weather", "arguments": {"unit": "c", "days": 3}}</tool_call>'
    two = call + '\n<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>'
    cases = [("It is sunny.", True, True), (call, True, True), (two, True, False),
             ('<tool_call>{"name": "get_weather", "arguments": {"unit": "k", "days": 3}}</tool_call>', False, False),
             ('<tool_call>{"name":"get_weather", "arguments": {"unit": "c", "days": 3}}</tool_call>', False, False),
             ("<b>bold</b>", False, False)]
    for parallel in (None, False):
        _, calling = parse_tools({"tools": [WEATHER, TIME], "parallel_tool_calls": parallel})
        for text, fits, fits_single in cases:
            g = eng.compile(calling.constraint)
            assert all(g.accept(b) for b in text.encode()) == (fits if parallel is None else fits_single), (text, parallel)
    _, calling = parse_tools({"tools": [WEATHER, TIME], "tool_choice": "auto"})
    message, finish = tool_message(calling, two, "stop")
    assert finish == "tool_calls" and message["content"] is None and len(message["tool_calls"]) == 2
    for c in message["tool_calls"]:
        _args_ok(c)
    assert tool_message(calling, "It is sunny.", "stop") == ({"role": "assistant", "content": "It is sunny."}, "stop")
    assert tool_message(calling, call[:30], "length") == ({"role": "assistant", "content": call[:30]}, "length")


def test_auto_over_http_answers_in_text_or_calls_and_shows_the_model_the_tools() -> None:
    status, out = asyncio.run(_post({"tools": [WEATHER, TIME], "seed": 1}))
    assert status == 200, out
    choice = out["choices"][0]
    if choice["message"].get("tool_calls"):
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        for c in choice["message"]["tool_calls"]:
            _args_ok(c)
    else:  # prose, or a call cut by max_tokens: text either way
        assert isinstance(choice["message"]["content"], str) and choice["finish_reason"] in ("stop", "length")
    # the fake template renders no tools: they reach the model in a system message, not lost
    _, plain = asyncio.run(_post({"max_tokens": 1}))
    _, none = asyncio.run(_post({"tools": [WEATHER, TIME], "tool_choice": "none", "max_tokens": 1}))
    extra = len(tools_text([WEATHER, TIME]).encode())
    assert out["usage"]["prompt_tokens"] >= plain["usage"]["prompt_tokens"] + extra
    assert none["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]  # none: no call, no tools shown


def test_an_auto_answer_in_prose_streams_as_it_comes() -> None:
    """Under auto, once the answer has started in prose (a call can only start with "<") its
    text streams chunk by chunk, the same text as unstreamed with the same seed."""
    for seed in range(3):
        body = {"tools": [WEATHER, TIME], "seed": seed, "max_tokens": 12}
        _, whole = asyncio.run(_post(body))
        status, chunks = asyncio.run(_post({**body, "stream": True}))
        assert status == 200
        message = whole["choices"][0]["message"]
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        if message.get("tool_calls"):
            assert [d["tool_calls"] for d in deltas if "tool_calls" in d][0][0]["function"] == \
                message["tool_calls"][0]["function"]
            continue
        pieces = [d["content"] for d in deltas if d.get("content")]
        assert "".join(pieces) == message["content"], (seed, pieces, message)
        assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    # piece by piece (the fake engine is fast enough to finish before the stream is read, so
    # the writer is fed by hand): prose goes out at once, a call only when complete
    _, calling = parse_tools({"tools": [WEATHER]})
    for first, shown in (("It is", True), ("<tool_", False)):
        w = ChunkWriter("r", 0, MODEL, chat=True, include_usage=False, tool_calling=calling)
        out = SimpleNamespace(text=first, new_text=first, new_logprobs=None, finished=False)
        assert (json.dumps(first).encode() in w.write(out)) == shown


@pytest.mark.parametrize("body, param", [
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}], "tool_choice": "required"},
     "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools[1].function.name"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_tool_requests_are_400s_naming_the_field(body: dict, param: str) -> None:
    status, out = asyncio.run(_post(body))
    assert status == 400 and out["error"]["param"] == param, out


def test_none_answers_in_text_and_earlier_calls_stay_in_the_history() -> None:
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12 degrees"}]
    status, out = asyncio.run(_post({"tools": [WEATHER], "tool_choice": "none", "messages": history,
                                     "max_tokens": 3}))
    assert status == 200 and out["choices"][0]["message"]["content"] and "tool_calls" not in out["choices"][0]["message"]
    # the call's JSON is in the prompt the template was given: more prompt tokens than without it
    assert out["usage"]["prompt_tokens"] > len('<user>weather in Paris?<assistant><tool>12 degrees<assistant>')
    status, out = asyncio.run(_post({"messages": [{"role": "user", "content": "x", "tool_call_id": "1"}]}))
    assert status == 400 and out["error"]["param"] == "messages[0].tool_call_id"


@pytest.mark.model
def test_the_real_model_calls_a_named_function(llm) -> None:
    from batchserve.request import RequestSpec, SamplingParams

    tools, calling = parse_tools({"tools": [WEATHER], "tool_choice": {"type": "function",
                                                                      "function": {"name": "get_weather"}}})
    eng = llm.engine
    req = eng.add(RequestSpec(SamplingParams(max_tokens=40, temperature=0.0), messages=ASK, tools=tools,
                              constraint=calling.constraint))
    outs = []
    while eng.has_unfinished:
        outs += [o for o in eng.step().outputs if o.request_id == req.request_id and o.finished]
    args = json.loads(outs[0].text)
    assert outs[0].finish_reason == "stop" and args["unit"] in ("c", "f") and 0 <= args["days"] <= 9
