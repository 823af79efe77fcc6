"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds.

All rows of a step are sampled together. A sampled row is one draw by inverse CDF: a uniform u in
(0, 1) picks the first token, in vocabulary order, whose running mass exceeds u times the mass
kept after the top-k and top-p cuts. A seeded request takes its u from a generator keyed by
(seed, output index), so its tokens do not depend on which other requests share the step, nor on
preemption; the others take theirs from the engine's generator.

On the CPU the C++ kernel (`sample_rows` in runner/csrc/fused_ops.cpp) does every row in one
call; PyTorch ops do the same computation elsewhere (batched, no per-row loop)."""
from __future__ import annotations

import torch

from batchserve.request import SamplingParams

_MASK = 2**63 - 1


def _generator(seed: int, index: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed((seed * 1_000_003 + index) & _MASK)


# torch.rand gives multiples of 2^-53 in [0, 1); half a step more keeps u off 0, where the inverse
# CDF would pick the first token with any weight whatever its probability.
_HALF_STEP = 2.0**-54


def _uniforms(params: list[SamplingParams], output_index: list[int], generator: torch.Generator) -> torch.Tensor:
    """One uniform in (0, 1) per row (CPU, float64)."""
    u = torch.full((len(params),), 0.5, dtype=torch.float64)
    free = [i for i, p in enumerate(params) if p.seed is None and not p.greedy]
    if free:
        u[free] = torch.rand(len(free), generator=generator, device=generator.device, dtype=torch.float64).cpu()
    for i, p in enumerate(params):
        if p.seed is not None and not p.greedy:
            u[i] = torch.rand(1, generator=_generator(p.seed, output_index[i], torch.device("cpu")),
                              dtype=torch.float64).item()
    return u + _HALF_STEP


def sample(logits: torch.Tensor, params: list[SamplingParams], output_index: list[int],
           generator: torch.Generator, kernel=None) -> list[int]:
    """logits: [S, V] float32, one row per sequence to sample. Returns S token ids. `kernel`: the
    fused-ops module to use (default: the compiled one where logits are on the CPU, if it built)."""
    if kernel is None and logits.device.type == "cpu" and logits.dtype == torch.float32:
        from batchserve.runner.kernels import fused_ops_ext

        kernel = fused_ops_ext()
    greedy = all(p.greedy for p in params)
    if greedy and kernel is None:
        return logits.argmax(dim=-1).tolist()
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32)
    ks = torch.tensor([p.top_k for p in params], dtype=torch.long)
    ps = torch.tensor([p.top_p for p in params], dtype=torch.float32)
    u = _uniforms(params, output_index, generator)  # greedy rows get 0.5, unused
    if kernel is not None:
        return kernel.sample_rows(logits, temps, ks, ps, u).tolist()
    return sample_torch(logits, temps, ks, ps, u).tolist()


def sample_torch(logits: torch.Tensor, temps: torch.Tensor, ks: torch.Tensor, ps: torch.Tensor,
                 u: torch.Tensor) -> torch.Tensor:
    """The C++ `sample_rows` in PyTorch ops, on the logits' device. Returns [S] int64."""
    dev = logits.device
    temps, ks, ps, u = temps.to(dev).float(), ks.to(dev), ps.to(dev), u.to(dev).double()
    logits = logits.float()
    out = logits.argmax(dim=-1)  # greedy rows, and rows with nothing to draw from (as the kernel)
    m = logits.max(dim=-1).values
    inv_t = 1.0 / temps
    rows = ((temps > 0) & torch.isfinite(m) & torch.isfinite(inv_t)).nonzero().flatten()
    if rows.numel() == 0:
        return out
    x = logits[rows]
    V = x.shape[-1]
    k = ks[rows]
    cut_k = (k > 0) & (k < V)
    keep = torch.ones_like(x, dtype=torch.bool)
    if cut_k.any():  # keep the top_k largest, and ties with the k-th
        kk = torch.where(cut_k, k, torch.ones_like(k))
        kth = torch.topk(x, int(kk.max()), dim=-1).values.gather(1, (kk - 1)[:, None])
        keep = ~cut_k[:, None] | (x >= kth)
    z = (x - m[rows, None]) * inv_t[rows, None]
    w = torch.where(keep & (z >= -87.0), torch.exp(z), torch.zeros_like(z))  # the max gets 1
    p = ps[rows]
    if (p < 1).any():  # the most likely tokens until the mass before one exceeds top_p; ties with the last kept
        sw = torch.sort(w, dim=-1, descending=True).values
        before = sw.cumsum(-1) - sw
        n_kept = (before <= p[:, None] * sw.sum(-1, keepdim=True)).sum(-1).clamp(min=1)
        cut = torch.where(p < 1, sw.gather(1, (n_kept - 1)[:, None])[:, 0], torch.zeros_like(p))
        w = torch.where(w >= cut[:, None], w, torch.zeros_like(w))
    cdf = w.double().cumsum(-1)
    target = u[rows] * cdf[:, -1]
    out[rows] = torch.searchsorted(cdf, target[:, None], right=True)[:, 0].clamp(max=V - 1)
    return out
