"""GGUF block-quantized weights (Q4_1, Q8_0) multiplied by the C++ GEMM straight from their blocks."""
from __future__ import annotations

import copy

import gguf
import numpy as np
import pytest
import torch

from batchserve.config import CacheConfig, ConfigError, ModelConfig
from batchserve.core.batch import ScheduledBatch, ScheduledSeq
from batchserve.core.kv_cache import KVCacheManager
from batchserve.request import SamplingParams
from batchserve.runner.kernels import gemm_ext
from batchserve.runner.loader import load_model
from batchserve.runner.model_runner import ModelRunner
from batchserve.runner.models.llama import Linear

pytestmark = [pytest.mark.kernel, pytest.mark.skipif("gemm_ext() is None", reason="no C++ toolchain")]
FORMATS = {"Q4_1": 0, "Q8_0": 1, "Q4_0": 2, "Q4_K": 3, "Q6_K": 4}  # pack_q's source codes
PANEL = {"Q4_1": 0, "Q8_0": 1, "Q4_0": 0, "Q4_K": 0, "Q6_K": 2}  # gemm_q's panel layouts
SUPER = ("Q4_K", "Q6_K")  # 256-weight super-blocks
ISAS = ["portable", "avx2", "avx512"]


def _blocks(n: int, k: int, kind: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw blocks [n, row bytes], gguf's own dequantization of them). Q4_1, Q8_0, Q4_0: random
    weights through gguf's quantizer. Q4_K, Q6_K (gguf has no quantizer for them): random
    super-blocks of 256 — any scales, minimums and quants, fp16 d (and dmin) of weight-like size."""
    rng = np.random.default_rng(seed)
    qt = gguf.GGMLQuantizationType[kind]
    if kind == "Q4_K":
        nb = k // 256
        raw = rng.integers(0, 256, (n, nb, 144), dtype=np.uint8)
        raw[:, :, 0:2] = (rng.standard_normal((n, nb)) * 0.01).astype(np.float16).view(np.uint8).reshape(n, nb, 2)
        raw[:, :, 2:4] = (abs(rng.standard_normal((n, nb))) * 0.01).astype(np.float16).view(np.uint8).reshape(n, nb, 2)
        raw = raw.reshape(n, nb * 144)
    elif kind == "Q6_K":
        nb = k // 256
        raw = rng.integers(0, 256, (n, nb, 210), dtype=np.uint8)
        raw[:, :, 208:210] = (rng.standard_normal((n, nb)) * 0.001).astype(np.float16).view(np.uint8).reshape(n, nb, 2)
        raw = raw.reshape(n, nb * 210)
    else:
        raw = gguf.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.1, qt)
    return torch.from_numpy(raw), torch.from_numpy(gguf.dequantize(raw, qt).astype(np.float32))


@pytest.mark.parametrize("kind", FORMATS)
def test_blocks_unpack_to_ggufs_own_dequantization(kind):
    """Every supported GGUF type lands in the panels as exactly the floats gguf dequantizes to
    (Q4_0 and Q4_K regrouped into the Q4_1 panel layout with a per-32 scale and minimum, Q6_K
    into int8 panels with a scale per 16)."""
    ext = gemm_ext()
    shapes = ((40, 256), (96, 512), (1, 256)) if kind in SUPER else ((40, 64), (96, 576), (1, 32))
    for n, k in shapes:
        raw, dense = _blocks(n, k, kind)
        wq = ext.pack_q(raw, FORMATS[kind])
        assert wq.shape[:2] == ((n + 31) // 32, k // 32)
        assert torch.equal(ext.unpack_q(wq, n, PANEL[kind]), dense)


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("isa", ISAS)
def test_block_gemm_equals_the_dense_gemm_bit_for_bit(kind, isa):
    """On every code path, with the fused tiles (registers) and with the per-panel scratch, at row
    counts that hit every tile size, a partial last panel, more rows than one 512-row pass and
    none at all: the same bits as the float32 panel GEMM on the dequantized weights (the weights
    each FMA sees are equal, and so is the order of the sums), and float64-close."""
    ext = gemm_ext()
    if ISAS.index(isa) > ISAS.index(ext.isa()):
        pytest.skip(f"this CPU has no {isa}")
    g = torch.Generator().manual_seed(1)
    for n, k in ((70, 256), (960, 512)) if kind in SUPER else ((70, 96), (960, 576)):
        raw, dense = _blocks(n, k, kind, seed=n)
        wq, wp = ext.pack_q(raw, FORMATS[kind]), ext.pack(dense)
        for m in (1, 5, 12, 13, 32, 37, 600, 0):
            if m == 600 and n == 960:
                continue  # the long pass once is enough
            x = torch.randn(m, k, generator=g)
            want = ext.gemm(x, wp, n, ISAS.index(isa))
            for fused_rows in (-1, 0, 10**6):
                got = ext.gemm_q(x, wq, n, PANEL[kind], ISAS.index(isa), fused_rows)
                assert got.shape == (m, n)
                assert torch.equal(got, want), (n, k, m, fused_rows)
            torch.testing.assert_close(want, (x.double() @ dense.double().t()).float(), rtol=1e-5,
                                       atol=1e-4 * k ** 0.5)


def test_block_gemm_rejects_bad_input():
    ext = gemm_ext()
    raw, _ = _blocks(40, 64, "Q4_1")
    wq = ext.pack_q(raw, 0)
    with pytest.raises(RuntimeError, match="K=96"):
        ext.gemm_q(torch.randn(2, 96), wq, 40, 0)
    with pytest.raises(RuntimeError, match="n=70"):
        ext.gemm_q(torch.randn(2, 64), wq, 70, 0)
    with pytest.raises(RuntimeError, match="1152"):
        ext.gemm_q(torch.randn(2, 64), wq, 40, 1)  # Q4_1 panels read as Q8_0: wrong block size
    with pytest.raises(RuntimeError, match="format"):
        ext.pack_q(raw, 7)
    with pytest.raises(RuntimeError, match="K/256"):
        ext.pack_q(raw, 3)  # 40 rows of 40 bytes are not whole 144-byte Q4_K super-blocks
    with pytest.raises(RuntimeError, match="raw blocks"):
        ext.pack_q(raw[:, :30], 0)  # not a whole number of 20-byte blocks
    with pytest.raises(ConfigError, match="quantized_weights"):
        ModelConfig(quantized_weights="int4")


def test_linear_from_blocks_flattens_leading_dims_and_gives_the_dense_weight_back():
    raw, dense = _blocks(48, 64, "Q8_0")
    lin = Linear.from_blocks(raw, 1)
    assert (lin.n, lin.k, lin.backend) == (48, 64, "cpp")
    assert torch.equal(lin.weight, dense)
    x = torch.randn(2, 3, 64)
    assert torch.equal(lin(x), Linear(dense, "cpp")(x))


@pytest.fixture(scope="module")
def smollm2():
    return load_model(ModelConfig())


@pytest.mark.model
def test_the_default_gguf_model_runs_from_its_blocks_with_the_dense_models_results(smollm2):
    """SmolLM2's GGUF: every layer matrix is Q4_1 and the tied embedding Q8_0. The runner keeps
    them as blocks (121 matrices: 4 per layer and the LM head), the q/k rows in Hugging Face
    order like the dense weights, and with float32 products a prefill plus decode steps give the
    logits of the dequantized model exactly."""
    assert {f for f, _ in smollm2.quantized.values()} == {0, 1}
    runners = {qw: ModelRunner(copy.copy(smollm2), ModelConfig(quantized_weights=qw, matmul_dtype="float32"),
                               CacheConfig(kv_cache_gb=0.05)) for qw in ("auto", "off")}
    q, dense = runners["auto"].model, runners["off"].model
    if q.linear_backend != "cpp":
        pytest.skip("the C++ GEMM is not the linear backend here")
    assert q.quantized_matrices == 4 * smollm2.config.num_layers + 1 and dense.quantized_matrices == 0
    assert q.layers[3]["wqkv"].fmt == 0 and q.lm_head.fmt == 1
    for key in ("wqkv", "wo", "w_gate_up", "w_down"):
        assert torch.equal(q.layers[3][key].weight, dense.layers[3][key].weight), key
    greedy = SamplingParams(temperature=0.0)
    logits = {}
    for qw, runner in runners.items():
        kv = KVCacheManager(runner.num_blocks, runner.block_size)
        prompts = [list(range(300, 300 + n)) for n in (40, 7, 19)]
        for i, p in enumerate(prompts):
            kv.allocate(f"r{i}", len(p) + 3)
        steps = [ScheduledBatch([ScheduledSeq(f"r{i}", p, 0, kv.block_table(f"r{i}"), True, greedy, 0)
                                 for i, p in enumerate(prompts)])]
        for t in range(3):
            steps.append(ScheduledBatch([ScheduledSeq(f"r{i}", [500 + t], len(p) + t, kv.block_table(f"r{i}"), True,
                                                      greedy, 0) for i, p in enumerate(prompts)]))
        logits[qw] = [runner.compute_logits(b) for b in steps]
    for a, b in zip(logits["auto"], logits["off"]):
        assert torch.equal(a, b)


def test_the_cli_flag_reaches_the_config():
    from batchserve.cli import build_parser, engine_config

    for argv, want in ((["serve"], "auto"), (["serve", "--quantized-weights", "off"], "off"),
                       (["generate", "--quantized-weights", "off", "hi"], "off")):
        assert engine_config(build_parser().parse_args(argv)).model.quantized_weights == want
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--quantized-weights", "int4"])
