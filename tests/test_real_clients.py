"""The clients users bring, unmodified, against a live server on the real model: LangChain's
ChatOpenAI (invoke, stream, structured output by JSON schema and by function calling, a bound
tool named or left to the model) and LiteLLM's completion (plain, streamed, JSON mode). Each test checks what the client
hands its caller (text, a parsed pydantic object, a tool call's name and arguments), since a
client may accept a response the server shaped wrongly and fail only when it parses it.

The clients are imported in fixtures, not at the top: collecting the module (as `make
test-fast` does before deselecting it) then costs nothing.
"""
from __future__ import annotations

import json
from typing import Any, Literal

import httpx
import pytest
from pydantic import BaseModel, Field
from server_helpers import MODEL, build_engine, start_server, wait_idle

from batchserve.config import CacheConfig, EngineConfig

pytestmark = [pytest.mark.http, pytest.mark.model]

CAPITAL = "What is the capital of France?"
AS_JSON = 'Which city is the capital of France? Answer in JSON with the key "city".'

# This machine, and CI's, reach no network but the package index, and a client that fetched
# something at run time would hang or fail here. LiteLLM downloads its model cost map when it
# is imported unless told to use the copy it ships (LITELLM_LOCAL_MODEL_COST_MAP), and its
# offline mode makes every other catalog or tokenizer it would fetch on its own come from its
# bundled copies. tiktoken: LiteLLM points TIKTOKEN_CACHE_DIR at the encodings it bundles, and
# LangChain's ChatOpenAI needs tiktoken only to count tokens (get_num_tokens), not called here.
# LangSmith tracing stays off without LANGSMITH_TRACING.
OFFLINE = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_OFFLINE_MODE": "true"}


@pytest.fixture(scope="module")
def litellm() -> Any:
    with pytest.MonkeyPatch.context() as mp:
        for k, v in OFFLINE.items():
            mp.setenv(k, v)  # before the import, which reads them
        import litellm

        litellm.suppress_debug_info = True
        yield litellm


@pytest.fixture(scope="module")
def chat_openai() -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI


class City(BaseModel):
    """A city and its country."""

    name: str = Field(description="the city's name")
    country: str


class GetWeather(BaseModel):
    """Get the weather forecast for a city."""

    city: str
    unit: Literal["celsius", "fahrenheit"]


@pytest.fixture(scope="module")
def server():
    srv = start_server(build_engine(EngineConfig(cache=CacheConfig(kv_cache_gb=0.25))))
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def all_blocks_back(server):
    """Every client leaves the engine idle with every KV block free (streams closed, nothing
    left running after the client has what it wanted)."""
    yield
    wait_idle(server.engine)
    assert server.engine.kv.num_free_blocks == server.engine.kv.num_blocks


@pytest.fixture
def chat(server, chat_openai) -> Any:
    """ChatOpenAI on the server: greedy, short answers unless told otherwise."""
    def make(**kw: Any) -> Any:
        kw = {"temperature": 0, "max_tokens": 16, **kw}
        return chat_openai(base_url=server.url + "/v1", api_key="x", model=MODEL, max_retries=0, timeout=60, **kw)

    return make


@pytest.fixture
def complete(server, litellm) -> Any:
    """litellm.completion on the server, as an OpenAI-compatible endpoint ("openai/<name>")."""
    def call(**kw: Any) -> Any:
        kw = {"max_tokens": 16, "temperature": 0, **kw}
        return litellm.completion(model="openai/" + MODEL, api_base=server.url + "/v1", api_key="x",
                                  num_retries=0, timeout=60, **kw)

    return call


def served_answer(server, content: str, max_tokens: int = 16) -> str:
    """The server's own greedy answer to one user message, over plain HTTP: what a client
    should hand its caller unchanged."""
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
        "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_langchain_invoke_and_stream(server, chat) -> None:
    expected = served_answer(server, CAPITAL)
    assert len(expected.split()) >= 3, expected
    llm = chat()
    msg = llm.invoke(CAPITAL)
    assert msg.content == expected
    assert msg.response_metadata["finish_reason"] in ("stop", "length")
    assert msg.usage_metadata["output_tokens"] > 0 and msg.usage_metadata["input_tokens"] > 5
    chunks = list(llm.stream(CAPITAL))
    assert sum(1 for c in chunks if c.content) > 1  # streamed piece by piece, not in one piece
    assert "".join(c.content for c in chunks) == msg.content  # greedy: the same answer


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output_is_a_parsed_object(chat, method: str) -> None:
    structured = chat(max_tokens=60).with_structured_output(City, method=method, include_raw=True)
    out = structured.invoke(AS_JSON)
    assert out["parsing_error"] is None, out
    city = out["parsed"]
    assert isinstance(city, City) and city.name.strip() and city.country.strip(), city
    raw = out["raw"]
    if method == "function_calling":  # the answer came back as a call of the schema's tool
        assert [c["name"] for c in raw.tool_calls] == ["City"], raw
    else:
        assert set(json.loads(raw.content)) == {"name", "country"}, raw.content


def test_langchain_bound_tool_named_in_tool_choice_is_called(chat) -> None:
    bound = chat(max_tokens=40).bind_tools([GetWeather], tool_choice="GetWeather")
    msg = bound.invoke("What is the weather in Paris, in celsius?")
    assert len(msg.tool_calls) == 1, msg
    call = msg.tool_calls[0]
    assert call["name"] == "GetWeather" and call["id"], call
    assert call["args"]["unit"] in ("celsius", "fahrenheit") and call["args"]["city"].strip(), call
    GetWeather.model_validate(call["args"])


def test_langchain_bound_tool_with_the_default_choice_is_called_or_answered(chat) -> None:
    """bind_tools with no tool_choice sends none: OpenAI's "auto". The model answers in text or
    calls the tool; either way LangChain hands over a clean message (no call it failed to parse),
    and a call has arguments the tool's schema accepts."""
    bound = chat(max_tokens=60).bind_tools([GetWeather])
    for question in ("What is the weather in Paris, in celsius?", CAPITAL):
        msg = bound.invoke(question)
        assert not msg.invalid_tool_calls, msg
        if msg.tool_calls:
            (call,) = msg.tool_calls
            assert call["name"] == "GetWeather" and msg.response_metadata["finish_reason"] == "tool_calls", msg
            GetWeather.model_validate(call["args"])
        else:
            assert msg.content.strip() and not msg.content.startswith("<"), msg


def test_litellm_plain_and_streamed(server, complete) -> None:
    messages = [{"role": "user", "content": CAPITAL}]
    r = complete(messages=messages)
    text = r.choices[0].message.content
    assert text == served_answer(server, CAPITAL) and r.choices[0].finish_reason in ("stop", "length"), r
    assert r.usage.completion_tokens > 0 and r.model.endswith(MODEL)
    pieces = [c.choices[0].delta.content for c in complete(messages=messages, stream=True)
              if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 1 and "".join(pieces) == text


def test_litellm_json_mode_returns_json(complete) -> None:
    r = complete(messages=[{"role": "user", "content": AS_JSON}], max_tokens=60, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop", r
    value = json.loads(r.choices[0].message.content)
    assert isinstance(value, dict) and value, value
