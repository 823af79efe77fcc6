"""Paged attention without a model: the mixed prefill/decode path against plain causal
attention over each request's full sequence, for both decode backends."""
import pytest
import torch
import torch.nn.functional as F

from batchserve.runner.attention import AttnMeta, gather_slots, paged_attention
from batchserve.runner.kernels import paged_attention_ext

pytestmark = pytest.mark.kernel


def reference(q_full, k_full, v_full):
    """Causal attention over one whole sequence: [n, n_h, hd] x [n, n_kv, hd]."""
    o = F.scaled_dot_product_attention(q_full.transpose(0, 1), k_full.transpose(0, 1), v_full.transpose(0, 1),
                                       is_causal=True, enable_gqa=True)
    return o.transpose(0, 1)


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_mixed_batch_matches_full_causal_attention(backend):
    kernel = paged_attention_ext() if backend == "cpp" else None
    if backend == "cpp" and kernel is None:
        pytest.skip("C++ toolchain not available here")
    torch.manual_seed(0)
    n_h, n_kv, hd, bs = 6, 2, 16, 4
    num_blocks = 64
    k_cache = torch.zeros(num_blocks, n_kv, bs, hd)
    v_cache = torch.zeros_like(k_cache)
    # request lengths; each step computes: a full prompt, a prompt chunk after 5 cached, decodes
    lens = {"a": 9, "b": 12, "c": 7, "d": 30}
    full = {r: (torch.randn(n, n_h, hd), torch.randn(n, n_kv, hd), torch.randn(n, n_kv, hd)) for r, n in lens.items()}
    perm = torch.randperm(num_blocks).tolist()  # scattered blocks
    tables = {}
    for r, n in lens.items():
        tables[r] = [perm.pop() for _ in range(-(-n // bs))]
    # step 1: everything but the last token (b split at 5), step 2: b's chunk, c/d decode, a prompt
    plan1 = [("b", 0, 5), ("c", 0, 6), ("d", 0, 29)]
    plan2 = [("c", 6, 1), ("b", 5, 7), ("d", 29, 1), ("a", 0, 9)]
    for plan in (plan1, plan2):
        q = torch.cat([full[r][0][s:s + n] for r, s, n in plan])
        k = torch.cat([full[r][1][s:s + n] for r, s, n in plan])
        v = torch.cat([full[r][2][s:s + n] for r, s, n in plan])
        meta = AttnMeta.build([(s, n, tables[r]) for r, s, n in plan], bs, torch.device("cpu"), kernel)
        out = paged_attention(q, k, v, k_cache, v_cache, meta)
        flat = 0
        for r, s, n in plan:
            ref = reference(*(t[:s + n] for t in full[r]))[s:s + n]
            torch.testing.assert_close(out[flat:flat + n], ref, rtol=1e-5, atol=1e-5)
            flat += n


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hd,g,bs", [(64, 3, 16), (32, 1, 5), (20, 2, 4)])  # hd 20: the portable path
def test_decode_kernel_matches_gathered_attention(cache_dtype, hd, g, bs):
    """The C++ decode kernel against softmax(q k) v over each sequence's gathered history, with
    contexts long enough to be split across threads, short, and on block boundaries."""
    kernel = paged_attention_ext()
    if kernel is None:
        pytest.skip("C++ toolchain not available here")
    torch.manual_seed(hd + g + bs)
    n_kv = 2
    n_h = n_kv * g
    lens = [1, bs, bs + 1, 37, 700]
    tables, free = [], torch.randperm(sum(-(-n // bs) for n in lens) + 8).tolist()
    for n in lens:
        tables.append([free.pop() for _ in range(-(-n // bs))])
    blocks = max(max(t) for t in tables) + 1
    k_cache = torch.randn(blocks, n_kv, bs, hd).to(cache_dtype)
    v_cache = torch.randn(blocks, n_kv, bs, hd).to(cache_dtype)
    q = torch.randn(len(lens), n_h, hd)
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    out = kernel.paged_decode(q, k_cache, v_cache, bt, torch.tensor(lens), bs, hd ** -0.5)
    for i, n in enumerate(lens):
        pos = torch.arange(n)
        sl = torch.tensor(tables[i])[pos // bs] * bs + pos % bs
        k = gather_slots(k_cache, sl).double().repeat_interleave(g, dim=1)  # [n, n_h, hd]
        v = gather_slots(v_cache, sl).double().repeat_interleave(g, dim=1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[i].double(), k) * hd ** -0.5, dim=-1)
        torch.testing.assert_close(out[i].double(), torch.einsum("hn,nhd->hd", p, v), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hd,g,bs", [(64, 3, 16), (128, 4, 16), (64, 1, 5)])
def test_prefill_kernel_matches_float64(cache_dtype, hd, g, bs):
    """The C++ prompt-chunk kernel against softmax(q k^T + causal mask) v in float64 over each
    request's gathered cache: whole prompts (1 token, under, on and past the 16-query tile, long
    enough to spread over both threads), chunks after cached context, next to decodes in one batch,
    with q read through a strided view as the model passes it."""
    kernel = paged_attention_ext()
    if kernel is None or not kernel.prefill_supported(hd):
        pytest.skip("no C++ prefill kernel for this head size here")
    torch.manual_seed(hd + g + bs)
    n_kv = 2
    n_h = n_kv * g
    plan = [(0, 1), (0, 16), (0, 17), (30, 1), (23, 50), (0, 300), (100, 3), (64, 16)]  # (start, tokens)
    tables, free = [], torch.randperm(sum(-(-(s + n) // bs) for s, n in plan) + 8).tolist()
    for s, n in plan:
        tables.append([free.pop() for _ in range(-(-(s + n) // bs))])
    blocks = max(max(t) for t in tables) + 1
    k_cache = torch.randn(blocks, n_kv, bs, hd).to(cache_dtype)
    v_cache = torch.randn(blocks, n_kv, bs, hd).to(cache_dtype)
    T = sum(n for _, n in plan)
    qkv = torch.randn(T, n_h + 2 * n_kv, hd)
    q, k, v = qkv[:, :n_h], qkv[:, n_h:n_h + n_kv], qkv[:, n_h + n_kv:]  # strided, as in the fused forward
    meta = AttnMeta.build([(s, n, t) for (s, n), t in zip(plan, tables)], bs, torch.device("cpu"), kernel)
    assert meta.pf_spans is not None and len(meta.prefills) == 7  # all but (30, 1), a decode
    out = paged_attention(q, k, v, k_cache, v_cache, meta, stored=True)
    flat = 0
    for (s, n), t in zip(plan, tables):
        pos = torch.arange(s + n)
        sl = torch.tensor(t)[pos // bs] * bs + pos % bs
        kk = gather_slots(k_cache, sl).double().repeat_interleave(g, dim=1)  # [s + n, n_h, hd]
        vv = gather_slots(v_cache, sl).double().repeat_interleave(g, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[flat:flat + n].double(), kk) * hd ** -0.5
        causal = torch.arange(s + n)[None, :] <= torch.arange(s, s + n)[:, None]
        p = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        ref = torch.einsum("hqk,khd->qhd", p, vv)
        torch.testing.assert_close(out[flat:flat + n].double(), ref, rtol=1e-4, atol=1e-4)
        flat += n



@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_prefill_kernel_gives_each_row_the_same_bits_however_the_prompt_is_cut(cache_dtype):
    """A prompt's rows from the C++ prompt kernel are bit-identical whether it runs whole, in
    chunks of 7 or 8 tokens (each after the cached rest), or beside another prompt: each query is
    computed on its own in key order. Prefix caching and chunked prefill rely on it for their
    greedy tokens to equal an uncut prompt's."""
    kernel = paged_attention_ext()
    if kernel is None or not kernel.prefill_supported(64):
        pytest.skip("no C++ prefill kernel here")
    torch.manual_seed(7)
    n, n_kv, g, hd, bs = 61, 2, 3, 64, 16
    table = torch.randperm(8)[: -(-n // bs)].tolist()
    k_cache = torch.randn(8, n_kv, bs, hd).to(cache_dtype)
    v_cache = torch.randn(8, n_kv, bs, hd).to(cache_dtype)
    qkv = torch.randn(n, n_kv * g + 2 * n_kv, hd)
    q, k, v = qkv[:, :n_kv * g], qkv[:, n_kv * g:n_kv * (g + 1)], qkv[:, n_kv * (g + 1):]

    def attend(pieces):  # pieces: (start, tokens) of this prompt, all in one step
        meta = AttnMeta.build([(s, c, table) for s, c in pieces], bs, torch.device("cpu"), kernel)
        rows = torch.cat([torch.arange(s, s + c) for s, c in pieces])
        return paged_attention(q[rows], k[rows], v[rows], k_cache, v_cache, meta, stored=True), rows

    whole, _ = attend([(0, n)])
    for size in (7, 8):
        for s in range(0, n, size):
            got, rows = attend([(s, min(size, n - s))])
            assert torch.equal(got, whole[rows]), (size, s)
    got, rows = attend([(0, 30), (30, n - 30)])  # two pieces side by side in one step
    assert torch.equal(got, whole[rows])

def test_float16_cache_saturates_instead_of_overflowing():
    """A K/V value past float16's range is stored as +-65504 on both write paths (the PyTorch
    index_copy and the C++ fused RoPE store), so attention stays finite; NaN stays NaN."""
    from batchserve.runner.attention import to_cache_dtype
    from batchserve.runner.kernels import fused_ops_ext

    x = torch.tensor([1e6, -1e6, 65519.0, 65520.0, 1.0, float("nan"), float("inf")])
    got = to_cache_dtype(x, torch.float16)
    assert got[:5].tolist() == [65504.0, -65504.0, 65504.0, 65504.0, 1.0]
    assert got[5].isnan() and got[6] == 65504.0
    assert torch.equal(to_cache_dtype(x[:5], torch.float32), x[:5])  # float32 caches are left alone
    ext = fused_ops_ext()
    if ext is None:
        return
    nh, nkv, hd, T = 2, 1, 16, 2
    qkv = torch.randn(T, (nh + 2 * nkv) * hd)
    qkv[0, nh * hd] = 1e6  # a key element (unrotated: cos 1, sin 0)
    qkv[1, (nh + nkv) * hd + 3] = -1e9  # a value element
    qkv[1, (nh + nkv) * hd + 4] = float("nan")
    cos, sin = torch.ones(T, hd // 2), torch.zeros(T, hd // 2)
    kc, vc = torch.zeros(2, nkv, 4, hd, dtype=torch.float16), torch.zeros(2, nkv, 4, hd, dtype=torch.float16)
    ext.rope_store(qkv, cos, sin, torch.tensor([5, 2]), kc, vc, nh, nkv)  # slot 5: block 1, offset 1
    assert kc[1, 0, 1, 0] == 65504.0 and vc[0, 0, 2, 3] == -65504.0 and vc[0, 0, 2, 4].isnan()
    kernel = paged_attention_ext()
    q = torch.randn(1, nh, hd) * 1e-3
    out = kernel.paged_decode(q, kc, kc, torch.tensor([[0, 1]]), torch.tensor([8]), 4, hd ** -0.5)
    assert torch.isfinite(out).all()  # 65504 keys, not infinities


def test_portable_float16_conversions_match_torch():
    """The float16 conversions that run where F16C is missing (cpu_math.h), against torch: every
    one of the 65,536 halves widened, and floats around every rounding case narrowed (normals,
    subnormals, ties to even, the largest finite half, signed zeros)."""
    from batchserve.runner.kernels import fused_ops_ext

    ext = fused_ops_ext()
    if ext is None:
        pytest.skip("C++ toolchain not available here")
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    want = bits.view(torch.float16).float()
    got = ext.fp16_to_float_portable(bits)
    finite = ~want.isnan()
    assert torch.equal(got[finite].view(torch.int32), want[finite].view(torch.int32))  # bit for bit, -0 too
    assert got[~finite].isnan().all()
    # every half, its neighbours in float32 and the midpoints between consecutive halves (ties)
    h = want[finite & (want.abs() < 65504)].unique()
    mids = (h[:-1].double() + h[1:].double()) / 2
    xs = torch.cat([h, torch.nextafter(h, torch.full_like(h, 1e9)), torch.nextafter(h, torch.full_like(h, -1e9)),
                    mids.float(), torch.tensor([-0.0, 65504.0, -65504.0, 2.0 ** -25, 2.0 ** -24, 3 * 2.0 ** -26])])
    xs = xs[xs.abs() <= 65504]
    got = ext.fp16_from_float_portable(xs).view(torch.float16)
    want = xs.to(torch.float16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    big = torch.tensor([65520.0, 1e30, float("inf"), -float("inf"), float("nan")])
    sat = ext.fp16_from_float_portable(big).view(torch.float16).float()
    assert sat[:3].tolist() == [65504.0] * 3 and sat[3] == -65504.0 and sat[4].isnan()


def test_decode_only_metadata_equals_the_general_build():
    """AttnMeta.build's decode-only path (Python ints, for the C++ kernel) gives the fields the
    general path gives for the same decodes: slots at block boundaries and inside blocks, ragged
    block tables, a request whose position starts a new block."""
    kernel = paged_attention_ext()
    if kernel is None:
        pytest.skip("C++ toolchain not available here")
    bs = 16
    seqs = [(1, 1, [7]), (15, 1, [3]), (16, 1, [9, 4]), (47, 1, [11, 12, 13]), (100, 1, list(range(20, 27)))]
    fast = AttnMeta.build(seqs, bs, torch.device("cpu"), kernel)
    ref = AttnMeta._build_general(seqs, bs, torch.device("cpu"), kernel)
    assert fast.decode_only and ref.decode_only and fast.dec_contiguous and fast.prefills == []
    assert (fast.dec_lo, fast.dec_hi, fast.block_size) == (ref.dec_lo, ref.dec_hi, ref.block_size) == (0, 5, bs)
    for name in ("slot_mapping", "dec_rows", "dec_tables", "dec_lens"):
        a, b = getattr(fast, name), getattr(ref, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert fast.slot_mapping.tolist() == [7 * bs + 1, 3 * bs + 15, 4 * bs, 13 * bs + 15, 26 * bs + 4]
    # a prompt chunk or a first token (position 0) in the step: the general path
    assert not AttnMeta.build(seqs + [(0, 1, [30])], bs, torch.device("cpu"), kernel).decode_only
    assert AttnMeta.build(seqs + [(0, 3, [30])], bs, torch.device("cpu"), kernel).prefills
