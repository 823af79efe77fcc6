"""This machine's limits, measured: fp32 matrix-product rate at the model's own shapes (the
fastest of the paths that run here at each row count: the C++ panel GEMM, oneDNN on packed
weights) and memory bandwidth, and the ceiling tokens/s they allow for prompt tokens and for
decode.

Ceiling for a step = max(FLOPs / peak matmul rate, bytes moved / bandwidth): the step can be
no faster than its arithmetic at the best rate this machine reaches, nor than reading its
weights and KV cache once.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from batchserve.runner.models.llama import (INT_MATMUL, Linear, LlamaConfig, cpp_bf16_ok, cpp_linear_ok,
                                            onednn_linear_ok)


def median_time(fn, reps: int) -> float:
    """Median wall time of `reps` calls, after one warm-up call."""
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    ts.sort()
    return ts[len(ts) // 2]


def layer_shapes(cfg: LlamaConfig) -> list[tuple[int, int]]:
    """(in, out) of the fused matrices of one layer: qkv, o, gate_up, down."""
    h, i, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    return [(h, (cfg.num_heads + 2 * cfg.num_kv_heads) * hd), (cfg.num_heads * hd, h), (h, 2 * i), (i, h)]


def linear_params(cfg: LlamaConfig) -> int:
    """Weights touched by matrix products per token, excluding the LM head."""
    return cfg.num_layers * sum(a * b for a, b in layer_shapes(cfg))


@dataclass
class Machine:
    matmul_gflops: dict[int, float]  # rows M -> GFLOP/s over the model's shapes (the best backend)
    peak_gflops: float
    bandwidth_gbs: float
    threads: int
    by_backend: dict[str, dict[int, float]] | None = None  # backend -> rows M -> GFLOP/s


def matmul_backends(dtype: torch.dtype) -> list[str]:
    """The matrix-product paths that run here for weights of `dtype` (F.linear when none does;
    int8 / int16: the C++ GEMM's integer dot products on GGUF blocks, or none)."""
    if dtype in INT_MATMUL:
        return [f"cpp-{str(dtype).split('.')[-1]}"] if cpp_linear_ok(torch.zeros(1)) else []
    cpp = cpp_bf16_ok() if dtype == torch.bfloat16 else cpp_linear_ok(torch.zeros(1, dtype=dtype))
    out = [b for b, ok in (("cpp", cpp), ("onednn", onednn_linear_ok(torch.zeros(1)))) if ok]
    return out or ["torch"]


def measure_machine(cfg: LlamaConfig, rows: tuple[int, ...] = (1, 8, 32, 64, 128, 512), reps: int = 5,
                    dtype: torch.dtype = torch.float32) -> Machine:
    """Matmul rate at the model's real shapes and footprint (every layer's four matrices,
    distinct tensors, so the weights stream from memory as in a real step) for M rows, on each
    backend that runs here, the best of them kept per M (the peak is the best overall); and
    memory bandwidth (a read of a buffer far larger than any cache). `dtype`: of the weights
    and activations (bfloat16: the rate the --matmul-dtype bfloat16 mode can reach; int8 / int16:
    that --matmul-dtype mode's, on random Q4_1 blocks, float32 activations quantized per call)."""
    shapes = layer_shapes(cfg)
    bits = INT_MATMUL.get(dtype, 0)
    integer = bits > 0  # GGUF blocks, float32 activations in
    dense = [] if integer else [[torch.randn(o, i).to(dtype) for i, o in shapes] for _ in range(cfg.num_layers)]
    by_backend: dict[str, dict[int, float]] = {}
    with torch.inference_mode():
        for backend in matmul_backends(dtype):
            weights = ([[Linear.from_blocks(random_q4_1(o, i), 0, act_bits=bits) for i, o in shapes]
                        for _ in range(cfg.num_layers)] if integer
                       else [[Linear(w, backend) for w in layer] for layer in dense])
            for m in rows:
                xs = [torch.randn(m, i).to(torch.float32 if integer else dtype) for i, _ in shapes]

                def run() -> None:
                    for layer in weights:
                        for x, lin in zip(xs, layer):
                            lin(x)

                t = median_time(run, reps)
                flops = cfg.num_layers * sum(2 * m * i * o for i, o in shapes)
                by_backend.setdefault(backend, {})[m] = flops / t / 1e9
            del weights
        rates = {m: max(r[m] for r in by_backend.values()) for m in rows}
        del dense
        big = torch.rand(128 * 2**20)  # 512 MiB of distinct pages (a constant fill could be page-merged)
        t = median_time(lambda: big.sum(), reps)
    bw = big.numel() * 4 / t / 1e9
    return Machine(rates, max(rates.values()), bw, torch.get_num_threads(), by_backend)


def random_q4_1(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Q4_1 blocks of an [n, k] matrix as a GGUF file stores them (uint8 [n, k / 32 * 20]):
    random quants, weight-sized fp16 scales and minimums (for timing: values don't matter, but
    no infinities or denormals)."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n, k // 32, 20), dtype=torch.uint8, generator=g)
    raw[:, :, 0:2] = torch.full((n, k // 32), 0.01, dtype=torch.float16).view(torch.uint8).view(n, k // 32, 2)
    raw[:, :, 2:4] = torch.full((n, k // 32), -0.08, dtype=torch.float16).view(torch.uint8).view(n, k // 32, 2)
    return raw.view(n, -1)


def decode_ceiling(cfg: LlamaConfig, mach: Machine, batch: int, ctx: int, elem: int = 4,
                   w_elem: int | None = None, weight_bytes: int | None = None) -> float:
    """Ceiling tokens/s for one decode step of `batch` sequences with `ctx` tokens of context.
    `elem`: bytes per KV element (and per weight); `w_elem`: bytes per decoder-layer weight when
    it differs (2 with bf16 matrix products; the LM head stays at `elem`); `weight_bytes`: all the
    weights a step reads, when the model stores them otherwise (GGUF blocks: stored_weight_bytes)."""
    head = cfg.vocab_size * cfg.hidden_size  # LM head runs for every decode
    lin = linear_params(cfg) + head
    flops = 2 * batch * lin + 4 * batch * ctx * cfg.num_layers * cfg.num_heads * cfg.head_dim
    kv_bytes = batch * ctx * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * elem
    w_bytes = weight_bytes if weight_bytes is not None else linear_params(cfg) * (w_elem or elem) + head * 4
    t = max(flops / (mach.peak_gflops * 1e9), (w_bytes + kv_bytes) / (mach.bandwidth_gbs * 1e9))
    return batch / t


def schedule_ceiling_seconds(cfg: LlamaConfig, mach: Machine, steps: list[tuple[int, int]], **kw) -> float:
    """The decode ceiling of a run's own schedule: for each step (rows that produced a token, the
    sum of their context lengths), the time `decode_ceiling` gives those rows at their mean
    context, summed. Unlike one ceiling at the run's mean batch and an assumed context, it follows
    the batch and the contexts step by step (a step of 64 rows is arithmetic-bound where one of 4
    is bytes-bound; long answers decode at long contexts). `kw`: decode_ceiling's byte options."""
    return sum(b / decode_ceiling(cfg, mach, b, ctx / b, **kw) for b, ctx in steps if b > 0)


def stored_weight_bytes(model) -> int:
    """Bytes of the matrices a decode step reads, as the model stores them (every layer's four
    and the LM head; GGUF blocks count at their packed size, scales included)."""
    def size(lin: Linear) -> int:
        return lin.w.nbytes if lin.fmt is not None else lin.n * lin.k * torch.empty(0, dtype=lin.w.dtype).element_size()

    return sum(size(layer[k]) for layer in model.layers for k in ("wqkv", "wo", "w_gate_up", "w_down")) + size(
        model.lm_head)


def prefill_ceiling(cfg: LlamaConfig, mach: Machine, prompt_len: int) -> float:
    """Ceiling prompt tokens/s for prompts of `prompt_len` (LM head once per prompt)."""
    per_tok = 2 * linear_params(cfg) + 2 * prompt_len * cfg.num_layers * cfg.num_heads * cfg.head_dim
    per_tok += 2 * cfg.vocab_size * cfg.hidden_size / prompt_len
    return mach.peak_gflops * 1e9 / per_tok
