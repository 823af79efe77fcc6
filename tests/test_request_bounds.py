"""Every sampling and request parameter is bounded at validation: a property test drives the
HTTP validator, the engine's admission checks and the sampler with the same generated values.
Whatever the validator accepts, the sampler must take without raising (it runs on the engine
thread, in a step other requests share); whatever it refuses is a 400 naming the field."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import FakeExecutor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchserve.config import CacheConfig, EngineConfig
from batchserve.engine.engine import LLMEngine
from batchserve.request import RequestError, SamplingParams
from batchserve.runner.sampler import sample
from batchserve.server.protocol import APIError, parse_generation, parse_json

EDGES = [-2**64, -2**63 - 1, -2**63, -1, 0, 1, 2, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 10**400]
VALUES = st.one_of(st.none(), st.integers(-2**70, 2**70), st.sampled_from(EDGES), st.floats(),
                   st.sampled_from([0.0, 1e-45, 1e-300, 5e-324, 2.0, 2.0000001, 1.0, 1 + 1e-16]),
                   st.booleans(), st.text(max_size=2))
FIELDS = ("temperature", "top_p", "top_k", "seed", "max_tokens", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "min_p", "min_tokens")
ENGINE = LLMEngine(EngineConfig(cache=CacheConfig(block_size=4, num_blocks=64)), FakeExecutor(64))


def _kernel():
    from batchserve.runner.kernels import fused_ops_ext

    k = fused_ops_ext()
    if k is None:
        pytest.skip("the C++ kernels did not build here")
    return k


@pytest.mark.parametrize("backend", ["torch", pytest.param("kernel", marks=pytest.mark.kernel)])
@settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(values=st.fixed_dictionaries({}, optional={f: VALUES for f in FIELDS}), chat=st.booleans())
def test_what_validation_accepts_the_sampler_takes(backend, values, chat) -> None:
    kernel = _kernel() if backend == "kernel" else None
    given_ = {k: v for k, v in values.items() if v is not None}
    body = {"model": "m", **({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": [5, 6]}),
            **given_}
    try:  # through JSON as a client sends it (json writes NaN / Infinity, and Python's json reads them)
        g = parse_generation(parse_json(json.dumps(body).encode()), chat=chat)
    except APIError as e:
        assert e.status == 400 and e.param in given_, (e.param, e.message)
        assert e.param in e.message
        return
    p = g.spec.params
    for name in FIELDS:  # what was sent is what runs
        if name in given_ and not (name == "top_k" and given_[name] == -1):
            assert getattr(p, name) == given_[name], name
    if not chat:  # the engine's admission: a RequestError naming a field, or a request that fits
        try:
            ENGINE.prepare(g.spec)
        except RequestError as e:
            assert e.param == "max_tokens" and "max_tokens" in given_
    dtype = torch.float32 if kernel is not None else torch.float64  # float64: the PyTorch path
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(0)).to(dtype)
    logits[1, :20] = -torch.inf
    rows = [p, SamplingParams(temperature=0), p]
    toks = sample(logits, rows, [0, 3, 2**31], torch.Generator().manual_seed(1), kernel=kernel)
    assert len(toks) == 3 and all(0 <= t < 40 for t in toks)


@pytest.mark.parametrize("field,value", [("top_k", 2**63), ("top_k", 2**31), ("seed", 2**63), ("seed", -2**63 - 1),
                                         ("max_tokens", 2**31), ("temperature", 10**400)])
def test_out_of_range_integers_are_400s(field, value) -> None:
    with pytest.raises(APIError) as e:
        parse_generation({"model": "m", "prompt": "hi", field: value}, chat=False)
    assert e.value.status == 400 and e.value.param == field


def test_sampling_params_bound_every_field() -> None:
    for kw, field in (({"top_k": 2**63}, "top_k"), ({"seed": 2**64}, "seed"), ({"temperature": True}, "temperature"),
                      ({"top_p": float("nan")}, "top_p"), ({"stop": ("x" * 1001,)}, "stop"),
                      ({"stop_token_ids": (-1,)}, "stop_token_ids"), ({"max_tokens": 2**31}, "max_tokens")):
        with pytest.raises(RequestError) as e:
            SamplingParams(**kw)
        assert e.value.param == field
