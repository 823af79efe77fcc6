"""The int8 KV cache (--kv-cache-dtype int8): a byte per K/V value plus a float32 scale per token
and kv head, written by the C++ kernels and read by their decode and prompt paths."""
from __future__ import annotations

import copy

import pytest
import torch

from batchserve.config import CacheConfig, ConfigError, ModelConfig
from batchserve.core.batch import ScheduledBatch, ScheduledSeq
from batchserve.core.kv_cache import KVCacheManager
from batchserve.request import SamplingParams
from batchserve.runner.attention import AttnMeta, paged_attention
from batchserve.runner.kernels import fused_ops_ext, paged_attention_ext
from batchserve.runner.loader import load_model
from batchserve.runner.model_runner import ModelRunner

pytestmark = pytest.mark.kernel

# head_dim 64, as the int8 cache's prompt kernel wants; two kv heads of two query heads each
HD64_MODEL = {"vocab_size": 512, "hidden_size": 256, "intermediate_size": 256, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048}


@pytest.fixture(scope="module")
def ext():
    kernel = paged_attention_ext()
    if kernel is None or fused_ops_ext() is None or not kernel.prefill_supported(64):
        pytest.skip("the int8 cache's C++ kernels do not run here")
    return kernel


def _cache(blocks: int, n_kv: int, bs: int, hd: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty int8 K and V caches: rows of hd bytes plus float32 scales (K: one per 16 elements)."""
    return (torch.zeros(blocks, n_kv, bs, hd + hd // 4, dtype=torch.uint8),
            torch.zeros(blocks, n_kv, bs, hd + 4, dtype=torch.uint8))


def _positions(table: list[int], n: int, bs: int) -> torch.Tensor:
    pos = torch.arange(n)
    return torch.tensor(table, dtype=torch.long)[pos // bs] * bs + pos % bs


def _history(ext, k_cache, v_cache, table: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's first n K and V rows as the cache holds them (dequantized), [n, n_kv, hd]."""
    bs = k_cache.shape[2]
    blocks = torch.tensor(table[:-(-n // bs)], dtype=torch.long)
    k, v = ext.kv_int8_load(k_cache, v_cache, blocks)  # [nb, n_kv, bs, hd]
    return tuple(x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])[:n] for x in (k, v))


def test_rows_round_trip_within_half_a_quantization_step(ext):
    torch.manual_seed(0)
    n_kv, bs, hd = 2, 16, 64
    k_cache, v_cache = _cache(8, n_kv, bs, hd)
    k = torch.randn(40, n_kv, hd) * torch.logspace(-2, 2, 40)[:, None, None]  # rows of every magnitude
    v = torch.randn(40, n_kv, hd)
    k[3] = 0.0  # an all-zero row: scale 0, values 0
    k[5, :, 7] = 300.0  # an outlier sets its row's scale
    slots = torch.randperm(8 * bs)[:40]
    ext.kv_int8_store(k_cache, v_cache, k, v, slots)
    kk, vv = ext.kv_int8_load(k_cache, v_cache, torch.arange(8))
    got_k = kk.transpose(1, 2).reshape(-1, n_kv, hd)[slots]
    got_v = vv.transpose(1, 2).reshape(-1, n_kv, hd)[slots]
    k_amax = k.view(40, n_kv, hd // 16, 16).abs().amax(-1, keepdim=True).expand(-1, -1, -1, 16).reshape(k.shape)
    v_amax = v.abs().amax(-1, keepdim=True)  # V: a scale per row; K: per 16 elements
    for want, got, amax in ((k, got_k, k_amax), (v, got_v, v_amax)):
        step = amax / 127
        assert ((got - want).abs() <= step / 2 * 1.0001 + 1e-12).all()
        assert ((got - want).abs() > 0).any()  # really quantized
        # exactly: q = x * (127 / amax) rounded half to even, value = (amax / 127) * q, in float32
        inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
        assert torch.equal(got, (amax / 127) * torch.round(want * inv).clamp(-127, 127))
    assert (got_k[3] == 0).all()
    assert got_k[5, 0, 7] == pytest.approx(300.0)
    # the outlier coarsens only its own group of 16 elements
    assert (got_k[5, :, 16:] - k[5, :, 16:]).abs().max() <= k[5, :, 16:].abs().max() / 254 * 1.0001
    with pytest.raises(RuntimeError, match="slot out of range"):
        ext.kv_int8_store(k_cache, v_cache, k[:1], v[:1], torch.tensor([8 * bs]))


def test_rope_store_writes_the_same_bytes_as_the_store_kernel(ext):
    torch.manual_seed(1)
    nh, n_kv, bs, hd = 6, 2, 32, 64
    T = 9
    qkv = torch.randn(T, (nh + 2 * n_kv) * hd)
    cos, sin = torch.rand(T, hd // 2), torch.rand(T, hd // 2)
    slots = torch.tensor([0, 15, 16, 17, 31, 32, 100, 101, 190])
    k1, v1 = _cache(6, n_kv, bs, hd)
    k2, v2 = _cache(6, n_kv, bs, hd)
    out = fused_ops_ext().rope_store(qkv, cos, sin, slots, k1, v1, nh, n_kv, True)
    ext.kv_int8_store(k2, v2, out[:, nh:nh + n_kv], out[:, nh + n_kv:], slots)
    assert torch.equal(k1, k2) and torch.equal(v1, v2)


def _reference_decode(ext, q, k_cache, v_cache, tables, lens):
    g = q.shape[1] // k_cache.shape[1]
    out = []
    for b, n in enumerate(lens):
        k, v = _history(ext, k_cache, v_cache, tables[b], n)
        k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
        p = torch.softmax(torch.einsum("hd,thd->ht", q[b].double(), k) * q.shape[2] ** -0.5, dim=-1)
        out.append(torch.einsum("ht,thd->hd", p, v))
    return torch.stack(out)


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("hd,g,bs", [(64, 3, 16), (128, 4, 32), (32, 1, 16)])
def test_decode_matches_attention_over_the_dequantized_cache(ext, fast, hd, g, bs):
    """The VNNI kernel (q kept to ~15 bits) and the dequantizing path, against float64 attention
    over the values the cache holds: partial tiles, many blocks, one long context split over the
    threads, scattered blocks."""
    if fast and not ext.int8_fast_path():
        pytest.skip("no AVX512-VNNI int8 decode kernel here")
    torch.manual_seed(hd + g + bs)
    n_kv = 3
    lens = [1, 15, 16, 17, 130, 1000, 64]
    need = sum(-(-n // bs) for n in lens)
    free = torch.randperm(need + 5).tolist()
    tables = [[free.pop() for _ in range(-(-n // bs))] for n in lens]
    k_cache, v_cache = _cache(need + 5, n_kv, bs, hd)
    for t, n in zip(tables, lens):
        k = torch.randn(n, n_kv, hd) * 3
        k[:, :, 1] *= 8  # a large channel, as RoPE'd keys have
        ext.kv_int8_store(k_cache, v_cache, k, torch.randn(n, n_kv, hd), _positions(t, n, bs))
    q = torch.randn(len(lens), n_kv * g, hd)
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
    ext.set_int8_fast_path(fast)
    try:
        out = ext.paged_decode(q, k_cache, v_cache, bt, torch.tensor(lens), bs, hd ** -0.5)
    finally:
        ext.set_int8_fast_path(True)
    ref = _reference_decode(ext, q, k_cache, v_cache, tables, lens)
    tol = 2e-3 if fast else 1e-5
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


def test_mixed_batch_writes_and_reads_the_int8_cache(ext):
    """paged_attention on an int8 cache, the new K/V not yet stored: prompt chunks (one after
    cached context) beside a decode, against float64 causal attention over the cache's values."""
    torch.manual_seed(3)
    n_kv, g, bs, hd = 2, 3, 16, 64
    n_h = n_kv * g
    plan = [(0, 1), (0, 40), (16, 20), (50, 1), (0, 300)]  # (start, tokens); (50, 1) decodes
    free = torch.randperm(60).tolist()
    tables = [[free.pop() for _ in range(-(-(s + n) // bs))] for s, n in plan]
    k_cache, v_cache = _cache(60, n_kv, bs, hd)
    for (s, _), t in zip(plan, tables):  # the context before each chunk
        if s:
            ext.kv_int8_store(k_cache, v_cache, torch.randn(s, n_kv, hd), torch.randn(s, n_kv, hd),
                              _positions(t, s, bs))
    T = sum(n for _, n in plan)
    q, k, v = torch.randn(T, n_h, hd), torch.randn(T, n_kv, hd), torch.randn(T, n_kv, hd)
    meta = AttnMeta.build([(s, n, t) for (s, n), t in zip(plan, tables)], bs, torch.device("cpu"), ext)
    out = paged_attention(q, k, v, k_cache, v_cache, meta)
    flat = 0
    for (s, n), t in zip(plan, tables):
        kk, vv = (x.double().repeat_interleave(g, 1) for x in _history(ext, k_cache, v_cache, t, s + n))
        scores = torch.einsum("qhd,khd->hqk", q[flat:flat + n].double(), kk) * hd ** -0.5
        causal = torch.arange(s + n)[None, :] <= torch.arange(s, s + n)[:, None]
        ref = torch.einsum("hqk,khd->qhd", torch.softmax(scores.masked_fill(~causal, float("-inf")), -1), vv)
        torch.testing.assert_close(out[flat:flat + n].double(), ref, rtol=2e-3, atol=2e-3)
        flat += n


def _runner(loaded, kv_cache_dtype: str, **kw) -> ModelRunner:
    return ModelRunner(copy.copy(loaded), ModelConfig(model="dummy", dummy_config=HD64_MODEL, **kw),
                       CacheConfig(block_size=16, kv_cache_gb=0.01, kv_cache_dtype=kv_cache_dtype))


def _steps(runner: ModelRunner) -> list[torch.Tensor]:
    """A 40-token prompt in two chunks beside a short prompt, then decodes."""
    kv = KVCacheManager(runner.num_blocks, runner.block_size)
    greedy = SamplingParams(temperature=0.0)
    plan = [[("a", list(range(30, 55)), 0, False), ("b", list(range(60, 69)), 0, True)],
            [("b", [7], 9, True), ("a", list(range(100, 115)), 25, True)],
            [("a", [9], 40, True), ("b", [11], 10, True)], [("a", [4], 41, True), ("b", [5], 11, True)]]
    out = []
    for step in plan:
        for rid, ids, start, _ in step:
            kv.allocate(rid, start + len(ids))
        seqs = [ScheduledSeq(rid, ids, start, kv.block_table(rid), sample, greedy, 0)
                for rid, ids, start, sample in step]
        out.append(runner.compute_logits(ScheduledBatch(seqs)))
    return out


def test_runner_with_an_int8_cache_follows_float32_and_holds_more_tokens(ext):
    loaded = load_model(ModelConfig(model="dummy", dummy_config=HD64_MODEL))
    fp32, fp16, int8 = (_runner(loaded, d) for d in ("float32", "float16", "int8"))
    k, v = int8.kv_caches[0]
    assert k.dtype == v.dtype == torch.uint8 and k.shape[1:] == (2, 16, 80) and v.shape[1:] == (2, 16, 68)
    assert int8.num_blocks >= 1.7 * fp16.num_blocks  # 148 bytes per token and kv head against float16's 256
    for r, a in zip(_steps(fp32), _steps(int8)):
        err = (a - r).abs().max()
        assert 0 < err < 0.05 * r.abs().max()  # quantized, yet close
    # the KV hand-off: exported as float32 values, imported (quantized again) to the same bytes
    kv = KVCacheManager(int8.num_blocks, int8.block_size)
    kv.allocate("a", 30)
    table = kv.block_table("a")
    int8.compute_logits(ScheduledBatch([ScheduledSeq("a", list(range(30)), 0, table, True,
                                                     SamplingParams(temperature=0.0), 0)]))
    out = int8.export_kv(table, 30)
    assert out.shape == (2, 2, 30, 2, 64) and out.dtype == torch.float32
    other = _runner(loaded, "int8")
    other.import_kv(table, out)
    torch.testing.assert_close(other.export_kv(table, 30), out, rtol=1e-6, atol=1e-6)


def test_int8_cache_is_refused_where_its_kernels_do_not_run():
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype="int4")
    assert CacheConfig(kv_cache_dtype="int8").kv_cache_dtype == "int8"
    loaded = load_model(ModelConfig(model="dummy", dummy_config=HD64_MODEL))
    with pytest.raises(ValueError, match="kv_cache_dtype=int8 needs the C\\+\\+ attention kernels"):
        _runner(loaded, "int8", attention_backend="torch")
    with pytest.raises(ValueError, match="block_size a multiple of 16"):
        ModelRunner(copy.copy(loaded), ModelConfig(model="dummy", dummy_config=HD64_MODEL),
                    CacheConfig(block_size=8, kv_cache_gb=0.01, kv_cache_dtype="int8"))
