"""The matrix-product backends (C++ panel GEMM, oneDNN on packed weights) against F.linear."""
from __future__ import annotations

import pytest
import torch

from batchserve.config import ConfigError, ModelConfig
from batchserve.runner.kernels import gemm_ext
from batchserve.runner.loader import load_model
from batchserve.runner.models.llama import (Linear, LlamaModel, best_linear_backend, cpp_linear_ok,
                                            onednn_linear_ok)
from batchserve.runner.profiler import TINY_MODEL

pytestmark = pytest.mark.kernel

BACKENDS = [b for b, ok in (("cpp", cpp_linear_ok(torch.zeros(1))), ("onednn", onednn_linear_ok(torch.zeros(1))))
            if ok]


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_linear_matches_f_linear_and_unpacks_exactly(backend):
    w = torch.randn(96, 64)
    lin = Linear(w, backend)
    for rows in (1, 7, 64):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(lin(x), x @ w.t(), rtol=1e-5, atol=1e-4)
    assert torch.equal(lin.weight, w)


def _ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double().t()).float()


@pytest.mark.skipif("gemm_ext() is None", reason="no C++ toolchain")
@pytest.mark.parametrize("isa", ["portable", "avx2", "avx512"])
def test_panel_gemm_every_code_path_matches_float64(isa):
    """Each code path the module holds (the one this CPU picks and the slower ones), over shapes
    that hit every row-block size, a partial last panel, a K that is not a multiple of anything,
    rows past the 512-row chunk, and no rows at all."""
    ext = gemm_ext()
    order = ["portable", "avx2", "avx512"]
    if order.index(isa) > order.index(ext.isa()):
        pytest.skip(f"this CPU has no {isa}")
    g = torch.Generator().manual_seed(0)
    for m, n, k in [(1, 576, 576), (5, 33, 100), (14, 32, 7), (15, 17, 3), (32, 960, 576), (29, 64, 1536),
                    (600, 70, 65), (0, 32, 8)]:
        w = torch.randn(n, k, generator=g)
        x = torch.randn(m, k, generator=g)
        y = ext.gemm(x, ext.pack(w), n, order.index(isa))
        assert y.shape == (m, n)
        torch.testing.assert_close(y, _ref(x, w), rtol=1e-5, atol=1e-4 * k ** 0.5)


@pytest.mark.skipif("gemm_ext() is None", reason="no C++ toolchain")
def test_panel_gemm_layout_and_errors():
    ext = gemm_ext()
    w = torch.arange(40 * 3, dtype=torch.float32).view(40, 3)
    p = ext.pack(w)
    assert p.shape == (2, 3, 32)  # 40 columns -> two panels, the second zero-padded
    assert torch.equal(p[0, :, 5], w[5]) and torch.equal(p[1, :, 7], w[39]) and not p[1, :, 8:].any()
    lin = Linear(w, "cpp")
    x3 = torch.randn(2, 4, 3)  # leading dims are flattened and restored
    torch.testing.assert_close(lin(x3), x3 @ w.t())
    xt = torch.randn(3, 5).t()  # non-contiguous input
    torch.testing.assert_close(lin(xt), xt @ w.t(), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="K=4"):
        ext.gemm(torch.randn(2, 4), p, 40, -1)
    with pytest.raises(RuntimeError, match="n=70"):
        ext.gemm(torch.randn(2, 3), p, 70, -1)
    with pytest.raises(RuntimeError, match="float32"):
        ext.gemm(torch.randn(2, 3, dtype=torch.float64), p, 40, -1)


def test_model_logits_agree_across_linear_backends():
    loaded = load_model(ModelConfig(model="dummy", dummy_config=TINY_MODEL))
    torch_model = LlamaModel(loaded.config, loaded.weights, "torch")
    auto_model = LlamaModel(loaded.config, loaded.weights, "auto")
    assert torch_model.linear_backend == "torch"
    assert auto_model.linear_backend == best_linear_backend(loaded.weights["model.norm.weight"])
    h = torch.randn(5, loaded.config.hidden_size)
    torch.testing.assert_close(auto_model.logits(h), torch_model.logits(h), rtol=1e-4, atol=1e-4)
    for backend in BACKENDS:
        m = LlamaModel(loaded.config, loaded.weights, backend)
        assert m.linear_backend == backend and m.layers[0]["wqkv"].backend == backend
        torch.testing.assert_close(m.logits(h), torch_model.logits(h), rtol=1e-4, atol=1e-4)


def test_backends_refused_where_they_cannot_run():
    loaded = load_model(ModelConfig(model="dummy", dummy_config=TINY_MODEL, dtype="bfloat16"))
    with pytest.raises(RuntimeError, match="linear_backend=onednn"):
        LlamaModel(loaded.config, loaded.weights, "onednn")
    with pytest.raises(RuntimeError, match="linear_backend=cpp"):
        LlamaModel(loaded.config, loaded.weights, "cpp")
    assert LlamaModel(loaded.config, loaded.weights, "auto").linear_backend == "torch"
    with pytest.raises(ConfigError, match="linear_backend"):
        ModelConfig(linear_backend="mkl")
    with pytest.raises(ValueError, match="unknown linear backend"):
        Linear(torch.zeros(2, 2), "mkl")


@pytest.mark.skipif("gemm_ext() is None or not gemm_ext().has_bf16()", reason="no AVX512-BF16 here")
def test_panel_gemm_bf16_matches_rounded_inputs():
    """The bf16 path: weights and x rounded to bf16, products summed in fp32, fp32 out; x given
    as fp32 or bf16, odd K (a padded last pair), several row blocks and row passes."""
    ext = gemm_ext()
    g = torch.Generator().manual_seed(1)
    for m, n, k in [(1, 576, 576), (5, 33, 101), (32, 960, 576), (29, 64, 1536), (300, 40, 64), (0, 32, 8)]:
        w = torch.randn(n, k, generator=g)
        x = torch.randn(m, k, generator=g)
        wp = ext.pack_bf16(w)
        assert wp.dtype == torch.bfloat16 and wp.shape == (-(-n // 32), -(-k // 2), 64)
        ref = _ref(x.bfloat16().float(), w.bfloat16().float())
        for xin in (x, x.bfloat16()):
            y = ext.gemm_bf16(xin, wp, n)
            assert y.dtype == torch.float32 and y.shape == (m, n)
            torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4 * k ** 0.5)
    for k in (6, 7):  # unpacks exactly, with an odd K too
        w = torch.randn(40, k)
        assert torch.equal(Linear(w.bfloat16(), "cpp").weight, w.bfloat16())
    with pytest.raises(RuntimeError, match="K=10"):
        ext.gemm_bf16(torch.randn(2, 10), ext.pack_bf16(w), 40)


def test_bf16_matmul_mode_picks_the_cpp_bf16_path_where_it_runs():
    from batchserve.runner.models.llama import cpp_bf16_ok

    loaded = load_model(ModelConfig(model="dummy", dummy_config=TINY_MODEL))
    fp32 = LlamaModel(loaded.config, loaded.weights, "torch")
    for backend in BACKENDS:
        m = LlamaModel(loaded.config, loaded.weights, backend, matmul_dtype=torch.bfloat16)
        # oneDNN's packed bf16 where it runs bf16 (AVX512BW-class CPUs), else F.linear
        want = "cpp" if backend == "cpp" and cpp_bf16_ok() else \
            "onednn" if onednn_linear_ok(torch.zeros(1), torch.bfloat16) else "torch"
        assert m.layers[0]["wqkv"].backend == want and m.lm_head.backend == backend
        h = torch.randn(3, loaded.config.hidden_size)
        x = m.layers[0]["w_down"](torch.randn(3, loaded.config.intermediate_size).bfloat16())
        assert x.shape == (3, loaded.config.hidden_size)
        torch.testing.assert_close(m.logits(h), fp32.logits(h), rtol=1e-4, atol=1e-4)  # the head stays fp32


@pytest.mark.skipif("gemm_ext() is None", reason="no C++ toolchain")
def test_panel_gemm_releases_the_gil():
    """The C++ kernels run without the GIL, as torch's ops do, so the server's event loop keeps
    running while the engine thread is inside one: a Python loop in this thread must keep
    ticking through a ~0.3 s product in another thread."""
    import threading
    import time

    ext = gemm_ext()
    x, wp = torch.randn(6144, 2048), ext.pack(torch.randn(4096, 2048))
    done = threading.Event()
    took = []

    def work():
        t = time.perf_counter()
        ext.gemm(x, wp, 4096)
        took.append(time.perf_counter() - t)
        done.set()

    worker = threading.Thread(target=work)
    last, gap = time.perf_counter(), 0.0
    worker.start()
    while not done.is_set():  # a held GIL would stall this loop for the whole call
        now = time.perf_counter()
        gap, last = max(gap, now - last), now
    worker.join()
    assert took[0] > 0.1, "the product was too short to tell"
    assert gap < took[0] / 3, f"this thread stalled {gap:.3f} s of a {took[0]:.3f} s kernel call: GIL held"


@pytest.mark.skipif("gemm_ext() is None", reason="no C++ toolchain")
def test_cpu_isa_reaches_every_cpp_product_and_auto_judges_as_that_cpu_would():
    """A Linear's `isa` is the code path its C++ product runs (an unknown one is refused by the
    kernel, so the code travels to it); a model built with cpu_isa puts it on every matrix and
    gives the float64 logits on each path; with avx2 or portable, linear_backend auto picks as a
    CPU without AVX-512 does (oneDNN), and bf16 products leave the AVX512-BF16 path."""
    from batchserve.runner.models.llama import ISA_CODES, cpp_bf16_ok

    from test_quantized_weights import _blocks

    ext = gemm_ext()
    w, x = torch.randn(40, 64), torch.randn(3, 64)
    with pytest.raises(RuntimeError, match="code path 3"):
        Linear(w, "cpp", isa=3)(x)
    raw, dense = _blocks(40, 64, "Q4_1")
    for bits in (0, 8):
        with pytest.raises(RuntimeError, match="code path 3"):
            Linear.from_blocks(raw, 0, act_bits=bits, isa=3)(x)
    order = ["portable", "avx2", "avx512"]
    paths = order[: order.index(ext.isa()) + 1]
    loaded = load_model(ModelConfig(model="dummy", dummy_config=TINY_MODEL))
    ref = LlamaModel(loaded.config, loaded.weights, "torch")
    h = torch.randn(5, loaded.config.hidden_size)
    fp32 = loaded.weights["model.norm.weight"]
    for isa in paths:
        code = ISA_CODES[isa]
        lin = Linear(w, "cpp", isa=code)
        assert lin.isa == code and torch.equal(lin(x), ext.gemm(x, ext.pack(w), 40, code))
        torch.testing.assert_close(lin(x), x @ w.t(), rtol=1e-5, atol=1e-4)
        q = Linear.from_blocks(raw, 0, isa=code)
        assert torch.equal(q(x), ext.gemm_q(x, q.w, 40, 0, code))
        torch.testing.assert_close(q(x), x @ dense.t(), rtol=1e-5, atol=1e-4)
        m = LlamaModel(loaded.config, loaded.weights, "cpp", cpu_isa=isa)
        assert m.cpu_isa == isa and {m.layers[0]["wqkv"].isa, m.layers[-1]["w_down"].isa, m.lm_head.isa} == {code}
        torch.testing.assert_close(m.logits(h), ref.logits(h), rtol=1e-4, atol=1e-4)
        auto = LlamaModel(loaded.config, loaded.weights, "auto", cpu_isa=isa)
        assert auto.linear_backend == best_linear_backend(fp32, isa)
        if isa != "avx512":
            assert best_linear_backend(fp32, isa) == ("onednn" if onednn_linear_ok(fp32) else "torch")
            assert not cpp_bf16_ok(isa)
            bf = LlamaModel(loaded.config, loaded.weights, "cpp", matmul_dtype=torch.bfloat16, cpu_isa=isa)
            assert bf.layers[0]["wqkv"].backend == ("onednn" if onednn_linear_ok(fp32, torch.bfloat16) else "torch")
    assert best_linear_backend(fp32, "auto") == best_linear_backend(fp32)
