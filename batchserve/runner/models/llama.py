"""Llama-family decoder over a flat batch: Llama 2/3, SmolLM, Mistral, Qwen2/2.5 (QKV biases),
Qwen3 (q/k norms), Gemma 3 (GELU, (1 + w) norms on both sides of each block, scaled
embeddings, sliding-window layers), Phi-3; the switches are LlamaConfig's (models/config.py).

The forward takes every scheduled token of every request in one flat list (T tokens, each with
its own position) and the paged KV cache; no request is padded. QKV and gate/up are fused into
one matrix each at load time, so a layer is four matrix products.
"""
from __future__ import annotations

import logging
import math
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from batchserve.runner.attention import ALL_ROWS, AttnMeta, paged_attention
from batchserve.runner.models.config import LlamaConfig, UnsupportedModelError

__all__ = ["LlamaConfig", "LlamaModel", "UnsupportedModelError", "expected_weights", "rope_inv_freq"]

log = logging.getLogger(__name__)


def rope_inv_freq(cfg: LlamaConfig, local: bool = False) -> torch.Tensor:
    """Inverse frequencies [head_dim/2], with the config's theta, scaling and GGUF frequency
    factors; `local`: a sliding layer's (local_rope_theta, unscaled) where the config has one."""
    hd = cfg.head_dim
    if local and cfg.local_rope_theta is not None:
        return (1.0 / (cfg.local_rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))).float()
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    if cfg.rope_freq_factors is not None:
        inv = inv / torch.tensor(cfg.rope_freq_factors, dtype=torch.float64)
    rs = cfg.rope_scaling
    if not rs:
        return inv.float()
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "linear":
        return (inv / rs["factor"]).float()
    if kind == "llama3":
        factor, lo, hi = rs["factor"], rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
        old = rs.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled).float()
    raise UnsupportedModelError(f"rope_scaling: type {kind!r} is not supported (default, linear, llama3)")


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, w.shape, w, eps)
    xf = x.float()  # low-precision activations: normalise in fp32 as the reference does
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, hd]; cos, sin: [T, 1, hd/2]. Rotates (first half, second half) pairs."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def onednn_linear_ok(weight: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
    """Whether oneDNN's linear on a pre-packed weight runs here for `weight` (on the CPU, oneDNN
    built in) in `dtype` (None: the weight's own; float32, or bfloat16, which oneDNN runs only on
    a CPU with AVX512BW/VL/DQ or AVX-NE-CONVERT, not on an AVX2-only one such as AMD Zen 3)."""
    dtype = dtype or weight.dtype
    if weight.device.type != "cpu" or dtype not in _ONEDNN_OK or not torch.backends.mkldnn.is_available():
        return False
    if _ONEDNN_OK[dtype] is None:
        try:
            w, x = torch.randn(8, 16).to(dtype), torch.ones(2, 16).to(dtype)
            y = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w, None),
                                                   None, "none", [-1], "")
            _ONEDNN_OK[dtype] = bool(torch.allclose(y.float(), F.linear(x, w).float(), atol=1e-2))
        except (RuntimeError, AttributeError):  # a torch without these (private) ops, or a CPU it refuses
            _ONEDNN_OK[dtype] = False
    return bool(_ONEDNN_OK[dtype])


_ONEDNN_OK: dict[torch.dtype, bool | None] = {torch.float32: None, torch.bfloat16: None}  # probed once each


def cpp_linear_ok(weight: torch.Tensor) -> bool:
    """Whether the C++ panel GEMM (runner/csrc/gemm.cpp) builds here and suits `weight` (fp32, CPU)."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return False
    from batchserve.runner.kernels import gemm_ext

    return gemm_ext() is not None


def cpp_bf16_ok(cpu_isa: str = "auto") -> bool:
    """Whether the C++ GEMM's bf16 path runs here (AVX512-BF16): bf16 panels, fp32 sums and
    results, for the bf16 matrix-product mode over fp32 activations. It has no other code path,
    so a `cpu_isa` other than auto or avx512 rules it out."""
    from batchserve.runner.kernels import gemm_ext

    ext = gemm_ext()
    return ext is not None and cpu_isa in ("auto", "avx512") and bool(ext.has_bf16())


# ModelConfig.cpu_isa -> the C++ GEMM's isa_override (-1: the best this CPU has), slowest first
ISA_CODES = {"auto": -1, "portable": 0, "avx2": 1, "avx512": 2}


def cpu_isa_in_use(cpu_isa: str = "auto", integer: bool = False) -> str:
    """The code path the C++ matrix products take for the `cpu_isa` setting: avx512, avx2 or
    portable; `integer`: the integer products' (gemm_int), whose avx512 path needs AVX512-VNNI
    besides AVX-512 (a CPU with AVX-512 but no VNNI runs them on AVX2). "portable" where the
    module did not build. Raises ConfigError naming cpu_isa when this CPU cannot run the one asked."""
    from batchserve.config import ConfigError
    from batchserve.runner.kernels import gemm_ext

    if cpu_isa not in ISA_CODES:
        raise ConfigError(f"cpu_isa: must be one of {sorted(ISA_CODES)}, got {cpu_isa!r}")
    ext = gemm_ext()
    if ext is None:
        if cpu_isa != "auto":
            raise ConfigError(f"cpu_isa: {cpu_isa} forces a code path of the C++ GEMM, which did not build here")
        return "portable"
    return pick_cpu_isa(cpu_isa, str(ext.int_isa() if integer else ext.isa()), integer)


def pick_cpu_isa(cpu_isa: str, best: str, integer: bool = False) -> str:
    """The path `cpu_isa` takes on a CPU whose best is `best` (the C++ module's isa(), or its
    int_isa() for `integer` products): `best` for auto, else `cpu_isa` itself where the CPU has it
    (every path below its best it has too). ConfigError naming cpu_isa where it does not."""
    from batchserve.config import ConfigError

    if cpu_isa == "auto":
        return best
    if ISA_CODES[cpu_isa] > ISA_CODES[best]:
        what = "integer matrix products" if integer else "matrix products"
        raise ConfigError(f"cpu_isa: this CPU has no {cpu_isa} path for the C++ {what} (the best it has: "
                          f"{best}{'; avx512 there means AVX512-VNNI' if integer else ''})")
    return cpu_isa


def best_linear_backend(weight: torch.Tensor, cpu_isa: str = "auto") -> str:
    """What `auto` picks for `weight`: the C++ panel GEMM where it runs its AVX-512 path (measured
    faster than oneDNN at decode's few rows, on par for prefill; see BENCHMARKS.md, "Matrix-product
    variants at the model's shapes"), else oneDNN on packed weights where that runs, else
    F.linear. `cpu_isa` (avx2, portable) makes the choice an AVX2-only or a plain CPU would make,
    so a forced path is judged as that CPU would judge it."""
    if cpp_linear_ok(weight) and cpu_isa_in_use(cpu_isa) == "avx512":
        return "cpp"
    return "onednn" if onednn_linear_ok(weight) else "torch"


# GGUF sources the integer dot-product paths take (Q4_1, Q8_0, Q4_0, Q4_K: one scale per 32 k);
# Q6_K (a scale per 16) stays on the float32 block path in those modes.
INT_SOURCES = frozenset({0, 1, 2, 3})
INT_MATMUL = {torch.int8: 8, torch.int16: 16}  # matmul_dtype -> activation bits


def has_int_blocks(quantized: dict[str, tuple[int, torch.Tensor]] | None) -> bool:
    """Whether any of a model's GGUF blocks (LoadedModel.quantized) can run as integer products."""
    return any(src in INT_SOURCES for src, _ in (quantized or {}).values())


class Linear:
    """y = x W^T on one of three backends, the weight stored once in that backend's layout:
    `cpp`: the C++ panel GEMM on weights packed into 32-column panels (bf16 weights: bf16 panels,
    fp32 sums and a float32 result; GGUF blocks through `from_blocks`: Q4_1 / Q8_0 panels, Q4_0 and
    Q4_K regrouped into the Q4_1 ones, Q6_K into int8 panels with a scale per 16 k);
    `onednn`: oneDNN on its blocked layout; `torch`: F.linear on the dense weight."""

    __slots__ = ("w", "backend", "n", "k", "fmt", "act_bits", "isa", "fn", "gated_fn")

    @classmethod
    def from_blocks(cls, raw: torch.Tensor | None, src: int, act_bits: int = 0, isa: int = -1,
                    packed: torch.Tensor | None = None, n: int | None = None) -> "Linear":
        """From a GGUF file's blocks as stored (uint8 [N, row bytes]; `src` 0 = Q4_1, 1 = Q8_0,
        2 = Q4_0, 3 = Q4_K, 4 = Q6_K): the C++ GEMM expands them in registers, float32 math,
        products equal to the dequantized weights' bit for bit. `fmt` is the panel layout: 1 for
        Q8_0, 2 for Q6_K (int8 with a scale per 16 k), else 0 (Q4_1's).
        `act_bits` 8 or 16 (sources in INT_SOURCES): the activations are quantized to int8 / int16
        per 32 k and multiplied into the integer quants (AVX512-VNNI or AVX2 dot products; fmt 1 for
        Q8_0, else 0); 0: float32 activations. `isa`: the C++ code path (ISA_CODES), -1 the best.
        `packed`: what packing `raw` gave on an earlier start (runner/weight_cache.py), used as it
        is; then `raw` may be None and `n` gives the rows."""
        from batchserve.runner.kernels import gemm_ext

        ext = gemm_ext()
        if ext is None:
            raise RuntimeError("quantized weights: the C++ panel GEMM did not build here")
        lin = cls.__new__(cls)
        lin.backend, lin.n, lin.act_bits, lin.isa = "cpp", raw.shape[0] if n is None else n, act_bits, isa
        if act_bits:
            if src not in INT_SOURCES or act_bits not in (8, 16):
                raise ValueError(f"integer matrix products take GGUF sources {sorted(INT_SOURCES)} and 8- or 16-bit "
                                 f"activations, got source {src}, {act_bits} bits")
            fmt = 1 if src == 1 else 0
            lin.w = w = ext.pack_int(raw, src, act_bits) if packed is None else packed
            gemm_int, n = ext.gemm_int, lin.n
            lin.fn = lambda x: gemm_int(x, w, n, fmt, act_bits, isa)
            lin.gated_fn = lambda gu: gemm_int(gu, w, n, fmt, act_bits, isa, True)
        else:
            fmt = {1: 1, 4: 2}.get(src, 0)
            lin.w = w = ext.pack_q(raw, src) if packed is None else packed
            gemm_q, n = ext.gemm_q, lin.n
            lin.fn = lambda x: gemm_q(x, w, n, fmt, isa)
            lin.gated_fn = None
        lin.fmt = fmt
        lin.k = lin.w.shape[1] * 32
        return lin

    def __init__(self, weight: torch.Tensor, backend: str = "torch", isa: int = -1) -> None:
        """`isa`: the C++ GEMM's code path for float32 weights (ISA_CODES; -1 the best). bf16
        weights have the AVX512-BF16 path only."""
        if backend not in ("torch", "onednn", "cpp"):
            raise ValueError(f"unknown linear backend {backend!r}")
        self.backend = backend
        self.isa = isa
        self.fmt = None  # GGUF block format (from_blocks)
        self.act_bits = 0
        self.n, self.k = weight.shape
        # fn(x): the product for a contiguous 2-D x, bound straight to the C++ GEMM where it runs
        # (the fused decoder loop makes several such calls per layer each step; bound, each skips
        # __call__'s backend, shape and layout checks). gated_fn(gu):
        # the product of silu(gate) * up for gu = [gate | up], where the product takes both
        # halves (integer products); None where the caller runs silu_mul, then fn.
        self.gated_fn = None
        if backend == "cpp":
            from batchserve.runner.kernels import gemm_ext

            ext = gemm_ext()
            if ext is None:
                raise RuntimeError("linear backend cpp: the C++ panel GEMM did not build here")
            n = self.n
            if weight.dtype == torch.bfloat16:
                self.w = w = ext.pack_bf16(weight)
                gemm_bf16 = ext.gemm_bf16
                self.fn = lambda x: gemm_bf16(x, w, n)
            else:
                self.w = w = ext.pack(weight)
                gemm = ext.gemm
                self.fn = lambda x: gemm(x, w, n, isa)
        else:
            if backend == "onednn":
                self.w = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
            else:
                self.w = weight
            self.fn = self.__call__

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "cpp":
            if x.dim() != 2:
                return self(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], self.n)
            return self.fn(x if x.is_contiguous() else x.contiguous())
        if self.backend == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.w, None, "none", [-1], "")
        return F.linear(x, self.w)

    @property
    def takes_gate_up(self) -> bool:
        """Whether `gated` runs as one product (the integer one), not silu_mul then a product."""
        return self.gated_fn is not None

    def gated(self, gu: torch.Tensor) -> torch.Tensor:
        """(silu(gate) * up) W^T for gu = [gate | up] [T, 2K], the SiLU taken while the product
        quantizes its input (takes_gate_up): the bits of silu_mul then this product, without
        writing the [T, K] intermediate to memory and reading it back."""
        return self.gated_fn(gu if gu.is_contiguous() else gu.contiguous())

    @property
    def weight(self) -> torch.Tensor:
        """The dense [out, in] weight (unpacked on demand)."""
        if self.fmt is not None:
            from batchserve.runner.kernels import gemm_ext

            if self.act_bits:
                return gemm_ext().unpack_int(self.w, self.n, self.fmt, self.act_bits)
            return gemm_ext().unpack_q(self.w, self.n, self.fmt)
        if self.backend == "cpp" and self.w.dtype == torch.bfloat16:  # [panels, K/2, 32 x 2]
            p, k2 = self.w.shape[:2]
            return self.w.view(p, k2, 32, 2).permute(0, 2, 1, 3).reshape(p * 32, 2 * k2)[: self.n, : self.k]
        if self.backend == "cpp":
            return self.w.permute(0, 2, 1).reshape(-1, self.w.shape[1])[: self.n]
        return self.w.to_dense() if self.backend == "onednn" else self.w


PROMPT_MATRICES = ("wqkv", "wo", "w_gate_up", "w_down")  # a layer's products, prompt_layers' order


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


def _take(x: torch.Tensor, rows: slice | torch.Tensor) -> torch.Tensor:
    return x[rows] if isinstance(rows, slice) else x.index_select(0, rows)


def _put(y: torch.Tensor, rows: slice | torch.Tensor, v: torch.Tensor) -> None:
    if isinstance(rows, slice):
        y[rows] = v
    else:
        y.index_copy_(0, rows, v)


def _mm(lin: "Linear", x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """lin(x), with x cast to the weights' dtype and the result back (bf16 matmul mode), when set."""
    return lin(x) if dtype is None else lin(x.to(dtype)).to(x.dtype)


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig, weights: dict[str, torch.Tensor], linear_backend: str = "auto",
                 matmul_dtype: torch.dtype | None = None, fused: Any = None,
                 quantized: dict[str, tuple[int, torch.Tensor]] | None = None, cpu_isa: str = "auto",
                 packed: dict[str, torch.Tensor] | None = None, prompt_amx: bool = False) -> None:
        """`weights` uses Hugging Face names (model.layers.N.self_attn.q_proj.weight, ...).
        `linear_backend`: auto (best_linear_backend: the C++ panel GEMM on AVX-512, else oneDNN on
        packed weights where it runs, else torch), cpp, onednn, torch.
        `matmul_dtype`: the decoder layers' matrices in this dtype (bfloat16 with float32 weights:
        bf16 matrix products, everything else float32; the LM head stays in the weights' dtype).
        `fused`: the compiled fused-ops module (runner/kernels.py) for the per-layer elementwise
        work, or None for the PyTorch path; used only with float32 weights on the CPU.
        `quantized`: GGUF blocks of some of `weights` (LoadedModel.quantized). With the C++ GEMM,
        float32 weights and products, every matrix whose parts all have blocks of one format is
        multiplied from them (`self.quantized_matrices` counts them); the results are those of the
        dense weights.
        `matmul_dtype` torch.int8 or torch.int16 (float32 weights, needs `quantized`): the matrices
        whose blocks have one scale per 32 k (Q4_0/Q4_1/Q4_K/Q8_0) multiply activations quantized
        to int8 / int16 per 32 k into their integer quants (`self.int_matrices` counts them); the
        rest stays float32. Close to, not equal to, the float32 products (int16 much closer).
        `cpu_isa` (ModelConfig.cpu_isa): the code path of every C++ matrix product, float32 and
        integer alike: auto the best this CPU has, else avx512, avx2 or portable (ConfigError when
        the CPU lacks it), so one machine can run and check the slower paths; `linear_backend`
        auto then picks as a CPU whose best that path is would.
        `packed`: the matrices packed from `quantized` on an earlier start (weight_cache.load),
        used instead of packing again (and the embedding dequantized from its blocks, instead of
        dequantizing it again); `self.packed` holds all of these, by the same keys, for
        weight_cache.save.
        `prompt_amx`: each layer's four matrices also as bf16 AMX tiles (`prompt_layers`), which
        the rows of a step's AttnMeta.prompt_rows multiply by instead (the fused path only)."""
        super().__init__()
        self.cfg = cfg
        w = weights
        self.packed: dict[str, torch.Tensor] = {}
        emb = "dense:model.embed_tokens.weight"  # dequantized from its blocks: cached beside the packed matrices
        self.embed = packed[emb] if packed is not None and emb in packed else w["model.embed_tokens.weight"]  # [V, H]
        if quantized and "model.embed_tokens.weight" in quantized:
            self.packed[emb] = self.embed
        self.norm = w["model.norm.weight"]
        mm = matmul_dtype or self.embed.dtype
        act_bits = INT_MATMUL.get(mm, 0)
        if act_bits:
            what = f"matmul_dtype int{act_bits}"
            if self.embed.dtype != torch.float32 or self.embed.device.type != "cpu":
                raise ValueError(f"{what} needs float32 weights on the CPU")
            if not has_int_blocks(quantized):
                raise ValueError(f"{what} multiplies a GGUF file's Q4_0/Q4_1/Q4_K/Q8_0 blocks, and this model has "
                                 "none (a GGUF file with such tensors, quantized_weights auto)")
            if linear_backend not in ("auto", "cpp") or not cpp_linear_ok(self.embed):
                raise RuntimeError(f"{what} needs the C++ GEMM (linear_backend auto or cpp, and a C++ "
                                   "toolchain to build it)")
            if cpu_isa_in_use(cpu_isa, integer=True) == "portable":
                log.warning("%s: the integer products run in plain C++ here (no AVX2, or cpu_isa portable), "
                            "much slower than --matmul-dtype float32", what)
            linear_backend, mm = "cpp", torch.float32
        elif mm != self.embed.dtype and (self.embed.dtype != torch.float32 or mm != torch.bfloat16):
            raise ValueError(f"matmul_dtype {mm} with {self.embed.dtype} weights: only bfloat16 matrix products "
                             "over float32 weights (or int8 / int16 ones over a GGUF file's blocks) are supported")
        self.matmul_dtype = mm
        self.act_bits = act_bits  # integer products' activation bits (0: none)
        self.int_matrices = 0
        if linear_backend == "onednn" and not onednn_linear_ok(self.embed):
            raise RuntimeError("linear_backend=onednn: oneDNN linear is not available here (needs fp32 on a CPU "
                               "with torch's oneDNN)")
        if linear_backend == "cpp" and not cpp_linear_ok(self.embed):
            raise RuntimeError("linear_backend=cpp: the C++ panel GEMM is not available here (needs fp32 weights on "
                               "a CPU and a C++ toolchain to build it)")
        if cpu_isa != "auto":
            cpu_isa_in_use(cpu_isa)  # refused here when this CPU lacks it
        isa = ISA_CODES[cpu_isa]
        self.cpu_isa = cpu_isa
        self.linear_backend = (best_linear_backend(self.embed, cpu_isa) if linear_backend == "auto"
                               else linear_backend)
        fits = self.embed.dtype == torch.float32 and self.embed.device.type == "cpu"
        self.fused = fused if fits else None
        blocks = quantized if (quantized and self.linear_backend == "cpp" and mm == torch.float32
                               and self.embed.dtype == torch.float32 and self.embed.device.type == "cpu") else {}
        self.quantized_matrices = 0

        # Packing GGUF blocks into panels is single-threaded C++ that lets go of the GIL: the
        # matrices are packed on a few threads at once, each result taken once all are queued.
        packing = ThreadPoolExecutor(max(1, min(4, torch.get_num_threads()))) if blocks else None

        def lin(*names: str) -> Linear | Future:
            """The named matrices stacked by rows: from their GGUF blocks when all have them in one
            format (a Future of it), else dense in the matmul dtype."""
            fmts = {blocks[k][0] for k in names if k in blocks}
            if len(fmts) == 1 and all(k in blocks for k in names):
                self.quantized_matrices += 1
                src = fmts.pop()
                bits = act_bits if src in INT_SOURCES else 0
                self.int_matrices += bits > 0
                key = f"{src}:{bits}:" + "|".join(names)
                if packed is not None and key in packed:
                    rows = sum(blocks[k][1].shape[0] for k in names)
                    done = Linear.from_blocks(None, src, act_bits=bits, isa=isa, packed=packed[key], n=rows)
                    self.packed[key] = done.w
                    return done
                parts = [blocks[k][1] for k in names]

                def pack() -> Linear:
                    made = Linear.from_blocks(torch.cat(parts), src, act_bits=bits, isa=isa)
                    self.packed[key] = made.w
                    return made

                return packing.submit(pack)
            t = w[names[0]] if len(names) == 1 else torch.cat([w[k] for k in names])
            return Linear(t.to(mm), layer_backend, isa)

        head_name = ("model.embed_tokens.weight" if cfg.tie_word_embeddings or "lm_head.weight" not in w
                     else "lm_head.weight")
        # bf16 products (matmul_dtype): the C++ GEMM's bf16 path where the CPU has it, else oneDNN's
        # packed bf16 layout where oneDNN runs bf16 here, else F.linear (emulated, slower than
        # float32, on a CPU without bf16 instructions).
        layer_backend = self.linear_backend
        if mm != self.embed.dtype and self.linear_backend != "torch":
            if self.linear_backend == "cpp" and cpp_bf16_ok(cpu_isa):
                layer_backend = "cpp"
            else:
                layer_backend = "onednn" if onednn_linear_ok(self.embed, mm) else "torch"
            if layer_backend == "torch" and self.embed.device.type == "cpu":
                log.warning("matmul_dtype %s: this CPU lacks the instructions of oneDNN's and the C++ GEMM's "
                            "bf16 products, so they run emulated in F.linear, slower than float32", mm)
        self.lm_head = lin(head_name) if head_name in blocks else Linear(w[head_name], self.linear_backend, isa)
        self.layers: list[dict[str, Any]] = []
        one = 1.0 if cfg.norm_plus_one else 0.0

        def norm(name: str) -> torch.Tensor:
            return w[name] + one if one else w[name]  # Gemma scales by (1 + weight)

        def bias(*names: str) -> torch.Tensor | None:
            return torch.cat([w[k] for k in names]) if all(k in w for k in names) else None

        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            m = p + "mlp."
            layer = {
                "attn_norm": norm(p + "input_layernorm.weight"),
                "wqkv": lin(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
                "wo": lin(a + "o_proj.weight"),
                "mlp_norm": norm(p + ("pre_feedforward_layernorm.weight" if cfg.sandwich_norm
                                      else "post_attention_layernorm.weight")),
                "w_gate_up": lin(m + "gate_proj.weight", m + "up_proj.weight"),
                "w_down": lin(m + "down_proj.weight"),
                "bqkv": bias(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias") if cfg.qkv_bias else None,
                "bo": w[a + "o_proj.bias"] if cfg.o_bias else None,
                "b_gate_up": bias(m + "gate_proj.bias", m + "up_proj.bias") if cfg.mlp_bias else None,
                "b_down": w[m + "down_proj.bias"] if cfg.mlp_bias else None,
                "q_norm": norm(a + "q_norm.weight") if cfg.qk_norm else None,
                "k_norm": norm(a + "k_norm.weight") if cfg.qk_norm else None,
                "post_attn_norm": norm(p + "post_attention_layernorm.weight") if cfg.sandwich_norm else None,
                "post_mlp_norm": norm(p + "post_feedforward_layernorm.weight") if cfg.sandwich_norm else None,
                "window": cfg.layer_window(i),
                "local": cfg.layer_types is not None and cfg.layer_types[i] == "sliding",
            }
            self.layers.append(layer)
        if packing is not None:
            with packing:
                if isinstance(self.lm_head, Future):
                    self.lm_head = self.lm_head.result()
                for layer in self.layers:
                    for key, value in layer.items():
                        if isinstance(value, Future):
                            layer[key] = value.result()
        if one:
            self.norm = self.norm + one
        self.inv_freq = rope_inv_freq(cfg).to(self.embed.device)
        self.local_inv_freq = rope_inv_freq(cfg, local=True).to(self.embed.device)
        self.has_local_rope = cfg.local_rope_theta is not None
        if not cfg.is_plain_llama:
            self.fused = None  # the fused loop computes plain Llama layers only
        self.prompt_layers = None
        self._prompt_all: list[tuple] | None = None  # _prompt_bound for steps of prompt rows only
        if prompt_amx:
            if self.fused is None or mm != torch.float32:
                raise ValueError("prompt products on AMX tiles need the fused C++ layer path with float32 or integer "
                                 "matrix products (a float32 Llama-family model on the CPU)")
            self.prompt_layers = self._pack_prompt_layers(packed)
        self.attn_scale = cfg.attn_scale if cfg.attn_scale is not None else cfg.head_dim ** -0.5
        self.embed_scale = (None if cfg.embed_scale is None
                            else torch.tensor(cfg.embed_scale, dtype=torch.float32).to(self.embed.dtype))
        # called after each layer of a forward pass when set; it may run whole forward passes of
        # its own (other rows, other blocks) before this one goes on (ModelRunner.between_layers)
        self.between_layers: Callable[[], Any] | None = None

    def _pack_prompt_layers(self, cached: dict[str, torch.Tensor] | None) -> list[tuple]:
        """Per layer, the QKV, O, gate/up and down products on bf16 AMX tiles (gemm_amx), packed
        from the dense weights (or taken from `cached`, kept in `self.packed` by the same keys).
        A prompt's rows share every weight, so they pay for its bf16 bytes many times over, where
        a decode row reads a quantized block for itself: prompts get the tiles, decodes the blocks."""
        from batchserve.runner.kernels import gemm_ext

        ext = gemm_ext()

        def product(i: int, name: str) -> Any:
            lin, swiglu = self.layers[i][name], name == "w_gate_up"
            key = f"amx{'-pairs' if swiglu else ''}:{i}:{name}"
            if cached is not None and key in cached:
                wp = cached[key]
            else:
                w = lin.weight.float()
                if swiglu:  # gate and up rows in pairs of 16: each tile pair holds the two halves of 16 outputs
                    w = w.view(2, -1, 16, w.shape[1]).transpose(0, 1)
                wp = ext.pack_amx(w.reshape(lin.n, -1).contiguous())
            self.packed[key] = wp
            gemm, n = ext.gemm_amx, lin.n
            return lambda x: gemm(x, wp, n, swiglu)  # gate/up: bf16 silu(gate) * up, what down takes

        return [tuple(product(i, name) for name in PROMPT_MATRICES) for i in range(len(self.layers))]

    def rope(self, positions: torch.Tensor, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self.local_inv_freq if local else self.inv_freq
        f = positions.float()[:, None] * inv[None, :]  # [T, hd/2]
        dt = self.embed.dtype
        return f.cos()[:, None, :].to(dt), f.sin()[:, None, :].to(dt)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMeta,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """input_ids, positions: [T]. Returns final hidden states [T, H] (normed)."""
        if self.fused is not None:
            return self._forward_fused(input_ids, positions, meta, kv_caches)
        cfg = self.cfg
        mm = self.matmul_dtype if self.matmul_dtype != self.embed.dtype else None
        nq, nkv, hd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim
        eps = cfg.rms_norm_eps
        ropes = {False: self.rope(positions)}
        if self.has_local_rope:
            ropes[True] = self.rope(positions, local=True)
        act = (lambda g: F.gelu(g, approximate="tanh")) if cfg.hidden_act == "gelu_tanh" else F.silu
        pause = self.between_layers
        x = F.embedding(input_ids, self.embed)  # [T, H]
        if self.embed_scale is not None:
            x = x * self.embed_scale
        T = x.shape[0]
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            cos, sin = ropes[layer["local"] and self.has_local_rope]
            h = rms_norm(x, layer["attn_norm"], eps)
            qkv = _mm(layer["wqkv"], h, mm)  # [T, nq + 2 nkv]
            if layer["bqkv"] is not None:
                qkv = qkv + layer["bqkv"]
            q = qkv[:, :nq].view(T, cfg.num_heads, hd)
            k = qkv[:, nq:nq + nkv].view(T, cfg.num_kv_heads, hd)
            if layer["q_norm"] is not None:  # per head, over head_dim
                q, k = rms_norm(q, layer["q_norm"], eps), rms_norm(k, layer["k_norm"], eps)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            v = qkv[:, nq + nkv:].view(T, cfg.num_kv_heads, hd)
            o = paged_attention(q, k, v, k_cache, v_cache, meta, scale=self.attn_scale,
                                window=layer["window"])  # [T, n_h, hd]
            o = _mm(layer["wo"], o.reshape(T, nq), mm)
            if layer["bo"] is not None:
                o = o + layer["bo"]
            if layer["post_attn_norm"] is not None:
                o = rms_norm(o, layer["post_attn_norm"], eps)
            x = x + o
            h = rms_norm(x, layer["mlp_norm"], eps)
            gu = _mm(layer["w_gate_up"], h, mm)
            if layer["b_gate_up"] is not None:
                gu = gu + layer["b_gate_up"]
            gate, up = gu.chunk(2, dim=-1)  # [T, I] each
            o = _mm(layer["w_down"], act(gate) * up, mm)
            if layer["b_down"] is not None:
                o = o + layer["b_down"]
            if layer["post_mlp_norm"] is not None:
                o = rms_norm(o, layer["post_mlp_norm"], eps)
            x = x + o
            if pause is not None:
                pause()
        return rms_norm(x, self.norm, eps)

    def _forward_fused(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMeta,
                       kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The same computation with the elementwise work in the C++ fused ops: per layer,
        add+norm, QKV, RoPE+cache write, attention, O, add+norm, gate/up, SiLU*up, down. The
        residual stream x is float32 and updated in place; with bf16 matrix products the norms
        and SiLU*up emit bf16 directly and the products' bf16 outputs are read as they are."""
        cfg, ext = self.cfg, self.fused
        nh, nkv, eps = cfg.num_heads, cfg.num_kv_heads, cfg.rms_norm_eps
        bf = self.matmul_dtype == torch.bfloat16
        x = F.embedding(input_ids, self.embed)  # [T, H], a fresh tensor: safe to update in place
        T = x.shape[0]
        cos, sin = (t.view(T, -1) for t in self.rope(positions))  # [T, hd/2]
        scale = self.attn_scale
        norm, rope_store, silu_mul, slots = ext.add_rms_norm, ext.rope_store, ext.silu_mul, meta.slot_mapping
        if meta.decode_only:  # straight to the decode kernel (paged_attention would make the same call)
            decode, tables, lens, bsz = meta.kernel.paged_decode, meta.dec_tables, meta.dec_lens, meta.block_size
        mm = self.matmul_dtype
        delta = None
        pause = self.between_layers
        layers = self._fused_layers()
        if meta.prompt_rows is not None and self.prompt_layers is not None:
            layers = self._prompt_bound(layers, meta.prompt_rows)
        # This loop runs 30 times a step; everything it calls is bound beforehand (_fused_layers).
        for (attn_norm, qkv_fn, o_fn, mlp_norm, gate_up_fn, down_fn, gated_fn), (k_cache, v_cache) in zip(
                layers, kv_caches):
            h = norm(x, delta, attn_norm, eps, bf)
            qkv = rope_store(qkv_fn(h), cos, sin, slots, k_cache, v_cache, nh, nkv, meta.decode_only)
            if meta.decode_only:
                o = decode(qkv[:, :nh], k_cache, v_cache, tables, lens, bsz, scale)
            else:
                o = paged_attention(qkv[:, :nh], qkv[:, nh:nh + nkv], qkv[:, nh + nkv:], k_cache, v_cache, meta,
                                    stored=True, scale=scale)
            o = o.view(T, -1)
            delta = o_fn(o if o.dtype == mm else o.to(mm))
            h = norm(x, delta, mlp_norm, eps, bf)
            gu = gate_up_fn(h)
            delta = gated_fn(gu) if gated_fn is not None else down_fn(silu_mul(gu))
            if pause is not None:
                pause()
        return ext.add_rms_norm(x, delta, self.norm, eps, False)

    def _fused_layers(self) -> list[tuple]:
        """Per layer, what the fused loop calls: the norms' weights and each product's `fn`."""
        if getattr(self, "_bound", None) is None:
            self._bound = [(ly["attn_norm"], ly["wqkv"].fn, ly["wo"].fn, ly["mlp_norm"], ly["w_gate_up"].fn,
                            ly["w_down"].fn, ly["w_down"].gated_fn) for ly in self.layers]
        return self._bound

    def _prompt_bound(self, bound: list[tuple], rows: Any) -> list[tuple]:
        """_fused_layers with each product on the prompt tiles for `rows` (AttnMeta.prompt_rows)
        and as before for the other rows. The prompt tiles' gate/up product gives silu(gate) * up
        (bf16), which their down product takes in the loop's gated slot; in a step of both kinds of
        rows the MLP is split as a whole (the gate/up slot passing its input on)."""
        if rows is ALL_ROWS:  # the same every such step: bound once
            if self._prompt_all is None:
                self._prompt_all = [(an, q, o, mn, gu, None, d)
                                    for (an, _, _, mn, _, _, _), (q, o, gu, d) in zip(bound, self.prompt_layers)]
            return self._prompt_all
        mine, rest = rows
        silu_mul = self.fused.silu_mul

        def split(fn: Any, pfn: Any) -> Any:
            def run(x: torch.Tensor) -> torch.Tensor:
                b = pfn(_take(x, mine))
                y = torch.empty(x.shape[0], b.shape[1], dtype=b.dtype)
                _put(y, mine, b)
                _put(y, rest, fn(_take(x, rest)))
                return y
            return run

        def mlp(gu: Any, d: Any, gd: Any, pgu: Any, pd: Any) -> Any:
            return split(lambda h: gd(gu(h)) if gd is not None else d(silu_mul(gu(h))), lambda h: pd(pgu(h)))

        return [(an, split(q, pq), split(o, po), mn, _same, None, mlp(gu, d, gd, pgu, pd))
                for (an, q, o, mn, gu, d, gd), (pq, po, pgu, pd) in zip(bound, self.prompt_layers)]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [S, H] -> [S, V] in float32."""
        return self.lm_head(hidden.contiguous()).float()


def expected_weights(cfg: LlamaConfig) -> set[str]:
    """The tensor names (Hugging Face's) a checkpoint of `cfg` must hold, no more and no fewer:
    a missing one would leave part of the model undefined, an extra one (a bias the config does
    not declare) would be ignored and the answers wrong."""
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not cfg.tie_word_embeddings:
        names.add("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight",
                  a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight", a + "o_proj.weight",
                  m + "gate_proj.weight", m + "up_proj.weight", m + "down_proj.weight"}
        if cfg.qkv_bias:
            names |= {a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"}
        if cfg.o_bias:
            names.add(a + "o_proj.bias")
        if cfg.mlp_bias:
            names |= {m + "gate_proj.bias", m + "up_proj.bias", m + "down_proj.bias"}
        if cfg.qk_norm:
            names |= {a + "q_norm.weight", a + "k_norm.weight"}
        if cfg.sandwich_norm:
            names |= {p + "pre_feedforward_layernorm.weight", p + "post_feedforward_layernorm.weight"}
    return names
