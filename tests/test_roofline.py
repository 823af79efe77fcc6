"""The roofline's ceilings on hand-checked numbers (bench/roofline.py)."""
from __future__ import annotations

import pytest

from batchserve.bench.roofline import Machine, decode_ceiling, linear_params
from batchserve.runner.models.llama import LlamaConfig


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
