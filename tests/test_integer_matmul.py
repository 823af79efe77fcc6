"""--matmul-dtype int8 / int16: activations quantized to int8 or int16 per 32 k, multiplied into a
GGUF file's integer quants (the C++ GEMM's AVX512-VNNI and AVX2 dot products, and its portable
code); --cpu-isa, which forces one of those paths."""
from __future__ import annotations

import pytest
import torch

from batchserve.config import ConfigError, ModelConfig
from batchserve.request import SamplingParams
from batchserve.runner.kernels import gemm_ext
from batchserve.runner.models.llama import Linear, LlamaModel

from test_quantized_weights import FORMATS, _blocks

pytestmark = [pytest.mark.kernel, pytest.mark.skipif("gemm_ext() is None", reason="no C++ toolchain")]
KINDS = ("Q4_1", "Q8_0", "Q4_0", "Q4_K")  # one scale per 32 k
FMT = {"Q4_1": 0, "Q8_0": 1, "Q4_0": 0, "Q4_K": 0}  # gemm_int's panel layouts
BITS = (8, 16)
TOL = {8: 0.012, 16: 1e-4}  # relative error against the float32 activations' product (measured ~0.006 / ~2.5e-5)
ISAS = {"portable": 0, "avx2": 1, "avx512": 2}  # gemm_int's isa_override codes (avx512: VNNI)


def _int_paths() -> list[int]:
    """The integer code paths this CPU runs (every one up to its best), slowest first."""
    best = ISAS[gemm_ext().int_isa()]
    return [code for code in ISAS.values() if code <= best]


def _quantize_like_the_kernel(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x [M, K] -> what the kernel multiplies: per row and block of 32, round-to-nearest-even of
    x * (qmax / max|x|), times max|x| / qmax (float32 steps, as the C++ does them)."""
    qmax = float(2 ** (bits - 1) - 1)
    xb = x.view(x.shape[0], -1, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(qmax) / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv)  # torch.round rounds half to even, like the CPU's conversion
    return (q.double() * (amax / qmax).double()).view_as(x)


def _k(kind: str, k: int) -> int:
    return (k + 255) // 256 * 256 if kind == "Q4_K" else k  # whole 256-weight super-blocks


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("kind", KINDS)
def test_integer_panels_hold_ggufs_own_dequantization(kind, bits):
    ext = gemm_ext()
    for n, k in ((40, 64), (96, 576), (1, 32)):
        k = _k(kind, k)
        raw, dense = _blocks(n, k, kind)
        wq = ext.pack_int(raw, FORMATS[kind], bits)
        assert wq.shape[:2] == ((n + 31) // 32, k // 32)
        assert torch.equal(ext.unpack_int(wq, n, FMT[kind], bits), dense)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("kind", KINDS)
def test_integer_gemm_is_the_same_on_every_code_path_and_exact_for_the_quantized_activations(kind, bits):
    """AVX-512 VNNI, AVX2 and portable code give the same bits (the integer sums are exact and each
    block's fold is the same two roundings); the result is the float64 product of the weights
    with the activations as the kernel quantizes them (to float32 rounding), and close to the
    product with the float32 activations — the activations' rounding, nothing more (~1 % for
    int8, ~0.01 % for int16)."""
    ext = gemm_ext()
    g = torch.Generator().manual_seed(3)
    paths = _int_paths()
    for n, k in ((70, 96), (960, 576)):
        k = _k(kind, k)
        raw, dense = _blocks(n, k, kind, seed=n)
        wq = ext.pack_int(raw, FORMATS[kind], bits)
        for m in (1, 5, 6, 7, 12, 13, 24, 25, 37, 48, 49, 600, 0):  # tiles of 1-12 rows, 512-row passes
            if m == 600 and n == 960:
                continue
            x = torch.randn(m, k, generator=g)
            got = {p: ext.gemm_int(x, wq, n, FMT[kind], bits, p) for p in paths}
            assert all(y.shape == (m, n) for y in got.values())
            for p in paths[1:]:
                assert torch.equal(got[p], got[paths[0]]), (n, k, m, p)
            if m == 0:
                continue
            y = got[paths[-1]].double()
            exact = _quantize_like_the_kernel(x, bits) @ dense.double().t()
            torch.testing.assert_close(y, exact, rtol=1e-5, atol=1e-6 * k ** 0.5 * dense.abs().max().item())
            full = x.double() @ dense.double().t()
            assert (y - full).norm() / full.norm() < TOL[bits], (n, k, m)
            assert torch.equal(ext.gemm_int(x, wq, n, FMT[kind], bits), got[paths[-1]])  # the default path


@pytest.mark.parametrize("bits", BITS)
def test_non_finite_inputs_give_nan_rows_on_every_path_and_tiny_blocks_contribute_nothing(bits):
    """A NaN or infinity in a row makes that row's outputs NaN (as float32 products would), on the
    AVX-512, AVX2 and portable paths alike, and leaves the other rows as they were; a block whose
    values are too small to scale (act_max / max|x| not finite) contributes 0."""
    ext = gemm_ext()
    raw, dense = _blocks(40, 96, "Q4_1")
    wq = ext.pack_int(raw, 0, bits)
    x = torch.randn(4, 96)
    clean = x.clone()
    x[1, 40] = float("nan")
    x[2, 70] = float("inf")
    x[3, :32] = 1e-38
    paths = _int_paths()
    for p in paths:
        y = ext.gemm_int(x, wq, 40, 0, bits, p)
        assert torch.isnan(y[1]).all() and torch.isnan(y[2]).all(), p
        assert torch.equal(y[0], ext.gemm_int(clean[:1], wq, 40, 0, bits, p)[0])
        tail = clean[3:].clone()
        tail[0, :32] = 0
        assert torch.equal(y[3], ext.gemm_int(tail, wq, 40, 0, bits, p)[0])


@pytest.mark.parametrize("bits", BITS)
def test_integer_gemm_handles_zero_blocks_and_extreme_rows(bits):
    """A row whose block is all zero (scale 0) contributes nothing; a huge row stays accurate
    relative to its size."""
    ext = gemm_ext()
    raw, dense = _blocks(64, 128, "Q4_1")
    wq = ext.pack_int(raw, 0, bits)
    x = torch.randn(3, 128)
    x[0, :32] = 0
    x[1] *= 1e6
    x[2] = 0
    y = ext.gemm_int(x, wq, 64, 0, bits).double()
    full = x.double() @ dense.double().t()
    assert torch.equal(y[2], torch.zeros(64, dtype=torch.float64))
    for r in (0, 1):
        assert (y[r] - full[r]).norm() / full[r].norm() < TOL[bits]


def test_integer_gemm_rejects_bad_input():
    ext = gemm_ext()
    raw, _ = _blocks(40, 64, "Q4_1")
    wq = ext.pack_int(raw, 0)
    with pytest.raises(RuntimeError, match="K=96"):
        ext.gemm_int(torch.randn(2, 96), wq, 40, 0)
    with pytest.raises(RuntimeError, match="n=70"):
        ext.gemm_int(torch.randn(2, 64), wq, 70, 0)
    with pytest.raises(RuntimeError, match="1152"):
        ext.gemm_int(torch.randn(2, 64), wq, 40, 1)  # 4-bit panels read as Q8_0's
    with pytest.raises(RuntimeError, match="format"):
        ext.gemm_int(torch.randn(2, 64), wq, 40, 5)
    with pytest.raises(RuntimeError, match="bits must be 8 or 16, got 4"):
        ext.gemm_int(torch.randn(2, 64), wq, 40, 0, 4)
    with pytest.raises(RuntimeError, match="float32"):
        ext.gemm_int(torch.randn(2, 64, dtype=torch.float64), wq, 40, 0)
    with pytest.raises(RuntimeError, match=r"Q4_K\), got 4"):
        ext.pack_int(raw, 4)  # Q6_K: a scale per 16 k, not taken
    with pytest.raises(RuntimeError, match="bits must be 8 or 16, got 32"):
        ext.pack_int(raw, 0, 32)
    with pytest.raises(RuntimeError, match="raw blocks"):
        ext.pack_int(raw[:, :30], 0)
    with pytest.raises(ValueError, match="source 4"):
        Linear.from_blocks(raw, 4, act_bits=8)


@pytest.mark.parametrize("bits", BITS)
def test_gated_product_is_silu_mul_then_the_product_bit_for_bit(bits):
    """gemm_int(gated) takes [gate | up] and multiplies silu(gate) * up, the SiLU taken while the
    activations are quantized: on every code path and row count (one or more tiles, more than one
    512-row pass) its bits are those of the fused ops' silu_mul followed by the product, saturating
    gates included; Linear.gated does the same; a width other than twice K is refused."""
    from batchserve.runner.kernels import fused_ops_ext

    ext, fused = gemm_ext(), fused_ops_ext()
    if fused is None:
        pytest.skip("no fused ops")
    raw, _ = _blocks(70, 96, "Q4_1", seed=5)
    wq = ext.pack_int(raw, 0, bits)
    paths = _int_paths()
    g = torch.Generator().manual_seed(11)
    for m in (1, 6, 13, 24, 600):
        gu = torch.randn(m, 192, generator=g) * 4
        gu[0, :3] = torch.tensor([100.0, -100.0, -1e4])  # saturating sigmoid on both sides
        want = {p: ext.gemm_int(fused.silu_mul(gu), wq, 70, 0, bits, p) for p in paths}
        for p in paths:
            assert torch.equal(ext.gemm_int(gu, wq, 70, 0, bits, p, True), want[p]), (m, p)
    lin = Linear.from_blocks(raw, 0, act_bits=bits)
    assert lin.takes_gate_up and torch.equal(lin.gated(gu), lin(fused.silu_mul(gu)))
    assert not Linear.from_blocks(raw, 0).takes_gate_up  # float32 products: silu_mul, then the product
    with pytest.raises(RuntimeError, match="gate and up"):
        ext.gemm_int(torch.randn(2, 96), wq, 70, 0, bits, -1, True)


@pytest.mark.parametrize("bits", BITS)
def test_integer_linear_flattens_leading_dims_and_gives_the_dense_weight_back(bits):
    raw, dense = _blocks(48, 64, "Q8_0")
    lin = Linear.from_blocks(raw, 1, act_bits=bits)
    assert (lin.n, lin.k, lin.act_bits, lin.fmt) == (48, 64, bits, 1)
    assert torch.equal(lin.weight, dense)
    x = torch.randn(2, 3, 64)
    assert torch.equal(lin(x), lin(x.view(6, 64)).view(2, 3, 48))


def test_integer_modes_are_validated():
    for mm in ("int8", "int16"):
        with pytest.raises(ConfigError, match="quantized_weights"):
            ModelConfig(matmul_dtype=mm, quantized_weights="off")
        with pytest.raises(ConfigError, match="dtype"):
            ModelConfig(dtype="bfloat16", matmul_dtype=mm)
        assert ModelConfig(matmul_dtype=mm).matmul_dtype == mm
        with pytest.raises(ConfigError, match="device"):
            ModelConfig(matmul_dtype=mm, device="cuda")
        with pytest.raises(ConfigError, match="linear_backend"):
            ModelConfig(matmul_dtype=mm, linear_backend="onednn")
    with pytest.raises(ConfigError, match="matmul_dtype"):
        ModelConfig(matmul_dtype="int4")
    from batchserve.runner.models.llama import LlamaConfig

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=16)
    w = {"model.embed_tokens.weight": torch.randn(64, 32), "model.norm.weight": torch.ones(32)}
    with pytest.raises(ValueError, match="has none"):
        LlamaModel(cfg, w, matmul_dtype=torch.int8)
    q6k_only = {"model.layers.0.mlp.down_proj.weight": (4, torch.zeros(32, 210, dtype=torch.uint8))}
    with pytest.raises(ValueError, match="has none"):  # Q6_K blocks alone: nothing for the integer path
        LlamaModel(cfg, w, matmul_dtype=torch.int16, quantized=q6k_only)


def test_the_cli_flag_reaches_the_config():
    from batchserve.cli import build_parser, engine_config

    for mm in ("int8", "int16"):
        assert engine_config(build_parser().parse_args(["serve", "--matmul-dtype", mm])).model.matmul_dtype == mm


@pytest.mark.model
def test_smollm2_in_integer_modes_stays_close_to_float32():
    """All 121 matrices (Q4_1 layers, the Q8_0 LM head) run as integer dot products. Fed the
    float32 model's greedy answers to chat questions (teacher forcing, through the engine's prefill
    and decode steps): with int16 activations the logits are within 0.1 % of float32's and every
    next token is the same; with int8 (llama.cpp's rounding) nearly every next token is, the
    logits within a few percent. int16 still answers the capital of France as float32 does; int8's
    first token there is a near tie that its rounding may flip, so the forced tokens judge it."""
    from batchserve.engine.engine import tokenize
    from batchserve.llm import LLM
    from benchmarks.variants import QUESTIONS, forced_logits

    # a float32 cache for all three: only the products differ
    llms = {mm: LLM(matmul_dtype=mm, kv_cache_gb=0.05, kv_cache_dtype="float32") for mm in ("float32", "int8", "int16")}
    layers = llms["float32"].engine.executor.model.cfg.num_layers
    assert llms["float32"].engine.executor.model.int_matrices == 0
    for mm, bits in (("int8", 8), ("int16", 16)):
        q = llms[mm].engine.executor.model
        assert q.int_matrices == q.quantized_matrices == 4 * layers + 1
        assert q.layers[0]["wqkv"].act_bits == bits and q.lm_head.act_bits == bits and q.lm_head.fmt == 1
    tok = llms["float32"].tokenizer
    prompts = [tokenize(tok, messages=[{"role": "user", "content": c}]) for c in QUESTIONS[:6]]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    answers = [o.token_ids for o in llms["float32"].generate(prompts, greedy)]
    logits = {mm: torch.cat(forced_logits(llm.engine.executor, prompts, answers)) for mm, llm in llms.items()}
    ref = logits["float32"]
    for mm, max_rel, min_agree in (("int8", 0.1, 0.9), ("int16", 0.001, 1.0)):
        got = logits[mm]
        assert not torch.equal(ref, got)  # the integer path really ran
        rel = (got - ref).abs().amax(-1) / ref.abs().amax(-1)
        assert rel.max() < max_rel, (mm, rel.max())
        assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= min_agree, mm
    answer = llms["int16"].chat([{"role": "user", "content": "What is the capital of France?"}],
                                SamplingParams(max_tokens=16, temperature=0.0))[0]
    assert "Paris" in answer.text


def test_auto_picks_int8_for_gguf_blocks_on_a_vnni_or_avx2_cpu_and_float32_elsewhere():
    """matmul_dtype auto: int8 dot products where they run fast (a GGUF file's blocks, the C++
    GEMM, AVX512-VNNI or AVX2 — this CPU's best, or the path cpu_isa forces); the float32 products
    when the blocks are off, another backend is asked for, the model has no blocks, or the integer
    products would run in portable C++. An explicit dtype is kept."""
    from batchserve.runner.loader import LoadedModel
    from batchserve.runner.model_runner import FAST_INT8_ISAS, resolve_matmul_dtype

    assert FAST_INT8_ISAS == {"avx512", "avx2"}
    best = gemm_ext().int_isa()
    blocks = LoadedModel(config=None, weights={}, tokenizer=None, name="t", quantized={"w": (0, torch.zeros(1, 20, dtype=torch.uint8))})
    q6k = LoadedModel(config=None, weights={}, tokenizer=None, name="t", quantized={"w": (4, torch.zeros(1, 210, dtype=torch.uint8))})
    dense = LoadedModel(config=None, weights={}, tokenizer=None, name="t")
    assert resolve_matmul_dtype(ModelConfig(), blocks) == (torch.int8 if best != "portable" else None)
    if best != "portable":  # an AVX2-only CPU's choice, made here too
        assert resolve_matmul_dtype(ModelConfig(cpu_isa="avx2"), blocks) == torch.int8
    assert resolve_matmul_dtype(ModelConfig(cpu_isa="portable"), blocks) is None
    assert resolve_matmul_dtype(ModelConfig(cpu_isa="portable", matmul_dtype="int8"), blocks) == torch.int8
    assert resolve_matmul_dtype(ModelConfig(matmul_dtype="int16"), blocks) == torch.int16
    assert resolve_matmul_dtype(ModelConfig(), dense) is None
    assert resolve_matmul_dtype(ModelConfig(), q6k) is None  # Q6_K alone: no integer path
    assert resolve_matmul_dtype(ModelConfig(quantized_weights="off"), blocks) is None
    assert resolve_matmul_dtype(ModelConfig(linear_backend="onednn"), blocks) is None
    assert resolve_matmul_dtype(ModelConfig(matmul_dtype="float32"), blocks) is None
    assert resolve_matmul_dtype(ModelConfig(matmul_dtype="int8"), blocks) == torch.int8
    assert resolve_matmul_dtype(ModelConfig(matmul_dtype="bfloat16"), blocks) == torch.bfloat16


needs_avx2 = pytest.mark.skipif("gemm_ext() is None or gemm_ext().int_isa() == 'portable'",
                                reason="no AVX2 integer path on this CPU")


@needs_avx2
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("kind", KINDS)
def test_avx2_integer_path_equals_the_portable_one_for_every_row_count_and_column_tail(kind, bits):
    """The AVX2 tiles (vpmaddubsw / vpmaddwd, a quarter panel per vector, 4 or 6 rows per tile)
    give the portable code's bits for every source format and activation width, for 1 to 70 rows
    (every tile size and remainder) and N with partial last panels (1, 33, 95 columns); the
    result is the float64 product of the quantized activations with the weights, and within the
    activations' rounding of the float32 product."""
    ext = gemm_ext()
    g = torch.Generator().manual_seed(7)
    for n, k in ((1, 96), (33, 96), (95, 576)):
        k = _k(kind, k)
        raw, dense = _blocks(n, k, kind, seed=n + bits)
        wq = ext.pack_int(raw, FORMATS[kind], bits)
        for m in range(1, 71):
            x = torch.randn(m, k, generator=g)
            y = ext.gemm_int(x, wq, n, FMT[kind], bits, ISAS["avx2"])
            assert torch.equal(y, ext.gemm_int(x, wq, n, FMT[kind], bits, ISAS["portable"])), (n, k, m)
            exact = _quantize_like_the_kernel(x, bits) @ dense.double().t()
            torch.testing.assert_close(y.double(), exact, rtol=1e-5, atol=1e-6 * k ** 0.5 * dense.abs().max().item())
            if n > 1:  # one output column can cancel to near zero: no relative bound there
                full = x.double() @ dense.double().t()
                assert (y.double() - full).norm() / full.norm() < TOL[bits], (n, k, m)


def _extreme_blocks(kind: str, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks whose every quant is the largest its format holds (4-bit 15; Q8_0 127, or -128 in
    every other row), and gguf's dequantization of them."""
    import gguf
    import numpy as np

    raw, _ = _blocks(n, k, kind)
    r = raw.numpy().copy()
    if kind == "Q8_0":
        b = r.reshape(n, -1, 34)
        b[:, :, 2:] = 127
        b[1::2, :, 2:] = np.uint8(128)  # int8 -128
    else:
        per, first = {"Q4_1": (20, 4), "Q4_0": (18, 2), "Q4_K": (144, 16)}[kind]
        r.reshape(n, -1, per)[:, :, first:] = 0xFF
    qt = gguf.GGMLQuantizationType[kind]
    return torch.from_numpy(r), torch.from_numpy(gguf.dequantize(r, qt).astype(np.float32))


@needs_avx2
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("kind", KINDS)
def test_avx2_integer_sums_do_not_saturate_at_the_extremes(kind, bits):
    """The bound the AVX2 tile's comment proves, at its edge: every weight quant at its largest
    (a Q8_0 byte 255: both nibbles 15) times activations all at +-127 (+-32767), of one sign over
    whole blocks or alternating: each int16 lane reaches 30,480, and the output is still the
    portable path's and the exact product's. Multiplying whole Q8_0 bytes in vpmaddubsw would
    saturate here."""
    ext = gemm_ext()
    n, k = 40, _k(kind, 128)
    raw, dense = _extreme_blocks(kind, n, k)
    wq = ext.pack_int(raw, FORMATS[kind], bits)
    signs = torch.ones(k)
    x = torch.stack([signs, -signs, signs * torch.tensor([1.0, -1.0]).repeat(k // 2),
                     torch.where(torch.arange(k) // 32 % 2 == 0, 1.0, -1.0), torch.randn(k)])
    y = ext.gemm_int(x, wq, n, FMT[kind], bits, ISAS["avx2"])
    assert torch.equal(y, ext.gemm_int(x, wq, n, FMT[kind], bits, ISAS["portable"]))
    exact = _quantize_like_the_kernel(x, bits) @ dense.double().t()
    torch.testing.assert_close(y.double(), exact, rtol=1e-5, atol=1e-6 * k ** 0.5 * dense.abs().max().item())


def test_cpu_isa_is_validated_and_reaches_the_config():
    """--cpu-isa takes auto, avx512, avx2 or portable, on the CPU only; a path the CPU lacks is
    refused naming cpu_isa (what an AVX2-only CPU answers for avx512, and for the integer path's
    avx512, which needs VNNI); a path at or below the CPU's best is taken."""
    from batchserve.cli import build_parser, engine_config
    from batchserve.runner.models.llama import ISA_CODES, cpu_isa_in_use, pick_cpu_isa

    with pytest.raises(ConfigError, match="cpu_isa"):
        ModelConfig(cpu_isa="sse4")
    with pytest.raises(ConfigError, match="cpu_isa: .*device cpu"):
        ModelConfig(cpu_isa="avx2", device="cuda")
    assert ModelConfig(device="cuda").cpu_isa == "auto"
    for isa in ("auto", "avx512", "avx2", "portable"):
        assert engine_config(build_parser().parse_args(["serve", "--cpu-isa", isa])).model.cpu_isa == isa
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--cpu-isa", "sse4"])
    with pytest.raises(ConfigError, match="cpu_isa: this CPU has no avx512 path .* best it has: avx2"):
        pick_cpu_isa("avx512", "avx2")
    with pytest.raises(ConfigError, match="cpu_isa: .*AVX512-VNNI"):
        pick_cpu_isa("avx512", "avx2", integer=True)
    with pytest.raises(ConfigError, match="cpu_isa: this CPU has no avx2"):
        pick_cpu_isa("avx2", "portable")
    assert [pick_cpu_isa(i, "avx512") for i in ("auto", "avx512", "avx2", "portable")] == [
        "avx512", "avx512", "avx2", "portable"]
    assert pick_cpu_isa("auto", "avx2") == "avx2"
    with pytest.raises(ConfigError, match="cpu_isa: must be"):
        cpu_isa_in_use("sse4")
    # this CPU: each path up to its best is taken, one beyond it is refused by the model
    from batchserve.runner.loader import load_model
    from batchserve.runner.profiler import TINY_MODEL

    loaded = load_model(ModelConfig(model="dummy", dummy_config=TINY_MODEL))
    best = gemm_ext().isa()
    for isa in ("avx512", "avx2", "portable"):
        if ISA_CODES[isa] > ISA_CODES[best]:
            with pytest.raises(ConfigError, match="cpu_isa"):
                LlamaModel(loaded.config, loaded.weights, "cpp", cpu_isa=isa)
        else:
            assert cpu_isa_in_use(isa) == isa
            assert LlamaModel(loaded.config, loaded.weights, "cpp", cpu_isa=isa).lm_head.isa == ISA_CODES[isa]


@pytest.mark.model
@needs_avx2
def test_smollm2_on_the_avx2_path_gives_the_portable_paths_logits():
    """cpu_isa forces the whole model onto one code path of the C++ products. With int8 products
    (all 121 matrices) the AVX2 and the portable runs give the same logits bit for bit, so the
    same greedy tokens; with float32 products from the blocks (linear_backend cpp) the same greedy
    tokens, the logits within float32 summation rounding."""
    from batchserve.engine.engine import tokenize
    from batchserve.llm import LLM
    from benchmarks.variants import QUESTIONS, forced_logits

    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for mm, backend in (("int8", "auto"), ("float32", "cpp")):
        llms = {isa: LLM(matmul_dtype=mm, linear_backend=backend, cpu_isa=isa, kv_cache_gb=0.05,
                         kv_cache_dtype="float32") for isa in ("avx2", "portable")}
        for isa, llm in llms.items():
            model = llm.engine.executor.model
            assert model.cpu_isa == isa and model.linear_backend == "cpp"
            assert model.int_matrices == (4 * model.cfg.num_layers + 1 if mm == "int8" else 0)
            assert {model.layers[0]["wqkv"].isa, model.layers[-1]["w_down"].isa, model.lm_head.isa} == {ISAS[isa]}
        tok = llms["portable"].tokenizer
        prompts = [tokenize(tok, messages=[{"role": "user", "content": c}]) for c in QUESTIONS[:3]]
        answers = {isa: [o.token_ids for o in llm.generate(prompts, greedy)] for isa, llm in llms.items()}
        assert answers["avx2"] == answers["portable"], mm
        logits = {isa: torch.cat(forced_logits(llm.engine.executor, prompts, answers["portable"]))
                  for isa, llm in llms.items()}
        if mm == "int8":
            assert torch.equal(logits["avx2"], logits["portable"])
        else:
            ref = logits["portable"]
            assert ((logits["avx2"] - ref).abs().amax(-1) / ref.abs().amax(-1)).max() < 1e-4
