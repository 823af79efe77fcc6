"""Load or refuse, never load wrong: every config field that changes the decoder's arithmetic
is either computed or refused with an error naming the field and its value (no weights here:
the configs are dicts, the GGUF files a few bytes of metadata)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from batchserve.runner.loader import ModelLoadError, _load_gguf, check_weights
from batchserve.runner.models.config import SUPPORTED_MODEL_TYPES, LlamaConfig, UnsupportedModelError
from batchserve.runner.models.llama import expected_weights

BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)


def cfg(**kw) -> LlamaConfig:
    return LlamaConfig.from_hf({**BASE, **kw})


def refused(**kw) -> str:
    with pytest.raises(UnsupportedModelError) as e:
        cfg(**kw)
    return str(e.value)


def test_an_unsupported_architecture_lists_the_supported_ones():
    msg = refused(model_type="gpt2")
    assert "'gpt2'" in msg
    for name in ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3"):
        assert name in msg and name in SUPPORTED_MODEL_TYPES


@pytest.mark.parametrize("fields, named", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type='yarn'"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
     "rope_parameters.rope_type='dynamic'"),
    ({"model_type": "phi3", "rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}},
     "rope_scaling.rope_type='longrope'"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"hidden_act": "relu"}, "hidden_act='relu'"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quant_method='gptq'"),
    ({"model_type": "gemma3_text", "final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
    ({"model_type": "gemma3_text", "attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
    ({"model_type": "gemma3_text", "use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
    ({"model_type": "qwen2", "mlp_bias": True}, "mlp_bias=True"),
    ({"layer_types": ["full_attention", "chunked_attention"]}, "layer_types='chunked_attention'"),
    ({"layer_types": ["full_attention"]}, "layer_types"),
])
def test_arithmetic_not_implemented_is_refused_naming_field_and_value(fields, named):
    assert named in refused(**fields)


def test_biases_are_read_per_family():
    plain = cfg()
    assert not (plain.qkv_bias or plain.o_bias or plain.mlp_bias) and plain.is_plain_llama
    llama = cfg(attention_bias=True, mlp_bias=True)  # Llama's attention_bias covers o_proj too
    assert llama.qkv_bias and llama.o_bias and llama.mlp_bias and not llama.is_plain_llama
    qwen2 = cfg(model_type="qwen2")  # Qwen2 always has q/k/v biases, never an o_proj one
    assert qwen2.qkv_bias and not qwen2.o_bias
    qwen3 = cfg(model_type="qwen3", head_dim=32)
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.head_dim == 32


def test_family_defaults_fill_what_config_json_leaves_out():
    assert cfg().rms_norm_eps == 1e-6 and cfg(model_type="phi3").rms_norm_eps == 1e-5
    assert not cfg().tie_word_embeddings and cfg(model_type="gemma3_text").tie_word_embeddings
    assert cfg(model_type="gemma3_text").hidden_act == "gelu_tanh"


def test_sliding_windows():
    assert cfg(model_type="mistral", sliding_window=None).sliding_window is None
    m = cfg(model_type="mistral", sliding_window=8)
    assert m.sliding_window == 8 and [m.layer_window(i) for i in range(2)] == [8, 8]
    assert cfg(model_type="mistral", sliding_window=256).sliding_window is None  # as long as the context
    q = cfg(model_type="qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    assert [q.layer_window(i) for i in range(2)] == [None, 8]
    assert cfg(model_type="qwen2", use_sliding_window=False, sliding_window=8).sliding_window is None
    g = cfg(model_type="gemma3_text", sliding_window=8, num_hidden_layers=7, head_dim=16)
    assert [g.layer_window(i) for i in range(7)] == [8, 8, 8, 8, 8, None, 8]  # every sixth layer global
    assert g.local_rope_theta == 10000.0 and g.rope_theta == 1e6 and g.attn_scale == 256 ** -0.5


def test_rope_scaling_forms():
    assert cfg(rope_scaling={"rope_type": "linear", "factor": 2.0}).rope_scaling == {"rope_type": "linear",
                                                                                      "factor": 2.0}
    assert cfg(rope_parameters={"rope_type": "default", "rope_theta": 5e5}).rope_theta == 5e5
    g = cfg(model_type="gemma3_text", head_dim=16, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    assert g.rope_scaling["factor"] == 8.0 and g.local_rope_theta == 1e4


def test_tensors_must_be_exactly_those_the_config_implies():
    """A checkpoint whose config does not declare its biases would load and answer wrongly: refused."""
    c = cfg()
    weights = {k: torch.zeros(1) for k in expected_weights(c)}
    check_weights(c, weights, "ok")
    with pytest.raises(ModelLoadError, match="does not account for.*q_proj.bias"):
        check_weights(c, {**weights, "model.layers.0.self_attn.q_proj.bias": torch.zeros(1)}, "x")
    del weights["model.layers.1.mlp.down_proj.weight"]
    with pytest.raises(ModelLoadError, match="missing.*down_proj"):
        check_weights(c, weights, "x")


def _gguf(path, arch: str, **meta) -> str:
    """A GGUF file with `arch`'s shape metadata, `meta` on top, and one tensor."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_context_length(64)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(4)
    for key, value in meta.items():
        if isinstance(value, str):
            w.add_string(f"{arch}.{key}", value)
        else:
            w.add_float32(f"{arch}.{key}", value)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_gguf_architecture_and_fields_refused(tmp_path):
    with pytest.raises(ModelLoadError, match=r"GGUF architecture 'gemma2' is not supported; supported: .*gemma3"):
        _load_gguf(_gguf(tmp_path / "a.gguf", "gemma2"))
    with pytest.raises(ModelLoadError, match="rope.scaling.rope_type='yarn'"):
        _load_gguf(_gguf(tmp_path / "b.gguf", "llama", **{"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0}))
    with pytest.raises(ModelLoadError, match="llama.final_logit_softcapping=30.0"):
        _load_gguf(_gguf(tmp_path / "c.gguf", "llama", final_logit_softcapping=30.0))
