"""The oneDNN linear path (weights packed once) against plain F.linear."""
from __future__ import annotations

import pytest
import torch

from batchserve.config import ConfigError, ModelConfig
from batchserve.profile import TINY_MODEL
from batchserve.runner.loader import load_model
from batchserve.runner.models.llama import Linear, LlamaModel, onednn_linear_ok


def test_packed_linear_matches_f_linear_and_unpacks_exactly():
    if not onednn_linear_ok(torch.zeros(1)):
        pytest.skip("torch built without oneDNN")
    w = torch.randn(96, 64)
    lin = Linear(w, packed=True)
    for rows in (1, 7, 64):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(lin(x), x @ w.t(), rtol=1e-5, atol=1e-4)
    assert torch.equal(lin.weight, w)


def test_model_logits_agree_across_linear_backends():
    loaded = load_model(ModelConfig(model="dummy", dummy_config=TINY_MODEL))
    torch_model = LlamaModel(loaded.config, loaded.weights, "torch")
    auto_model = LlamaModel(loaded.config, loaded.weights, "auto")
    assert torch_model.linear_backend == "torch"
    assert auto_model.linear_backend == ("onednn" if onednn_linear_ok(loaded.weights["model.norm.weight"]) else "torch")
    h = torch.randn(5, loaded.config.hidden_size)
    torch.testing.assert_close(auto_model.logits(h), torch_model.logits(h), rtol=1e-4, atol=1e-4)


def test_onednn_refused_where_it_cannot_run():
    loaded = load_model(ModelConfig(model="dummy", dummy_config=TINY_MODEL, dtype="bfloat16"))
    with pytest.raises(RuntimeError, match="linear_backend=onednn"):
        LlamaModel(loaded.config, loaded.weights, "onednn")
    assert LlamaModel(loaded.config, loaded.weights, "auto").linear_backend == "torch"
    with pytest.raises(ConfigError, match="linear_backend"):
        ModelConfig(linear_backend="mkl")
