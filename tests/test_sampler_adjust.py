"""The logit adjustments (logit_bias, min_tokens, repetition / frequency / presence penalties,
min_p) on direct sampler calls, model-free; how min_tokens and stop_token_ids end a request, on
the fake engine; and their validation, a 400 naming the field."""
from __future__ import annotations

import types

import pytest
import torch
from conftest import FakeExecutor

from batchserve.config import CacheConfig, EngineConfig
from batchserve.engine.engine import LLMEngine
from batchserve.request import RequestError, RequestSpec, SamplingParams
from batchserve.runner.sampler import adjust_logits, sample, sample_torch
from batchserve.server.protocol import APIError, parse_generation

GREEDY = SamplingParams(temperature=0)


def _logits() -> torch.Tensor:  # float64: the PyTorch path (no kernel)
    return torch.tensor([[3.0, 2.0, 1.0, -1.0, 0.5]], dtype=torch.float64)


def _greedy(params: SamplingParams, history=None, output_index: int = 0, eos: int | None = None) -> int:
    return sample(_logits(), [params], [output_index], torch.Generator().manual_seed(0),
                  history=[history], eos_token_id=eos)[0]


def test_no_adjustment_leaves_the_logits_alone() -> None:
    logits = _logits()
    assert adjust_logits(logits, [GREEDY, SamplingParams(top_k=3)], [0, 0]) is logits
    assert not SamplingParams(min_p=0.5, temperature=0).adjusts_logits  # min_p cannot change a greedy pick


def test_logit_bias_is_added() -> None:
    assert _greedy(GREEDY) == 0
    assert _greedy(SamplingParams(temperature=0, logit_bias={3: 100})) == 3
    assert _greedy(SamplingParams(temperature=0, logit_bias={0: -100})) == 1
    out = adjust_logits(_logits(), [SamplingParams(logit_bias={4: 1.5, 99: 5})], [0])  # 99: outside, ignored
    assert out[0].tolist() == [3.0, 2.0, 1.0, -1.0, 2.0]


def test_frequency_and_presence_penalties_count_the_output_only() -> None:
    hist = ([1, 1, 1], [0, 0, 2])  # token 0 twice in the output, token 1 only in the prompt
    out = adjust_logits(_logits(), [SamplingParams(frequency_penalty=0.5)], [3], [hist])[0]
    assert out.tolist() == [3.0 - 2 * 0.5, 2.0, 1.0 - 0.5, -1.0, 0.5]
    out = adjust_logits(_logits(), [SamplingParams(presence_penalty=1.5)], [3], [hist])[0]
    assert out.tolist() == [3.0 - 1.5, 2.0, 1.0 - 1.5, -1.0, 0.5]
    assert _greedy(SamplingParams(temperature=0, frequency_penalty=1.0), hist) == 1


def test_repetition_penalty_covers_prompt_and_output() -> None:
    hist = ([3], [0])
    out = adjust_logits(_logits(), [SamplingParams(repetition_penalty=2.0)], [1], [hist])[0]
    assert out.tolist() == [1.5, 2.0, 1.0, -2.0, 0.5]  # positive divided, negative multiplied
    assert _greedy(SamplingParams(temperature=0, repetition_penalty=2.0), hist) == 1


def test_penalties_only_touch_their_rows() -> None:
    logits = torch.cat([_logits(), _logits()])
    out = adjust_logits(logits, [GREEDY, SamplingParams(frequency_penalty=2.0)], [1, 1], [None, ([], [0])])
    assert out[0].tolist() == _logits()[0].tolist() and out[1, 0] == 3.0 - 2.0


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached() -> None:
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(1,))
    assert _greedy(p, output_index=1, eos=0) == 2  # EOS (0) and the stop id (1) are masked
    assert _greedy(p, output_index=2, eos=0) == 0  # min_tokens generated: EOS may come
    ignore = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)
    assert _greedy(ignore, output_index=0, eos=0) == 0  # EOS does not end this one: not masked


def test_min_p_drops_unlikely_tokens() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]], dtype=torch.float64))
    p = SamplingParams(min_p=0.4)  # keeps prob >= 0.2: tokens 0 and 1
    out = adjust_logits(logits.clone(), [p], [0])
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False, False]
    u = torch.linspace(0.001, 0.999, 200, dtype=torch.float64)
    toks = sample_torch(out.expand(200, -1), torch.ones(200), torch.zeros(200, dtype=torch.long), torch.ones(200), u)
    assert set(toks.tolist()) == {0, 1}
    hot = adjust_logits(logits.clone(), [SamplingParams(min_p=0.4, temperature=2.0)], [0])  # flatter: sqrt(p)
    assert torch.isfinite(hot[0]).tolist() == [True, True, True, False, False]


def test_min_tokens_and_stop_token_ids_end_requests(make_fake_engine) -> None:
    eng = make_fake_engine(eos=9)  # the fake's tokens run 6, 7, 8, ...
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=8, min_tokens=5), now=0.0, request_id="min")
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=8, stop_token_ids=(8,)), now=0.0, request_id="stop")
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=8, min_tokens=3, stop_token_ids=(7, 10)),
                    now=0.0, request_id="both")
    outs = {}
    step = 0
    while eng.has_unfinished:
        outs.update({o.request_id: o for o in eng.step(now=float(step)).outputs if o.finished})
        step += 1
    assert outs["min"].token_ids == list(range(6, 14)) and outs["min"].finish_reason == "length"
    assert outs["stop"].token_ids == [6, 7, 8] and outs["stop"].finish_reason == "stop"
    assert outs["both"].token_ids == [6, 7, 8, 9] and outs["both"].finish_reason == "stop"  # 9 is EOS


def _body(**kw) -> dict:
    return {"model": "m", "prompt": "hi", "max_tokens": 4, **kw}


def test_the_fields_reach_sampling_params() -> None:
    p = parse_generation(_body(presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.2, min_p=0.1,
                               min_tokens=2, stop_token_ids=[7, 8], logit_bias={"5": 10, "6": -100}),
                         chat=False).spec.params
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p, p.min_tokens) == \
        (0.5, -1.0, 1.2, 0.1, 2)
    assert p.stop_token_ids == (7, 8) and dict(p.logit_bias) == {5: 10, 6: -100} and p.penalized
    chat = parse_generation({"model": "m", "messages": [{"role": "user", "content": "hi"}], "min_tokens": 5},
                            chat=True).spec
    assert chat.params.min_tokens == 5 and chat.auto_max_tokens  # no max_tokens given: room for min_tokens


@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 2.5), ("frequency_penalty", -2.01), ("repetition_penalty", 0), ("repetition_penalty", 2.5),
    ("min_p", 1.5), ("min_p", -0.1), ("min_tokens", -1), ("min_tokens", 5), ("min_tokens", 1.5),
    ("stop_token_ids", 5), ("stop_token_ids", [-1]), ("stop_token_ids", ["a"]),
    ("logit_bias", {"5": 101}), ("logit_bias", {"x": 1}), ("logit_bias", {"-1": 1}), ("logit_bias", {"5": "1"}),
    ("logit_bias", [1]), ("presence_penalty", True)])
def test_out_of_range_values_are_400s_naming_the_field(field, value) -> None:
    with pytest.raises(APIError) as e:
        parse_generation(_body(**{field: value}), chat=False)
    assert e.value.status == 400 and e.value.param == field and field in e.value.message


def test_logit_bias_outside_the_vocabulary_is_refused() -> None:
    ex = FakeExecutor(64)
    ex.cfg = types.SimpleNamespace(vocab_size=100)
    eng = LLMEngine(EngineConfig(cache=CacheConfig(block_size=4, num_blocks=64)), ex)
    ok = RequestSpec(SamplingParams(logit_bias={99: 1}), prompt=[5, 6])
    assert eng.prepare(ok).params.logit_bias == ((99, 1),)
    with pytest.raises(RequestError) as e:
        eng.prepare(RequestSpec(SamplingParams(logit_bias={100: 1}), prompt=[5, 6]))
    assert e.value.param == "logit_bias"
