"""The GGUF header reader (runner/gguf_file.py) against gguf's own GGUFReader, and the GGUF
loader's lazy weights, on small files written here with gguf's GGUFWriter (model-free)."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from batchserve.runner import loader
from batchserve.runner.gguf_file import GGUFArrayLength, read_gguf
from batchserve.runner.loader import LazyWeights, ModelLoadError


def _write(path, arch: str, meta: dict, tensors: dict) -> str:
    """A GGUF file: `meta` (key -> (kind, value)) and `tensors` (name -> (data, raw type or None))."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, (kind, value) in meta.items():
        getattr(w, f"add_{kind}")(key, value)
    for name, (data, raw) in tensors.items():
        if raw is None:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _quantized(x: np.ndarray, kind: Q) -> np.ndarray:
    return gguf.quants.quantize(x.astype(np.float32), kind)


def test_read_gguf_gives_what_gguf_reader_gives(tmp_path):
    rng = np.random.default_rng(0)
    meta = {"x.u32": ("uint32", 7), "x.i64": ("int64", -3), "x.f32": ("float32", 1e-5), "x.f64": ("float64", 0.1),
            "x.flag": ("bool", True), "x.name": ("string", "naïve 東京"), "x.ints": ("array", [1, 2, 3]),
            "x.floats": ("array", [0.5, 0.25]), "x.words": ("array", ["a", "bc", "", "東京"])}
    tensors = {"f32": (rng.standard_normal((3, 5)).astype(np.float32), None),
               "f16": (rng.standard_normal(7).astype(np.float16), None),
               "q8": (_quantized(rng.standard_normal((4, 64)), Q.Q8_0), Q.Q8_0),
               "q4": (_quantized(rng.standard_normal((2, 3, 32)), Q.Q4_1), Q.Q4_1)}
    path = _write(tmp_path / "m.gguf", "llama", meta, tensors)
    ref = gguf.GGUFReader(path)
    lean, full = read_gguf(path), read_gguf(path, keep_strings=True)
    want = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert full.fields == want
    assert lean.fields["x.words"] == GGUFArrayLength(4) and len(lean.fields["x.words"]) == 4
    assert {k: v for k, v in lean.fields.items() if k != "x.words"} == {k: v for k, v in want.items() if k != "x.words"}
    assert [t.name for t in lean.tensors] == [t.name for t in ref.tensors] == list(tensors)
    for mine, theirs in zip(lean.tensors, ref.tensors):
        assert mine.tensor_type == theirs.tensor_type
        assert mine.shape == tuple(theirs.shape.tolist())
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape
        assert np.array_equal(mine.data, theirs.data)
        assert np.array_equal(gguf.dequantize(mine.data, mine.tensor_type),
                              gguf.dequantize(theirs.data, theirs.tensor_type))


def test_read_gguf_refuses_what_is_not_gguf(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"NOPE" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf(str(bad))
    bad.write_bytes(b"GGUF" + (9).to_bytes(4, "little") + bytes(16))
    with pytest.raises(ValueError, match="version 9"):
        read_gguf(str(bad))
    with pytest.raises(ModelLoadError, match="cannot read the GGUF file"):
        loader._load_gguf(str(bad))


def _tiny_llama(path) -> str:
    """A one-layer Llama GGUF (hidden 32, 2 heads of 16, 1 KV head) with Q8_0 / Q4_1 matrices."""
    rng = np.random.default_rng(1)
    h, inter, vocab = 32, 64, 8
    meta = {"llama.block_count": ("uint32", 1), "llama.embedding_length": ("uint32", h),
            "llama.feed_forward_length": ("uint32", inter), "llama.attention.head_count": ("uint32", 2),
            "llama.attention.head_count_kv": ("uint32", 1), "llama.context_length": ("uint32", 64),
            "llama.attention.layer_norm_rms_epsilon": ("float32", 1e-5), "llama.vocab_size": ("uint32", vocab)}
    q = lambda *shape, kind=Q.Q8_0: (_quantized(rng.standard_normal(shape) * 0.1, kind), kind)  # noqa: E731
    tensors = {"token_embd.weight": q(vocab, h), "output_norm.weight": (np.ones(h, np.float32), None),
               "blk.0.attn_norm.weight": (rng.random(h).astype(np.float32), None),
               "blk.0.ffn_norm.weight": (rng.random(h).astype(np.float32), None),
               "blk.0.attn_q.weight": q(h, h), "blk.0.attn_k.weight": q(16, h, kind=Q.Q4_1),
               "blk.0.attn_v.weight": q(16, h), "blk.0.attn_output.weight": q(h, h),
               "blk.0.ffn_gate.weight": q(inter, h), "blk.0.ffn_up.weight": q(inter, h),
               "blk.0.ffn_down.weight": q(h, inter, kind=Q.Q4_1)}
    return _write(path, "llama", meta, tensors)


def test_gguf_weights_are_dequantized_only_when_asked_and_as_an_eager_load_would(tmp_path, monkeypatch):
    monkeypatch.setattr(loader, "_gguf_tokenizer", lambda path: None)
    path = _tiny_llama(tmp_path / "tiny.gguf")
    from batchserve.config import ModelConfig

    loaded = loader.load_model(ModelConfig(model=path))
    assert isinstance(loaded.weights, LazyWeights)
    assert len(loaded.weights) == 11 and "model.layers.0.self_attn.q_proj.weight" in loaded.weights
    assert not loaded.weights._made  # nothing dequantized yet
    assert {k: f for k, (f, _) in loaded.quantized.items()} == {
        "model.embed_tokens.weight": 1, "model.layers.0.self_attn.q_proj.weight": 1,
        "model.layers.0.self_attn.k_proj.weight": 0, "model.layers.0.self_attn.v_proj.weight": 1,
        "model.layers.0.self_attn.o_proj.weight": 1, "model.layers.0.mlp.gate_proj.weight": 1,
        "model.layers.0.mlp.up_proj.weight": 1, "model.layers.0.mlp.down_proj.weight": 0}
    ref = {t.name: t for t in gguf.GGUFReader(path).tensors}
    q = loaded.weights["model.layers.0.self_attn.q_proj.weight"]
    want = loader._unpermute(gguf.dequantize(ref["blk.0.attn_q.weight"].data, Q.Q8_0), 2)
    assert q.dtype == torch.float32 and torch.equal(q, torch.from_numpy(want.copy()))
    assert loaded.weights["model.layers.0.self_attn.q_proj.weight"] is q  # made once, then kept
    k_raw = loaded.quantized["model.layers.0.self_attn.k_proj.weight"][1]
    assert torch.equal(k_raw, torch.from_numpy(loader._unpermute(np.asarray(ref["blk.0.attn_k.weight"].data), 1)))
    norm = loaded.weights["model.layers.0.input_layernorm.weight"]
    assert torch.equal(norm, torch.from_numpy(np.array(ref["blk.0.attn_norm.weight"].data)))
    assert set(loaded.weights._made) == {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.input_layernorm.weight"}


def test_lazy_weights_convert_lazily_and_from_what_was_made():
    calls = []

    def make(name):
        calls.append(name)
        return torch.ones(2) * len(calls)

    w = LazyWeights({"a": lambda: make("a"), "b": lambda: make("b")})
    first = w["a"]
    half = w.converted(lambda t: t.to(torch.float16))
    assert calls == ["a"] and list(half) == ["a", "b"] and "b" in half and "c" not in half
    assert torch.equal(half["a"], first.half()) and calls == ["a"]  # converted from the one made
    assert half["b"].dtype == torch.float16 and calls == ["a", "b"]
    assert "b" not in w._made  # the converted view does not keep the float32 one too


@pytest.mark.parametrize("kind", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0])
def test_dequantize_in_row_chunks_equals_gguf_dequantize(kind, monkeypatch):
    monkeypatch.setattr(loader, "_DEQUANT_ROWS", 3)  # several chunks, the last one short
    raw = _quantized(np.random.default_rng(2).standard_normal((10, 256)), kind)
    got = loader._dequantize(gguf.dequantize, raw, kind)
    assert got.dtype == np.float32 and np.array_equal(got, gguf.dequantize(raw, kind))
