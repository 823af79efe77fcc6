"""The roofline's ceilings on hand-checked numbers (benchmarks/roofline.py)."""
from __future__ import annotations

import pytest

from batchserve.runner.models.llama import LlamaConfig
from benchmarks.roofline import Machine, decode_ceiling, linear_params, schedule_ceiling_seconds


def test_decode_ceiling_is_bytes_bound_at_batch_1_and_flops_bound_at_large_batch():
    cfg = LlamaConfig()  # SmolLM2-135M's shape
    mach = Machine({512: 400.0}, peak_gflops=400.0, bandwidth_gbs=50.0, threads=2)
    lin, head = linear_params(cfg), cfg.vocab_size * cfg.hidden_size
    kv_per_tok = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim  # K and V elements per cached token
    # batch 1: reading the fp32 weights and 128 tokens of fp32 K/V dominates
    want = 1 / ((4 * (lin + head) + 4 * 128 * kv_per_tok) / 50e9)
    assert decode_ceiling(cfg, mach, 1, 128) == pytest.approx(want)
    # bf16 decoder weights (LM head stays fp32) and bf16 K/V: fewer bytes, a higher ceiling
    want16 = 1 / ((2 * lin + 4 * head + 2 * 128 * kv_per_tok) / 50e9)
    assert decode_ceiling(cfg, mach, 1, 128, elem=2, w_elem=2) == pytest.approx(want16)
    # batch 256: arithmetic dominates
    flops = 2 * 256 * (lin + head) + 4 * 256 * 128 * cfg.num_layers * cfg.num_heads * cfg.head_dim
    assert decode_ceiling(cfg, mach, 256, 128) == pytest.approx(256 / (flops / 400e9))


def test_schedule_ceiling_sums_each_steps_ceiling():
    cfg = LlamaConfig()
    mach = Machine({512: 400.0}, peak_gflops=400.0, bandwidth_gbs=50.0, threads=2)
    # one step of 4 rows at contexts summing to 2,000 (mean 500), one of 64 at 128 each, an empty step
    steps = [(4, 2000), (64, 64 * 128), (0, 0)]
    want = 4 / decode_ceiling(cfg, mach, 4, 500) + 64 / decode_ceiling(cfg, mach, 64, 128)
    assert schedule_ceiling_seconds(cfg, mach, steps) == pytest.approx(want)
    # two equal steps cost twice one
    small = [(8, 8 * 300)] * 2
    assert schedule_ceiling_seconds(cfg, mach, small) == pytest.approx(2 * 8 / decode_ceiling(cfg, mach, 8, 300))
    # the arithmetic-bound step of 64 rows takes longer than the bytes at 64 rows alone would
    bytes_only = Machine({512: 1e9}, peak_gflops=1e9, bandwidth_gbs=50.0, threads=2)
    assert schedule_ceiling_seconds(cfg, mach, [(64, 64 * 128)]) > schedule_ceiling_seconds(cfg, bytes_only,
                                                                                          [(64, 64 * 128)])
    # stored weights (fewer bytes) lower the bytes-bound steps' time
    assert schedule_ceiling_seconds(cfg, mach, [(4, 2000)], weight_bytes=10**8) < schedule_ceiling_seconds(
        cfg, mach, [(4, 2000)])


@pytest.mark.kernel
def test_stored_weight_bytes_count_gguf_blocks_at_their_packed_size():
    """A model running from GGUF blocks reads its packed panels (Q4_1: 0.75 bytes a weight with the
    float32 scales; Q8_0: 1.125), so its batch-1 ceiling is the weights' own bytes, not 4 a weight."""
    import gguf
    import torch

    from batchserve.runner.kernels import gemm_ext
    from batchserve.runner.models.llama import LlamaModel
    from batchserve.runner.profiler import TINY_MODEL
    from benchmarks.roofline import stored_weight_bytes

    if gemm_ext() is None:
        pytest.skip("no C++ toolchain")
    from batchserve.config import ModelConfig
    from batchserve.runner.loader import load_model

    cfg = LlamaConfig.from_hf(TINY_MODEL)

    loaded = load_model(ModelConfig(model="dummy", dummy_config=TINY_MODEL))
    blocks = {}
    for name, w in loaded.weights.items():
        if w.dim() == 2 and w.shape[1] % 32 == 0:
            kind = "Q8_0" if "embed" in name or "lm_head" in name else "Q4_1"
            blocks[name] = ({"Q4_1": 0, "Q8_0": 1}[kind],
                            torch.from_numpy(gguf.quantize(w.numpy(), gguf.GGMLQuantizationType[kind])))
    dense = LlamaModel(cfg, loaded.weights, "cpp")
    quant = LlamaModel(cfg, loaded.weights, "cpp", quantized=blocks)
    assert quant.quantized_matrices == 4 * cfg.num_layers + 1
    lin, head = linear_params(cfg), cfg.vocab_size * cfg.hidden_size
    assert stored_weight_bytes(dense) == 4 * (lin + head)
    panels = lambda n: (n + 31) // 32 * 32  # noqa: E731  (rows padded to whole 32-column panels)
    shapes = [(cfg.hidden_size, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim),
              (cfg.num_heads * cfg.head_dim, cfg.hidden_size), (cfg.hidden_size, 2 * cfg.intermediate_size),
              (cfg.intermediate_size, cfg.hidden_size)]
    want = cfg.num_layers * sum(panels(o) * i * 0.75 for i, o in shapes) + panels(cfg.vocab_size) * cfg.hidden_size * 1.125
    assert stored_weight_bytes(quant) == want
    mach = Machine({512: 400.0}, peak_gflops=400.0, bandwidth_gbs=50.0, threads=2)
    kv = 16 * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    assert decode_ceiling(cfg, mach, 1, 16, weight_bytes=int(want)) == pytest.approx(50e9 / (want + kv))
