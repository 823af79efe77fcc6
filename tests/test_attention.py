"""Paged attention without a model: the mixed prefill/decode path against plain causal
attention over each request's full sequence, for both decode backends."""
import pytest
import torch
import torch.nn.functional as F

from batchserve.runner.attention import AttnMeta, paged_attention
from batchserve.runner.kernels import paged_attention_ext


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
    k_cache = torch.zeros(num_blocks * bs, n_kv, hd)
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


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
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
    slots = (max(max(t) for t in tables) + 1) * bs
    k_cache = torch.randn(slots, n_kv, hd).to(cache_dtype)
    v_cache = torch.randn(slots, n_kv, hd).to(cache_dtype)
    q = torch.randn(len(lens), n_h, hd)
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    out = kernel.paged_decode(q, k_cache, v_cache, bt, torch.tensor(lens), bs, hd ** -0.5)
    for i, n in enumerate(lens):
        pos = torch.arange(n)
        sl = torch.tensor(tables[i])[pos // bs] * bs + pos % bs
        k = k_cache[sl].double().repeat_interleave(g, dim=1)  # [n, n_h, hd]
        v = v_cache[sl].double().repeat_interleave(g, dim=1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[i].double(), k) * hd ** -0.5, dim=-1)
        torch.testing.assert_close(out[i].double(), torch.einsum("hn,nhd->hd", p, v), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
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
    slots = (max(max(t) for t in tables) + 1) * bs
    k_cache = torch.randn(slots, n_kv, hd).to(cache_dtype)
    v_cache = torch.randn(slots, n_kv, hd).to(cache_dtype)
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
        kk = k_cache[sl].double().repeat_interleave(g, dim=1)  # [s + n, n_h, hd]
        vv = v_cache[sl].double().repeat_interleave(g, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[flat:flat + n].double(), kk) * hd ** -0.5
        causal = torch.arange(s + n)[None, :] <= torch.arange(s, s + n)[:, None]
        p = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        ref = torch.einsum("hqk,khd->qhd", p, vv)
        torch.testing.assert_close(out[flat:flat + n].double(), ref, rtol=1e-4, atol=1e-4)
        flat += n
