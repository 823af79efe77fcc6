"""The decoder's configuration, and the checks that turn a Hugging Face config.json into it.

One decoder (models/llama.py) covers the Llama family and its relatives; what differs between
them is a handful of switches here (biases, q/k norms, the activation, Gemma's norm layout, a
sliding window). `from_hf` reads every config field that changes the arithmetic and refuses,
naming the field and its value, what the decoder does not compute: a checkpoint either loads
and matches transformers, or does not load.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any


class UnsupportedModelError(ValueError):
    """The checkpoint asks for arithmetic this decoder does not implement; the message names
    the field and its value (or the architecture, with the supported ones)."""


# model_type -> transformers' defaults for the fields that differ between families (what a
# config.json that leaves them out means)
_FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "max_position_embeddings": 2048},
    "mistral": {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "max_position_embeddings": 131072,
                "sliding_window": 4096},
    "qwen2": {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "max_position_embeddings": 32768},
    "qwen3": {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "max_position_embeddings": 32768},
    "gemma3_text": {"rms_norm_eps": 1e-6, "tie_word_embeddings": True, "max_position_embeddings": 131072,
                    "sliding_window": 4096, "hidden_activation": "gelu_pytorch_tanh", "rope_theta": 1e6},
    "phi3": {"rms_norm_eps": 1e-5, "tie_word_embeddings": False, "max_position_embeddings": 4096},
}
SUPPORTED_MODEL_TYPES = tuple(_FAMILIES)
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class LlamaConfig:
    """Shapes and arithmetic switches of one decoder. The defaults are SmolLM2-135M's (a plain Llama)."""

    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_layers: int = 30
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2
    arch: str = "llama"  # the Hugging Face model_type it came from
    qkv_bias: bool = False  # q_proj, k_proj, v_proj have biases
    o_bias: bool = False  # o_proj has a bias
    mlp_bias: bool = False  # gate_proj, up_proj, down_proj have biases
    qk_norm: bool = False  # an RMSNorm over head_dim on each q and k head before RoPE (Qwen3, Gemma 3)
    hidden_act: str = "silu"  # the MLP's gate activation: silu or gelu_tanh
    norm_plus_one: bool = False  # Gemma: every RMSNorm scales by (1 + weight)
    sandwich_norm: bool = False  # Gemma 3: norms on the attention and MLP outputs too, before the residual add
    embed_scale: float | None = None  # Gemma: embeddings multiplied by this (sqrt(hidden_size))
    attn_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    sliding_window: int | None = None  # a sliding layer attends to this many latest positions (its own included)
    layer_types: tuple[str, ...] | None = None  # "full" / "sliding" per layer; None: every layer full
    local_rope_theta: float | None = None  # sliding layers' RoPE theta, unscaled (Gemma 3); None: as full layers
    rope_freq_factors: tuple[float, ...] | None = None  # a GGUF file's rope_freqs: inv_freq divided by these

    @staticmethod
    def from_hf(d: dict) -> "LlamaConfig":
        """From a Hugging Face config.json dict; UnsupportedModelError for what is not implemented."""
        return config_from_hf(d)

    def layer_window(self, i: int) -> int | None:
        """The sliding window of layer i, or None where it attends to the whole context."""
        if self.sliding_window is None or (self.layer_types is not None and self.layer_types[i] != "sliding"):
            return None
        return self.sliding_window

    @property
    def is_plain_llama(self) -> bool:
        """Whether this is the arithmetic the fused C++ layer loop implements (no bias, norm or
        scale beyond Llama's, full attention everywhere)."""
        return (not (self.qkv_bias or self.o_bias or self.mlp_bias or self.qk_norm or self.norm_plus_one
                     or self.sandwich_norm) and self.hidden_act == "silu" and self.embed_scale is None
                and self.attn_scale is None and self.sliding_window is None)

    def to_hf(self) -> dict:
        """As a Hugging Face LlamaConfig dict (to write config.json); only for plain Llama configs."""
        if not self.is_plain_llama or self.rope_freq_factors is not None:
            raise UnsupportedModelError(f"to_hf writes plain Llama configs only, not a {self.arch!r} one")
        d = asdict(self)
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": d["vocab_size"], "hidden_size": d["hidden_size"],
            "intermediate_size": d["intermediate_size"], "num_hidden_layers": d["num_layers"],
            "num_attention_heads": d["num_heads"], "num_key_value_heads": d["num_kv_heads"],
            "head_dim": d["head_dim"], "rms_norm_eps": d["rms_norm_eps"], "rope_theta": d["rope_theta"],
            "rope_scaling": d["rope_scaling"], "max_position_embeddings": d["max_position_embeddings"],
            "tie_word_embeddings": d["tie_word_embeddings"], "bos_token_id": d["bos_token_id"],
            "eos_token_id": d["eos_token_id"], "hidden_act": "silu", "attention_bias": False,
            "mlp_bias": False, "torch_dtype": "float32",
        }

    def num_params(self) -> int:
        h, i, hd = self.hidden_size, self.intermediate_size, self.head_dim
        layer = h * hd * (self.num_heads * 2 + self.num_kv_heads * 2) + 3 * h * i + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + emb + h


def _refuse(model_type: str, field: str, value: Any, why: str = "") -> UnsupportedModelError:
    return UnsupportedModelError(f"{model_type}: {field}={value!r} is not supported{': ' + why if why else ''}")


def check_rope(model_type: str, rope: dict | None, field: str = "rope_scaling") -> dict | None:
    """A RoPE parameters dict -> the scaling dict the decoder computes (None: plain RoPE), or
    UnsupportedModelError naming the type (yarn, dynamic, longrope, ...)."""
    if not rope:
        return None
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise _refuse(model_type, f"{field}.rope_type", kind, f"implemented: {', '.join(ROPE_TYPES)}")
    prf = rope.get("partial_rotary_factor", 1.0)
    if prf not in (None, 1, 1.0):
        raise _refuse(model_type, f"{field}.partial_rotary_factor", prf, "RoPE rotates the whole head here")
    if kind == "default":
        return None
    if not rope.get("factor"):
        raise _refuse(model_type, f"{field}.factor", rope.get("factor"), f"{kind} RoPE needs a factor")
    return {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")}


def config_from_hf(d: dict) -> LlamaConfig:
    """A config.json dict -> LlamaConfig, after checking every field that changes the arithmetic."""
    mt = d.get("model_type", "llama")
    if mt not in _FAMILIES:
        raise UnsupportedModelError(f"model_type {mt!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    fam = _FAMILIES[mt]
    get = lambda key: d.get(key, fam.get(key))  # noqa: E731
    if d.get("quantization_config"):
        q = d["quantization_config"]
        raise _refuse(mt, "quantization_config.quant_method", q.get("quant_method") if isinstance(q, dict) else q,
                      "load an unquantized checkpoint or a GGUF file")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if d.get(key) is not None:
            raise _refuse(mt, key, d[key])
    if d.get("use_bidirectional_attention"):
        raise _refuse(mt, "use_bidirectional_attention", True, "a causal decoder")
    if d.get("partial_rotary_factor", 1.0) not in (None, 1, 1.0):
        raise _refuse(mt, "partial_rotary_factor", d["partial_rotary_factor"], "RoPE rotates the whole head here")
    act_field = "hidden_activation" if mt == "gemma3_text" else "hidden_act"
    act = get(act_field) or "silu"
    if act not in _ACTIVATIONS:
        raise _refuse(mt, act_field, act, f"implemented: {', '.join(_ACTIVATIONS)}")
    heads = d["num_attention_heads"]
    head_dim = d.get("head_dim") or d["hidden_size"] // heads
    rope, theta, local_theta, layer_types, window = _rope_and_window(mt, d, d["num_hidden_layers"], get)
    attn_bias = bool(d.get("attention_bias", False))
    if d.get("mlp_bias") and mt != "llama":
        raise _refuse(mt, "mlp_bias", True)
    eos = d.get("eos_token_id", fam.get("eos_token_id"))
    gemma = mt == "gemma3_text"
    return LlamaConfig(
        vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
        num_layers=d["num_hidden_layers"], num_heads=heads, num_kv_heads=d.get("num_key_value_heads") or heads,
        head_dim=head_dim, rms_norm_eps=float(get("rms_norm_eps")), rope_theta=float(theta), rope_scaling=rope,
        max_position_embeddings=get("max_position_embeddings"),
        tie_word_embeddings=bool(get("tie_word_embeddings")), bos_token_id=d.get("bos_token_id"),
        eos_token_id=eos[0] if isinstance(eos, list) else eos, arch=mt,
        qkv_bias=attn_bias or mt == "qwen2", o_bias=attn_bias, mlp_bias=bool(d.get("mlp_bias", False)),
        qk_norm=mt in ("qwen3", "gemma3_text"), hidden_act=_ACTIVATIONS[act],
        norm_plus_one=gemma, sandwich_norm=gemma, embed_scale=math.sqrt(d["hidden_size"]) if gemma else None,
        attn_scale=float(d.get("query_pre_attn_scalar", 256)) ** -0.5 if gemma else None,
        sliding_window=window, layer_types=layer_types, local_rope_theta=local_theta,
    )


def _rope_and_window(mt: str, d: dict, n_layers: int, get) -> tuple:
    """(rope scaling, theta, sliding layers' theta, layer types, sliding window) of a config dict,
    in either of transformers' layouts (rope_scaling + rope_theta, or rope_parameters)."""
    params = d.get("rope_parameters")
    if mt == "gemma3_text":
        params = params or {}
        full = params.get("full_attention") or dict(d.get("rope_scaling") or {}, rope_theta=get("rope_theta"))
        local = params.get("sliding_attention") or {"rope_theta": d.get("rope_local_base_freq", 10000.0)}
        if check_rope(mt, local, "rope_parameters.sliding_attention") is not None:
            raise _refuse(mt, "rope_parameters.sliding_attention.rope_type", local.get("rope_type"),
                          "sliding layers take plain RoPE")
        rope = check_rope(mt, full, "rope_parameters.full_attention")
        theta, local_theta = full.get("rope_theta", get("rope_theta")), float(local.get("rope_theta", 10000.0))
        types = d.get("layer_types") or [
            "sliding_attention" if (i + 1) % d.get("sliding_window_pattern", 6) else "full_attention"
            for i in range(n_layers)]
    else:
        rope_d = params if params is not None else d.get("rope_scaling")
        rope = check_rope(mt, rope_d, "rope_parameters" if params is not None else "rope_scaling")
        theta = d.get("rope_theta") or (params or {}).get("rope_theta") or get("rope_theta") or 10000.0
        local_theta = None
        types = d.get("layer_types")
        if mt in ("qwen2", "qwen3") and types is None:
            use, first = d.get("use_sliding_window", False), d.get("max_window_layers", 28)
            types = ["sliding_attention" if use and i >= first else "full_attention" for i in range(n_layers)]
        elif types is None:
            w = get("sliding_window")
            types = ["sliding_attention" if w is not None else "full_attention"] * n_layers
    if len(types) != n_layers:
        raise _refuse(mt, "layer_types", types, f"needs one entry per layer ({n_layers})")
    bad = sorted(set(types) - {"sliding_attention", "full_attention"})
    if bad:
        raise _refuse(mt, "layer_types", bad[0], "implemented: sliding_attention, full_attention")
    window = get("sliding_window")
    if "sliding_attention" in types and not window:
        raise _refuse(mt, "sliding_window", window, "sliding_attention layers need a window")
    short = tuple("sliding" if t == "sliding_attention" else "full" for t in types)
    if "sliding" not in short:
        return rope, theta, None, None, None
    # a window as long as the context never bites; the sliding layers may still have their own theta
    return rope, theta, local_theta, short, int(window) if window < get("max_position_embeddings") else None
