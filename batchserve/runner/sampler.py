"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds.

All rows of a step are sampled together. A sampled row is one draw by inverse CDF: a uniform u in
(0, 1) picks the first token, in vocabulary order, whose running mass exceeds u times the mass
kept after the top-k and top-p cuts. A seeded request takes its u from a generator keyed by
(seed, output index), so its tokens do not depend on which other requests share the step, nor on
preemption; the others take theirs from the engine's generator.

Before that, the rows of requests that ask for them get their logit adjustments (logit_bias,
min_tokens, penalties, min_p; see SamplingParams), on just those rows: a batch where no request
asks for any does no extra work. Rows under a structured-output constraint then get -inf for
every token their grammar does not allow.

On the CPU the C++ kernel (`sample_rows` in runner/csrc/fused_ops.cpp) does every row in one
call; PyTorch ops do the same computation elsewhere (batched, no per-row loop)."""
from __future__ import annotations

import numpy as np
import torch

from batchserve.core.batch import TokenLogprob
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


def adjust_logits(logits: torch.Tensor, params: list[SamplingParams], output_index: list[int],
                  history: list | None = None, eos_token_id: int | None = None) -> torch.Tensor:
    """logits [S, V] with each row's adjustments applied (SamplingParams, in vLLM's order), in
    float32 or float64 (a half dtype is widened to float32); rows that ask for none are left as
    they are, and the rows that do are written in place when the dtype is kept. `history[i]`:
    (prompt ids, output ids) of row i, for rows whose params are `penalized` (None or missing:
    no tokens yet). Token ids outside the vocabulary are ignored."""
    rows = [i for i, p in enumerate(params) if p.adjusts_logits]
    if not rows:
        return logits
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    dev, V = logits.device, logits.shape[-1]
    x = logits[rows]
    ps = [params[i] for i in rows]
    bias = [(j, t, b) for j, p in enumerate(ps) for t, b in p.logit_bias if t < V]
    if bias:
        j, t, b = zip(*bias)
        x.index_put_((torch.tensor(j, device=dev), torch.tensor(t, device=dev)),
                     torch.tensor(b, dtype=x.dtype, device=dev), accumulate=True)
    banned = [(j, t) for j, p in enumerate(ps) if output_index[rows[j]] < p.min_tokens
              for t in (*p.stop_token_ids, *(() if p.ignore_eos or eos_token_id is None else (eos_token_id,)))
              if t < V]
    if banned:
        j, t = zip(*banned)
        x[torch.tensor(j, device=dev), torch.tensor(t, device=dev)] = -torch.inf
    pen = [j for j, p in enumerate(ps) if p.penalized]
    if pen:
        x[pen] = _penalize(x[pen], [ps[j] for j in pen], [(history[rows[j]] if history else None) or ((), ())
                                                          for j in pen])
    mp = [j for j, p in enumerate(ps) if p.min_p > 0 and not p.greedy]
    if mp:  # prob < min_p * max prob, after temperature: logit < max + T * log(min_p)
        y = x[mp]
        t = torch.tensor([ps[j].temperature for j in mp], dtype=x.dtype, device=dev)
        lm = torch.log(torch.tensor([ps[j].min_p for j in mp], dtype=x.dtype, device=dev))
        thr = y.max(dim=-1).values + t * lm
        x[mp] = torch.where(y >= thr[:, None], y, torch.full_like(y, -torch.inf))
    logits[rows] = x
    return logits


def apply_masks(logits: torch.Tensor, rows: list[int], masks: list) -> torch.Tensor:
    """logits with logits[r, t] = -inf for every token t the bitmask of row r leaves out (int32
    words, bit t % 32 of word t // 32: ScheduledSeq.allowed), in place."""
    V = logits.shape[-1]
    bits = np.unpackbits(np.stack(masks).view(np.uint8), axis=1, bitorder="little")[:, :V]
    idx = torch.tensor(rows, device=logits.device)
    logits[idx] = logits[idx].masked_fill(torch.from_numpy(bits == 0).to(logits.device), -torch.inf)
    return logits


def log_probs(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """log-softmax of these rows of the model's logits, in float32: what logprobs report. Taken
    before `sample`, which may overwrite adjusted rows in place."""
    return torch.log_softmax(logits[rows].float(), dim=-1)


def token_logprobs(lp: torch.Tensor, tokens: list[int], tops: list[int]) -> list[TokenLogprob]:
    """Row i of `lp` (log_probs): the logprob of tokens[i] and the tops[i] most likely tokens."""
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0].tolist()
    k = max(tops)
    top_v, top_i = (lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long()))
    top_v, top_i = top_v.tolist(), top_i.tolist()
    return [TokenLogprob(t, c, tuple(zip(top_i[j][:n], top_v[j][:n]))) for j, (t, c, n) in
            enumerate(zip(tokens, chosen, tops))]


def _penalize(x: torch.Tensor, ps: list[SamplingParams], history: list) -> torch.Tensor:
    """Repetition, then frequency and presence penalties on rows x [n, V], from the counts of
    each row's output tokens and the tokens of its prompt (one scatter for all rows)."""
    n, V = x.shape
    dev = x.device

    def counts(seqs: list[list[int]]) -> torch.Tensor:
        flat = [j * V + t for j, ids in enumerate(seqs) for t in ids if 0 <= t < V]
        return torch.bincount(torch.tensor(flat, dtype=torch.long), minlength=n * V).view(n, V).to(dev)

    out = counts([h[1] for h in history])
    rep = torch.tensor([p.repetition_penalty for p in ps], dtype=x.dtype, device=dev)[:, None]
    if (rep != 1).any():
        seen = (out > 0) | (counts([h[0] for h in history]) > 0)
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    freq = torch.tensor([p.frequency_penalty for p in ps], dtype=x.dtype, device=dev)[:, None]
    pres = torch.tensor([p.presence_penalty for p in ps], dtype=x.dtype, device=dev)[:, None]
    return x - freq * out - pres * (out > 0)


def sample(logits: torch.Tensor, params: list[SamplingParams], output_index: list[int],
           generator: torch.Generator, kernel=None, history: list | None = None,
           eos_token_id: int | None = None, allowed: list | None = None) -> list[int]:
    """logits: [S, V] float32, one row per sequence to sample. Returns S token ids. `kernel`: the
    fused-ops module to use (default: the compiled one where logits are on the CPU, if it built).
    `history` and `eos_token_id`: as adjust_logits takes them (needed only by rows that adjust
    their logits; those rows of logits may be overwritten). `allowed[i]`: row i's bitmask of
    the tokens it may sample (ScheduledSeq.allowed), or None; the others get -inf."""
    logits = adjust_logits(logits, params, output_index, history, eos_token_id)
    if allowed is not None:
        rows = [i for i, a in enumerate(allowed) if a is not None]
        if rows:
            logits = apply_masks(logits, rows, [allowed[i] for i in rows])
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
