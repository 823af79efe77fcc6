"""The C++ fused layer ops against their PyTorch definitions, and the model's fused forward
(and its bf16-matmul mode) against the pure PyTorch path, on a mixed prefill/decode batch."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from batchserve.config import CacheConfig, ConfigError, ModelConfig
from batchserve.core.batch import ScheduledBatch, ScheduledSeq
from batchserve.core.kv_cache import KVCacheManager
from batchserve.request import SamplingParams
from batchserve.runner.attention import gather_slots
from batchserve.runner.kernels import fused_ops_ext, paged_attention_ext
from batchserve.runner.loader import load_model
from batchserve.runner.model_runner import ModelRunner
from batchserve.runner.models.llama import apply_rope
from batchserve.runner.profiler import TINY_MODEL

pytestmark = pytest.mark.kernel

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def ext():
    mod = fused_ops_ext()
    if mod is None:
        pytest.skip("C++ toolchain not available here")
    return mod


@pytest.mark.parametrize("rows", [1, 5, 300])  # 300 rows: split across threads
def test_add_rms_norm(ext, rows):
    torch.manual_seed(rows)
    h = 96
    x, d, w = torch.randn(rows, h), torch.randn(rows, h), torch.randn(h)
    want_x = x + d
    want = F.rms_norm(want_x, (h,), w, 1e-5)
    x1 = x.clone()
    got = ext.add_rms_norm(x1, d, w, 1e-5, False)
    torch.testing.assert_close(x1, want_x)  # the residual stream is updated in place
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    x2 = x.clone()
    got_bf = ext.add_rms_norm(x2, d.bfloat16(), w, 1e-5, True)  # bf16 in (a bf16 product) and out
    assert got_bf.dtype == torch.bfloat16
    want_bf = F.rms_norm(x + d.bfloat16().float(), (h,), w, 1e-5)
    torch.testing.assert_close(got_bf.float(), want_bf, rtol=1e-2, atol=1e-2)
    x3 = x.clone()
    torch.testing.assert_close(ext.add_rms_norm(x3, None, w, 1e-5, False), F.rms_norm(x, (h,), w, 1e-5),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x3, x)  # no delta: x untouched


@pytest.mark.parametrize("dtype,cache_dtype,stream", [(torch.float32, torch.float32, False),
                                                      (torch.bfloat16, torch.float32, False),
                                                      (torch.float32, torch.float16, True)])
def test_rope_store_rotates_and_writes_the_cache(ext, dtype, cache_dtype, stream):
    """RoPE on q and k, and K/V rows written where the cache layout puts a slot's kv heads
    ([blocks, nkv, block_size, hd]: slot s at block s // 8, offset s % 8), also with the
    non-temporal stores of a decode step (`stream`)."""
    torch.manual_seed(1)
    T, nh, nkv, hd, bs = 7, 6, 2, 32, 8
    qkv = torch.randn(T, (nh + 2 * nkv) * hd).to(dtype)
    ang = torch.rand(T, hd // 2) * 6
    cos, sin = ang.cos(), ang.sin()
    slots = torch.tensor([40, 3, 17, 0, 63, 8, 22])
    kc, vc = torch.zeros(8, nkv, bs, hd, dtype=cache_dtype), torch.zeros(8, nkv, bs, hd, dtype=cache_dtype)
    out = ext.rope_store(qkv, cos, sin, slots, kc, vc, nh, nkv, stream)
    x = qkv.float().view(T, nh + 2 * nkv, hd)
    q = apply_rope(x[:, :nh], cos[:, None], sin[:, None])
    k = apply_rope(x[:, nh:nh + nkv], cos[:, None], sin[:, None])
    v = x[:, nh + nkv:]
    torch.testing.assert_close(out, torch.cat([q, k, v], 1), rtol=1e-5, atol=1e-5)
    tol = dict(rtol=1e-3, atol=1e-3) if cache_dtype == torch.float16 else dict(rtol=1e-5, atol=1e-5)
    blk, off = slots // bs, slots % bs
    for h in range(nkv):
        torch.testing.assert_close(kc[blk, h, off].float(), k[:, h], **tol)
        torch.testing.assert_close(vc[blk, h, off].float(), v[:, h], **tol)
    torch.testing.assert_close(gather_slots(kc, slots).float(), k, **tol)  # the PyTorch path reads the same
    others = torch.ones(8, bs, dtype=torch.bool)
    others[blk, off] = False
    assert not kc.permute(0, 2, 1, 3)[others].any() and not vc.permute(0, 2, 1, 3)[others].any()
    with pytest.raises(RuntimeError, match="slot out of range"):
        ext.rope_store(qkv, cos, sin, torch.tensor([0, 1, 2, 3, 4, 5, 64]), kc, vc, nh, nkv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul(ext, dtype):
    torch.manual_seed(2)
    gu = torch.randn(33, 2 * 80) * 4
    gu[0, :4] = torch.tensor([0.0, 100.0, -100.0, -1e4])  # saturating sigmoid on both sides
    gu = gu.to(dtype)
    got = ext.silu_mul(gu)
    g, u = gu.float().chunk(2, dim=-1)
    want = F.silu(g) * u
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def _runner(loaded, kv_cache_dtype: str = "float32", **kw) -> ModelRunner:
    return ModelRunner(copy.copy(loaded), ModelConfig(model="dummy", dummy_config=TINY_MODEL, **kw),
                       CacheConfig(block_size=4, num_blocks=64, kv_cache_dtype=kv_cache_dtype))


def _three_steps(runner: ModelRunner) -> list[torch.Tensor]:
    """A prompt chunk beside a short prompt; then a decode beside the chunk's rest; then two decodes."""
    kv = KVCacheManager(runner.num_blocks, runner.block_size)
    kv.allocate("a", 23)
    kv.allocate("b", 9)
    steps = [[("a", list(range(30, 50)), 0, False, 0), ("b", list(range(60, 69)), 0, True, 0)],
             [("b", [7], 9, True, 1), ("a", [51, 52, 53], 20, True, 0)],
             [("a", [9], 23, True, 1), ("b", [11], 10, True, 2)]]
    out = []
    for i, step in enumerate(steps):
        if i:
            for rid, ids, start, _, _ in step:
                kv.allocate(rid, start + len(ids))
        seqs = [ScheduledSeq(rid, ids, start, kv.block_table(rid), sample, GREEDY, idx)
                for rid, ids, start, sample, idx in step]
        out.append(runner.compute_logits(ScheduledBatch(seqs)))
    return out


def test_fused_forward_matches_the_pytorch_path(ext):
    loaded = load_model(ModelConfig(model="dummy", dummy_config=TINY_MODEL))
    plain, fused = _runner(loaded, attention_backend="torch"), _runner(loaded)
    assert plain.model.fused is None and fused.model.fused is not None
    for a, b in zip(_three_steps(plain), _three_steps(fused)):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    # bf16 matrix products: the fused and the PyTorch path round in the same places
    plain_bf, fused_bf = _runner(loaded, attention_backend="torch", matmul_dtype="bfloat16"), \
        _runner(loaded, matmul_dtype="bfloat16")
    assert fused_bf.model.layers[0]["wqkv"].weight.dtype == torch.bfloat16
    assert fused_bf.model.lm_head.weight.dtype == torch.float32  # logits keep full precision
    for ref, a, b in zip(_three_steps(plain), _three_steps(plain_bf), _three_steps(fused_bf)):
        assert b.dtype == torch.float32
        scale = ref.abs().max()
        assert (a - ref).abs().max() < 0.05 * scale  # bf16 products: close to fp32, not equal
        assert (b - a).abs().max() < 0.05 * scale
        assert (a - ref).abs().max() > 0  # and the bf16 path really ran


def test_matmul_dtype_is_validated():
    with pytest.raises(ConfigError, match="matmul_dtype"):
        ModelConfig(matmul_dtype="float16")
    with pytest.raises(ConfigError, match="matmul_dtype"):
        ModelConfig(dtype="float16", matmul_dtype="bfloat16")
    assert ModelConfig(matmul_dtype="bfloat16").matmul_dtype == "bfloat16"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16bit_kv_cache_matches_across_paths_and_doubles_capacity(dtype):
    loaded = load_model(ModelConfig(model="dummy", dummy_config=TINY_MODEL))
    mcfg = ModelConfig(model="dummy", dummy_config=TINY_MODEL)
    fp32 = ModelRunner(copy.copy(loaded), mcfg, CacheConfig(kv_cache_gb=0.01, kv_cache_dtype="float32"))
    half = ModelRunner(copy.copy(loaded), mcfg, CacheConfig(kv_cache_gb=0.01, kv_cache_dtype=dtype))
    assert half.kv_caches[0][0].dtype == getattr(torch, dtype)
    assert half.num_blocks // 2 == fp32.num_blocks  # same memory, twice the tokens
    ref = _three_steps(_runner(loaded, kv_cache_dtype="float32"))
    plain = _three_steps(_runner(loaded, attention_backend="torch", kv_cache_dtype=dtype))
    fast = _three_steps(_runner(loaded, kv_cache_dtype=dtype))
    for r, a, b in zip(ref, plain, fast):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)  # both paths store the same 16-bit values
        assert 0 < (a - r).abs().max() < (0.05 if dtype == "bfloat16" else 0.01) * r.abs().max()
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype="int4")


def test_kv_cache_dtype_auto_is_int8_or_float16_where_the_cpp_kernels_run():
    """`auto` stores K/V as int8 for a float32 model on the CPU with the C++ attention kernels
    where the int8 cache's VNNI decode kernel built (and the shape suits it), as float16 where it
    did not, and as the model's dtype on the PyTorch attention path; an explicit dtype is kept."""
    from batchserve.runner.model_runner import int8_kv_fits, resolve_kv_cache_dtype

    auto, cache32 = CacheConfig(), CacheConfig(kv_cache_dtype="float32")
    torch_path = ModelConfig(model="dummy", attention_backend="torch")
    assert resolve_kv_cache_dtype(torch_path, auto) == torch.float32
    assert resolve_kv_cache_dtype(ModelConfig(model="dummy", dtype="bfloat16"), auto) == torch.bfloat16
    assert resolve_kv_cache_dtype(ModelConfig(model="dummy"), cache32) == torch.float32
    ext = paged_attention_ext()
    if ext is not None and fused_ops_ext() is not None:
        shape = {**TINY_MODEL, "hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1}  # head_dim 64
        loaded = load_model(ModelConfig(model="dummy", dummy_config=shape))
        want = torch.uint8 if ext.int8_fast_path() and ext.prefill_supported(64) else torch.float16
        assert resolve_kv_cache_dtype(ModelConfig(model="dummy"), auto, loaded.config) == want
        runner = ModelRunner(loaded, ModelConfig(model="dummy", dummy_config=shape), CacheConfig(num_blocks=8))
        assert runner.kv_caches[0][0].dtype == want
        # a head_dim the int8 prompt kernel does not take, blocks it does not, or no VNNI kernel: float16
        tiny = load_model(ModelConfig(model="dummy", dummy_config=TINY_MODEL))  # head_dim 16
        assert resolve_kv_cache_dtype(ModelConfig(model="dummy"), auto, tiny.config) == torch.float16
        assert _runner(tiny, "auto").kv_caches[0][0].dtype == torch.float16
        assert not int8_kv_fits(CacheConfig(block_size=8))
        assert resolve_kv_cache_dtype(ModelConfig(model="dummy"), CacheConfig(block_size=8)) == torch.float16
        ext.set_int8_fast_path(False)
        try:
            assert resolve_kv_cache_dtype(ModelConfig(model="dummy"), auto, loaded.config) == torch.float16
        finally:
            ext.set_int8_fast_path(True)
