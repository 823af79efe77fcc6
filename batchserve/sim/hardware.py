"""Named GPU specs and model shapes for the roofline cost model.

GPU figures are the vendors' public spec-sheet numbers for the SXM parts: peak *dense* FP16/BF16
tensor-core FLOP/s (no 2:4 sparsity), HBM bandwidth and HBM size (decimal GB, as printed).
The efficiency factors say how much of each peak a serving engine reaches in practice; they are
assumptions, documented here so a user can change them, not measurements:

    eff_matmul   share of peak FLOP/s the big GEMMs reach (large M)            0.60
    eff_attn     share of peak FLOP/s the attention kernels reach             0.40
    eff_mem      share of peak bandwidth a weight or KV stream reaches        0.80
    step_overhead_s  fixed time per step (kernel launches, sampling, host)    2 ms

Model shapes are the published Hugging Face `config.json` values; any other Llama-family
config.json can be loaded with `ModelShape.from_hf`.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class GPUSpec:
    name: str
    peak_flops: float  # dense FP16/BF16 tensor-core FLOP/s
    mem_bw: float  # bytes/s
    mem_bytes: float  # bytes of HBM
    eff_matmul: float = 0.60
    eff_attn: float = 0.40
    eff_mem: float = 0.80
    step_overhead_s: float = 0.002
    mem_util: float = 0.90  # share of HBM the engine may use (weights + KV + workspace)
    workspace_bytes: float = 1.5e9  # activations, CUDA context, allocator slack


GPUS: dict[str, GPUSpec] = {
    # NVIDIA A100 datasheet: 312 TFLOPS FP16 dense; 1,555 GB/s (40GB) / 2,039 GB/s (80GB SXM)
    "a100-40gb": GPUSpec("A100-40GB SXM", 312e12, 1.555e12, 40e9),
    "a100-80gb": GPUSpec("A100-80GB SXM", 312e12, 2.039e12, 80e9),
    # NVIDIA H100 SXM datasheet: 989 TFLOPS FP16 dense (1,979 with sparsity); 3.35 TB/s; 80 GB
    "h100": GPUSpec("H100 SXM", 989e12, 3.35e12, 80e9),
    # NVIDIA H200 SXM datasheet: same compute as H100; 4.8 TB/s; 141 GB
    "h200": GPUSpec("H200 SXM", 989e12, 4.8e12, 141e9),
}


@dataclass(frozen=True)
class ModelShape:
    """What the roofline needs of a decoder: sizes only, no weights."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False

    @property
    def linear_params(self) -> int:
        """Weights every token passes through: per layer qkv, o, gate, up, down."""
        h, d = self.hidden_size, self.head_dim
        per_layer = h * (self.num_heads + 2 * self.num_kv_heads) * d + self.num_heads * d * h \
            + 3 * h * self.intermediate_size
        return self.num_layers * per_layer

    @property
    def head_params(self) -> int:
        """The LM head (vocab x hidden): run once per sampled token."""
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        emb = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        norms = (2 * self.num_layers + 1) * self.hidden_size
        return self.linear_params + emb + norms

    def kv_bytes_per_token(self, elem_bytes: int) -> int:
        """K and V, every layer, one token."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem_bytes

    @staticmethod
    def from_hf(d: dict, name: str = "config.json") -> "ModelShape":
        """From a Hugging Face config.json dict (Llama family field names)."""
        heads = d["num_attention_heads"]
        return ModelShape(
            name=name, vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_layers=d["num_hidden_layers"],
            num_heads=heads, num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)))


MODELS: dict[str, ModelShape] = {
    "smollm2-135m": ModelShape("SmolLM2-135M", 49152, 576, 1536, 30, 9, 3, 64, 8192, True),
    "llama-2-7b": ModelShape("Llama-2-7B", 32000, 4096, 11008, 32, 32, 32, 128, 4096),
    "llama-3-8b": ModelShape("Llama-3-8B", 128256, 4096, 14336, 32, 32, 8, 128, 8192),
    "llama-2-13b": ModelShape("Llama-2-13B", 32000, 5120, 13824, 40, 40, 40, 128, 4096),
}


def get_gpu(name: str) -> GPUSpec:
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise ValueError(f"hardware: unknown {name!r}; choose from {sorted(GPUS)}") from None


def get_model(name: str, max_model_len: int | None = None) -> ModelShape:
    """A named shape, a config.json path, or a directory holding one. `max_model_len`
    overrides the context length (e.g. a long-context variant of the same shape)."""
    key = name.lower()
    if key in MODELS:
        shape = MODELS[key]
    elif key.startswith("smollm2-135m"):
        shape = MODELS["smollm2-135m"]
    else:
        path = os.path.join(name, "config.json") if os.path.isdir(name) else name
        if not os.path.isfile(path):
            raise ValueError(f"model: unknown {name!r}; choose from {sorted(MODELS)} or give a config.json")
        with open(path) as fh:
            shape = ModelShape.from_hf(json.load(fh), os.path.basename(os.path.dirname(os.path.abspath(path))))
    return replace(shape, max_position_embeddings=max_model_len) if max_model_len else shape
