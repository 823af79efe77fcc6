"""Prompt rows on AMX bf16 tiles (--prompt-matmul): the C++ product, the row split a step
hands the model, and the real model's steps with prompts and decodes side by side. The kernel
and model tests run on a CPU whose OS gives AMX tiles (Intel Sapphire Rapids and later)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from batchserve.config import ConfigError, ModelConfig
from batchserve.runner.attention import ALL_ROWS, split_rows


def _amx() -> bool:
    from batchserve.runner.kernels import gemm_ext

    return gemm_ext() is not None and gemm_ext().has_amx()


def test_split_rows_names_the_prompt_rows_and_the_others():
    assert split_rows([(1, False), (1, False)]) is None
    assert split_rows([(5, True), (3, True)]) is ALL_ROWS
    mine, rest = split_rows([(1, False), (1, False), (7, True), (2, True)])  # decodes, then prompts
    assert (mine, rest) == (slice(2, 11), slice(0, 2))
    mine, rest = split_rows([(4, True), (1, False), (3, True), (0, True)])
    assert torch.equal(mine, torch.tensor([0, 1, 2, 3, 5, 6, 7])) and rest == slice(4, 5)


def test_prompt_matmul_is_validated():
    assert ModelConfig().prompt_matmul == "auto"
    with pytest.raises(ConfigError, match="prompt_matmul"):
        ModelConfig(prompt_matmul="bf16")
    with pytest.raises(ConfigError, match="prompt_matmul"):
        ModelConfig(prompt_matmul="amx", device="cuda")
    with pytest.raises(ConfigError, match="prompt_matmul"):
        ModelConfig(prompt_matmul="amx", dtype="bfloat16")


def test_auto_takes_amx_only_for_integer_default_products(monkeypatch):
    from batchserve.runner import kernels
    from batchserve.runner.model_runner import resolve_prompt_matmul

    class Ext:
        amx = True

        def has_amx(self) -> bool:
            return self.amx

    ext = Ext()
    monkeypatch.setattr(kernels, "gemm_ext", lambda: ext)
    fused = object()
    assert resolve_prompt_matmul(ModelConfig(), torch.int8, fused)
    assert not resolve_prompt_matmul(ModelConfig(), None, fused)  # float32 products stay float32 for prompts
    assert not resolve_prompt_matmul(ModelConfig(matmul_dtype="int8"), torch.int8, fused)  # asked: as asked
    assert not resolve_prompt_matmul(ModelConfig(cpu_isa="avx2"), torch.int8, fused)  # as an AVX2 CPU would
    assert not resolve_prompt_matmul(ModelConfig(prompt_matmul="off"), torch.int8, fused)
    assert not resolve_prompt_matmul(ModelConfig(), torch.int8, None)  # no fused C++ path
    assert resolve_prompt_matmul(ModelConfig(prompt_matmul="amx", matmul_dtype="float32"), None, fused)
    from batchserve.runner.models.llama import LlamaConfig

    odd = LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=96, num_layers=1, num_heads=3,
                      num_kv_heads=1, head_dim=16)  # 48 columns: not whole tiles
    assert not resolve_prompt_matmul(ModelConfig(), torch.int8, fused, odd)
    even = dataclasses.replace(odd, hidden_size=64, num_heads=4, num_kv_heads=2)
    assert resolve_prompt_matmul(ModelConfig(), torch.int8, fused, even)
    ext.amx = False
    assert not resolve_prompt_matmul(ModelConfig(), torch.int8, fused)
    with pytest.raises(RuntimeError, match="prompt_matmul=amx: no AMX"):
        resolve_prompt_matmul(ModelConfig(prompt_matmul="amx"), torch.int8, fused)


@pytest.mark.kernel
@pytest.mark.parametrize("k,n", [(576, 960), (1536, 576), (64, 32), (576, 3072)])  # k in 1-6 slices; 1-2 column passes
def test_amx_product_is_the_bf16_rounded_product_whatever_rows_share_the_call(k, n):
    if not _amx():
        pytest.skip("no AMX tiles on this CPU")
    from batchserve.runner.kernels import gemm_ext

    ext = gemm_ext()
    torch.manual_seed(0)
    w, x = torch.randn(n, k), torch.randn(300, k)
    wp = ext.pack_amx(w)
    assert wp.shape == (n // 16, k // 32, 512)
    y = ext.gemm_amx(x, wp, n)
    ref = x.bfloat16().double() @ w.bfloat16().double().T  # exact products of the rounded operands
    assert y.shape == (300, n) and y.is_contiguous()
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5  # fp32 sums only
    for lo, m in ((0, 1), (7, 9), (31, 33), (100, 200), (299, 1)):  # any rows, any company: the same bits
        assert torch.equal(ext.gemm_amx(x[lo:lo + m].contiguous(), wp, n), y[lo:lo + m])
    assert ext.gemm_amx(x[:0], wp, n).shape == (0, n)


@pytest.mark.kernel
@pytest.mark.parametrize("k,pairs", [(64, 3), (576, 96)])
def test_amx_swiglu_product_is_the_product_then_silu_mul_bit_for_bit(k, pairs):
    if not _amx():
        pytest.skip("no AMX tiles on this CPU")
    from batchserve.runner.kernels import fused_ops_ext, gemm_ext

    ext = gemm_ext()
    # the gate/up product packed in pairs of 16 rows gives silu_mul of the plain product, rounded to bf16
    n = 32 * pairs
    x, w = torch.randn(45, k), torch.randn(n, k)
    packed = ext.pack_amx(w.view(2, pairs, 16, k).transpose(0, 1).reshape(n, k).contiguous())
    h = ext.gemm_amx(x, packed, n, True)
    assert h.dtype == torch.bfloat16 and h.shape == (45, n // 2)
    assert torch.equal(h, fused_ops_ext().silu_mul(ext.gemm_amx(x, ext.pack_amx(w), n)).bfloat16())
    down = ext.pack_amx(torch.randn(32, 64))
    hx = torch.randn(45, 64).bfloat16()  # bf16 rows are taken as they are
    assert torch.equal(ext.gemm_amx(hx, down, 32), ext.gemm_amx(hx.float(), down, 32))


@pytest.mark.kernel
def test_amx_product_rejects_bad_input():
    if not _amx():
        pytest.skip("no AMX tiles on this CPU")
    from batchserve.runner.kernels import gemm_ext

    ext = gemm_ext()
    with pytest.raises(RuntimeError, match="multiples of 32"):
        ext.pack_amx(torch.randn(40, 64))
    wp = ext.pack_amx(torch.randn(64, 64))
    with pytest.raises(RuntimeError, match=r"\[M, 64\]"):
        ext.gemm_amx(torch.randn(3, 32), wp, 64)
    with pytest.raises(RuntimeError, match="packed weight"):
        ext.gemm_amx(torch.randn(3, 64), wp, 32)


@pytest.fixture(scope="module")
def amx_llm():
    if not _amx():
        pytest.skip("no AMX tiles on this CPU")
    from batchserve.llm import LLM

    return LLM(kv_cache_gb=0.05)


@pytest.mark.model
def test_defaults_run_prompts_on_amx_and_decodes_on_the_blocks(amx_llm):
    from batchserve.llm import LLM

    model = amx_llm.engine.executor.model
    assert model.prompt_layers is not None and len(model.prompt_layers) == model.cfg.num_layers
    assert model.layers[0]["wqkv"].act_bits == 8  # decodes: int8 products on the GGUF blocks
    assert LLM(kv_cache_gb=0.02, prompt_matmul="off").engine.executor.model.prompt_layers is None
    assert LLM(kv_cache_gb=0.02, matmul_dtype="float32").engine.executor.model.prompt_layers is None


@pytest.mark.model
def test_a_step_of_prompts_and_decodes_gives_each_request_its_own_logits(amx_llm):
    """Prompt A, a decode of B and prompt C in one step (the prompt rows not contiguous): each
    row's logits are those of the same work alone, and the prompts differ from the blocks' path."""
    from batchserve.core.batch import ScheduledBatch, ScheduledSeq
    from batchserve.core.kv_cache import KVCacheManager
    from batchserve.request import SamplingParams

    runner = amx_llm.engine.executor
    greedy = SamplingParams(temperature=0.0)
    tok = amx_llm.tokenizer
    a, b, c = (tok.encode(t) for t in ("The river ran north past", "Three ships sailed", "Once upon a time in a"))

    def run(seqs):
        return runner.compute_logits(ScheduledBatch(seqs))

    def table(kv, rid, n):
        kv.allocate(rid, n)
        return kv.block_table(rid)

    kv = KVCacheManager(runner.num_blocks, runner.block_size)
    prompt = lambda rid, ids: ScheduledSeq(rid, ids, 0, table(kv, rid, len(ids) + 1), True, greedy, 0)  # noqa: E731
    alone_a, alone_c = run([prompt("a", a)]), run([prompt("c", c)])
    run([prompt("b", b[:-1])])  # B's prompt but its last token, which it then decodes
    decode_b = ScheduledSeq("b", b[-1:], len(b) - 1, kv.block_table("b"), True, greedy, 1)
    alone_b = run([decode_b])
    kv.free("a"), kv.free("c")
    mixed = run([prompt("a", a), decode_b, prompt("c", c)])
    assert torch.equal(mixed[0], alone_a[0]) and torch.equal(mixed[2], alone_c[0])
    assert torch.equal(mixed[1], alone_b[0])
    off = ScheduledSeq("a", a, 0, kv.block_table("a"), True, greedy, 1)  # output_index 1: the decode path
    assert not torch.equal(run([off])[0], alone_a[0])
