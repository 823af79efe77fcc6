"""Token sampling: the C++ kernel (`sample_rows`) and the PyTorch path against float64 references
of greedy, temperature, top-k and top-p, with the uniforms laid on a grid so that the draws'
frequencies are the distribution's exactly (up to one draw per token)."""
import math

import pytest
import torch

from batchserve.request import SamplingParams
from batchserve.runner.kernels import fused_ops_ext
from batchserve.runner.sampler import sample, sample_torch


def _paths():
    ext = fused_ops_ext()
    paths = [("torch", sample_torch)]
    if ext is not None:
        paths.append(pytest.param("cpp", ext.sample_rows, marks=pytest.mark.kernel))
    return paths


PATHS = _paths()


def reference_probs(x: list[float], t: float, k: int, p: float) -> list[float]:
    """softmax(x / t) over the top-k (ties with the k-th kept), then over the most likely tokens
    until the mass before one exceeds p (ties with the last kept kept), renormalised; float64."""
    v = len(x)
    thr = sorted(x, reverse=True)[k - 1] if 0 < k < v else -math.inf
    m = max(x)
    w = [math.exp((xi - m) / t) if xi >= thr and xi != -math.inf else 0.0 for xi in x]
    if p < 1:
        total = sum(w)
        order = sorted(range(v), key=lambda j: -w[j])
        acc, cut = 0.0, 0.0
        for j in order:
            if acc > p * total:
                break
            acc += w[j]
            cut = w[j]
        w = [wi if wi >= cut else 0.0 for wi in w]
    total = sum(w)
    return [wi / total for wi in w]


CASES = [  # temperature, top_k, top_p
    (1.0, 0, 1.0), (0.5, 0, 1.0), (1.7, 0, 1.0), (1.0, 3, 1.0), (1.0, 0, 0.8), (0.8, 4, 0.7), (1.0, 1, 1.0),
    (1.0, 0, 0.05), (1.0, 20, 1.0), (1.0, 37, 1.0),
]


@pytest.mark.parametrize("name,fn", PATHS)
@pytest.mark.parametrize("t,k,p", CASES)
def test_draws_have_the_distribution_of_the_cuts(name, fn, t, k, p):
    # 37 tokens, 29 of them masked (-inf) and spread out: the kernel's 16-wide body and its tail both run
    x = [float("-inf")] * 37
    for pos, val in zip((0, 5, 16, 17, 20, 31, 32, 36), (1.3, -0.4, 2.2, 0.9, 2.2, -3.0, 0.0, 1.9)):
        x[pos] = val
    want = reference_probs(x, t, k, p)
    n = 20000
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n  # a grid: token j takes n * p_j of the draws, +-1
    logits = torch.tensor([x] * n, dtype=torch.float32)
    got = fn(logits, torch.full((n,), t), torch.full((n,), k, dtype=torch.long), torch.full((n,), p), u)
    counts = torch.bincount(got, minlength=len(x)).tolist()
    for j, (c, q) in enumerate(zip(counts, want)):
        assert abs(c - n * q) <= 2, (name, j, counts, [round(n * q, 1) for q in want])


@pytest.mark.parametrize("name,fn", PATHS)
def test_greedy_is_the_first_largest_and_masked_tokens_are_never_drawn(name, fn):
    x = torch.tensor([[0.5, 3.0, 3.0, -1.0],  # ties: the first
                      [float("-inf"), 2.0, float("-inf"), 1.0],
                      [0.0, float("nan"), 5.0, float("nan")]])  # a NaN counts as the largest, as in torch.argmax
    zeros = torch.zeros(3)
    got = fn(x, zeros, torch.zeros(3, dtype=torch.long), torch.ones(3), zeros).tolist()
    assert got == [1, 1, 1] == x.argmax(-1).tolist()
    row = torch.tensor([[float("-inf"), 2.0, float("-inf"), 1.0]] * 1000)
    u = torch.rand(1000, generator=torch.Generator().manual_seed(3))
    drawn = fn(row, torch.full((1000,), 2.0), torch.zeros(1000, dtype=torch.long), torch.ones(1000), u)
    assert set(drawn.tolist()) == {1, 3}


@pytest.mark.parametrize("name,fn", PATHS)
@pytest.mark.parametrize("V", [63, 64, 65, 200, 49152])
def test_greedy_finds_the_first_largest_anywhere_in_a_wide_row(name, fn, V):
    """Greedy rows as wide as a vocabulary, so that the kernel's 64- and 16-wide loops and its tail
    all hold the answer in some row: ties (the first wins), a NaN (the first NaN wins, as in
    torch.argmax), an all -inf row."""
    g = torch.Generator().manual_seed(V)
    x = torch.randn(12, V, generator=g)
    spots = [0, V // 3, V - 17, V - 16, V - 1, 15, 16, 47, 48]
    for r, j in enumerate(spots):
        j = min(max(j, 0), V - 1)
        x[r, j] = 10.0
        x[r, min(j + 5, V - 1)] = 10.0  # a tie after it
    x[9, 20 % V], x[9, (V - 3) % V], x[9, V // 2] = float("nan"), float("nan"), 50.0
    x[10] = float("-inf")
    x[11, V // 2:] = float("-inf")
    zeros = torch.zeros(12)
    got = fn(x, zeros, torch.zeros(12, dtype=torch.long), torch.ones(12), zeros).tolist()
    assert got == x.argmax(-1).tolist()


@pytest.mark.kernel
@pytest.mark.parametrize("V", [1, 7, 16, 17, 255, 257, 4099, 49152])
def test_kernel_matches_the_pytorch_path(V):
    """Rows of V logits (the kernel's vector body, its scalar tail and its 256-token blocks, whole
    and in part) with every mix of settings, including top-k at and past the vocabulary, ties, and
    a top-p so small it keeps one token: the two paths draw the same tokens."""
    ext = fused_ops_ext()
    if ext is None:
        pytest.skip("C++ toolchain not available here")
    g = torch.Generator().manual_seed(V)
    settings = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 0, 0.9), (0.7, 50, 0.9), (1.0, 50, 1.0), (1.3, 1, 1.0),
                (1.0, V, 1.0), (1.0, V + 7, 0.95), (0.2, 0, 1e-6), (2.0, 0, 0.5), (1e-4, 0, 1.0), (1.0, 3, 1.0)] * 3
    n = len(settings)
    logits = torch.randn(n, V, generator=g) * 3
    logits[::4] *= 0.1  # flat rows: top-p keeps thousands of tokens
    logits[1::5] = logits[1::5].round()  # ties
    logits[2::7, ::3] = float("-inf")
    temps = torch.tensor([s[0] for s in settings])
    ks = torch.tensor([s[1] for s in settings])
    ps = torch.tensor([s[2] for s in settings])
    u = torch.rand(n, generator=g, dtype=torch.float64)
    assert ext.sample_rows(logits, temps, ks, ps, u).tolist() == sample_torch(logits, temps, ks, ps, u).tolist()


@pytest.mark.parametrize("name,fn", PATHS)
def test_rows_with_nothing_to_draw_from_go_to_the_largest(name, fn):
    """A +inf logit, a temperature whose inverse overflows, and huge logits at a small temperature
    all put the mass on the largest logit; a NaN row gives its first NaN and an all -inf row token
    0, as argmax does; a u near 0 does not pick a token far below the max; top_p <= 0 keeps one."""
    inf, nan = float("inf"), float("nan")
    x = torch.randn(8, 300, generator=torch.Generator().manual_seed(0))
    x[0, 250] = inf
    x[1, 123] = 9.0
    x[2, 77] = 1e36
    x[3, 40], x[3, 200] = nan, nan
    x[4] = -inf
    x[5, 0], x[5, 299] = -200.0, 12.0  # token 0 is e^-2120 as likely at t = 0.1
    x[6, 9] = 30.0
    temps = torch.tensor([1.0, 1e-39, 1e-3, 1.0, 1.0, 0.1, 1.0, 1.0])
    ps = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    u = torch.tensor([0.5, 0.5, 0.5, 0.5, 0.5, 1e-300, 0.99, 1 - 1e-16], dtype=torch.float64)
    got = fn(x, temps, torch.zeros(8, dtype=torch.long), ps, u).tolist()
    assert got[:7] == [250, 123, 77, 40, 0, 299, 9]
    assert 0 <= got[7] < 300 and x[7, got[7]] > x[7].max() - 20  # u just below 1: a real token



@pytest.mark.kernel  # sample() picks the compiled kernel on the CPU
def test_seeded_rows_do_not_depend_on_their_neighbours():
    torch.manual_seed(0)
    logits = torch.randn(3, 1000)
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=42)
    alone = sample(logits[1:2], [seeded], [5], torch.Generator().manual_seed(1))
    together = sample(logits, [SamplingParams(temperature=0.8), seeded, SamplingParams(temperature=0.0)], [0, 5, 0],
                      torch.Generator().manual_seed(2))
    assert together[1] == alone[0]
    assert together[2] == int(logits[2].argmax())
    # the next output index draws anew
    draws = {sample(logits[1:2], [seeded], [i], torch.Generator())[0] for i in range(40)}
    assert len(draws) > 5
