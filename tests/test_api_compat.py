"""The switches that make the server read and answer like vLLM's, model-free (tests/fake_server.py):
`--priority-order vllm` (lower first, default 0) mapped onto the native 0-10 scale at the HTTP
boundary; a soft-deadline cut reported as finish_reason "length" with the reason beside it (or the
native reason behind a flag); a missed hard deadline's 504 telling the SDKs not to retry."""
from __future__ import annotations

import asyncio
import json
import time

import pytest
from conftest import FakeExecutor
from fake_server import MODEL, fake_engine, serve_app

from batchserve.config import ConfigError, ServerConfig
from batchserve.request import DEFAULT_PRIORITY, MAX_PRIORITY, MIN_PRIORITY
from batchserve.server.protocol import APIError, parse_generation

BODY = {"model": MODEL, "prompt": "hello", "max_tokens": 3}


class SlowExecutor(FakeExecutor):
    """A fake model whose every step takes `step_time` of wall time, so deadlines bite."""

    def execute(self, batch):
        time.sleep(self.step_time)
        return super().execute(batch)


def _priority(order: str, value) -> int:
    body = dict(BODY) if value is None else {**BODY, "priority": value}
    return parse_generation(body, chat=False, priority_order=order).spec.priority


def test_vllm_priority_order_maps_lower_first_onto_the_native_scale() -> None:
    assert _priority("vllm", None) == _priority("native", None) == DEFAULT_PRIORITY  # both defaults: the middle
    assert _priority("vllm", 0) == DEFAULT_PRIORITY
    assert _priority("vllm", -5) == MAX_PRIORITY and _priority("vllm", 5) == MIN_PRIORITY
    ranks = [_priority("vllm", p) for p in range(-5, 6)]
    assert ranks == sorted(ranks, reverse=True) and len(set(ranks)) == 11  # order kept, nothing merged
    assert _priority("native", 7) == 7


@pytest.mark.parametrize("value", [6, -6, 2**40, "0", True, 0.5])
def test_vllm_priority_beyond_the_native_range_is_a_400(value) -> None:
    with pytest.raises(APIError) as e:
        _priority("vllm", value)
    assert e.value.status == 400 and e.value.param == "priority" and "lower first" in e.value.message


def test_priority_order_is_checked() -> None:
    with pytest.raises(ConfigError, match="priority_order"):
        ServerConfig(priority_order="reverse")


def test_vllm_order_serves_the_lower_value_first() -> None:
    """One request at a time (max_num_seqs 1): of two waiting, vLLM's priority -5 runs before 5
    (it may even preempt the one running, at the default 0)."""
    async def scenario() -> list[str]:
        eng = fake_engine(SlowExecutor(256, step_time=0.005), max_num_seqs=1)
        order: list[str] = []
        async with serve_app(eng, ServerConfig(priority_order="vllm")) as (client, _):
            async def ask(name: str, priority: int, delay: float) -> None:
                await asyncio.sleep(delay)
                r = await client.post("/v1/completions", json={**BODY, "max_tokens": 20, "ignore_eos": True,
                                                               "priority": priority})
                assert r.status_code == 200, r.text
                order.append(name)

            # "first" holds the only seat; "low" (5) then "high" (-5) wait behind it
            await asyncio.gather(ask("first", 0, 0), ask("low", 5, 0.02), ask("high", -5, 0.04))
        return order

    order = asyncio.run(scenario())
    assert order.index("high") < order.index("low") and order[-1] == "low", order


async def _deadline(config: ServerConfig, kind: str, stream: bool = False):
    eng = fake_engine(SlowExecutor(256, step_time=0.01))
    async with serve_app(eng, config) as (client, _):
        body = {**BODY, "max_tokens": 500, "ignore_eos": True, "deadline_ms": 150, "deadline_kind": kind,
                "stream": stream}
        r = await client.post("/v1/completions", json=body, timeout=20)
        return r, (r.text if stream else r.json())


def _last_choice(sse: str) -> dict:
    events = [json.loads(line[6:]) for line in sse.splitlines() if line.startswith("data: {")]
    return [e for e in events if e.get("choices")][-1]["choices"][0]


def test_soft_deadline_cut_is_length_with_the_reason_beside_it() -> None:
    r, body = asyncio.run(_deadline(ServerConfig(), "soft"))
    assert r.status_code == 200, r.text
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and choice["batchserve_finish_reason"] == "deadline_truncated"
    assert 0 < body["usage"]["completion_tokens"] < 500
    r, sse = asyncio.run(_deadline(ServerConfig(), "soft", stream=True))
    last = _last_choice(sse)
    assert last["finish_reason"] == "length" and last["batchserve_finish_reason"] == "deadline_truncated"


def test_native_finish_reasons_keep_deadline_truncated() -> None:
    r, body = asyncio.run(_deadline(ServerConfig(native_finish_reasons=True), "soft"))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "deadline_truncated" and "batchserve_finish_reason" not in choice
    r, sse = asyncio.run(_deadline(ServerConfig(native_finish_reasons=True), "soft", stream=True))
    assert _last_choice(sse)["finish_reason"] == "deadline_truncated"


def test_an_answer_that_ends_normally_has_no_extra_reason() -> None:
    async def scenario():
        async with serve_app(fake_engine()) as (client, _):
            return (await client.post("/v1/completions", json=BODY)).json()

    choice = asyncio.run(scenario())["choices"][0]
    assert choice["finish_reason"] == "length" and "batchserve_finish_reason" not in choice


def test_missed_hard_deadline_is_a_504_the_sdk_will_not_retry() -> None:
    r, body = asyncio.run(_deadline(ServerConfig(), "hard"))
    assert r.status_code == 504 and body["error"]["code"] == "deadline_exceeded"
    assert r.headers["x-should-retry"] == "false" and "retry-after" not in r.headers


def test_vllm_chat_template_fields_shape_the_prompt() -> None:
    """add_generation_prompt, continue_final_message and chat_template_kwargs reach the model's
    template (seen in the prompt's length: one token per byte); bad combinations are 400s."""
    from fake_server import byte_tokenizer

    tok = byte_tokenizer()
    tok.chat_template = ("{{ note or '' }}{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                         "{% if not (continue_final_message and loop.last) %}</>{% endif %}{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")

    async def post(**extra):
        async with serve_app(fake_engine(tokenizer=tok)) as (client, _):
            r = await client.post("/v1/chat/completions", json={
                "model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}], **extra})
            return r.status_code, r.json()

    def prompt_tokens(**extra) -> int:
        status, out = asyncio.run(post(**extra))
        assert status == 200, out
        return out["usage"]["prompt_tokens"]

    base = prompt_tokens()
    assert base == len("<user>hi</><assistant>")
    assert prompt_tokens(add_generation_prompt=False) == base - len("<assistant>")
    assert prompt_tokens(chat_template_kwargs={"note": "xyz"}) == base + 3
    cont = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Par"}]
    assert prompt_tokens(messages=cont, continue_final_message=True) == len("<user>hi</><assistant>Par")
    for extra, param in ((dict(messages=cont, continue_final_message=True, add_generation_prompt=True),
                          "continue_final_message"),
                         (dict(continue_final_message=True), "continue_final_message"),  # last is the user's
                         (dict(chat_template_kwargs={"messages": []}), "chat_template_kwargs"),
                         (dict(chat_template_kwargs=["x"]), "chat_template_kwargs")):
        status, out = asyncio.run(post(**extra))
        assert status == 400 and out["error"]["param"] == param, out
