"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds.

A seeded request draws from a generator keyed by (seed, output index), so its tokens do not
depend on which other requests share the step, nor on preemption."""
from __future__ import annotations

import torch

from batchserve.request import SamplingParams

_MASK = 2**63 - 1


def _generator(seed: int, index: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed((seed * 1_000_003 + index) & _MASK)


def sample(logits: torch.Tensor, params: list[SamplingParams], output_index: list[int],
           generator: torch.Generator) -> list[int]:
    """logits: [S, V] float32, one row per sequence to sample. Returns S token ids."""
    out = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = logits[i] / p.temperature  # [V]
        if p.top_k and p.top_k < row.shape[0]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_l, order = torch.sort(row, descending=True)
            probs = torch.softmax(sorted_l, dim=-1)
            drop = probs.cumsum(-1) - probs > p.top_p  # keep the smallest head reaching top_p
            row = row.scatter(0, order[drop], float("-inf"))
        probs = torch.softmax(row, dim=-1)
        gen = generator if p.seed is None else _generator(p.seed, output_index[i], logits.device)
        out[i] = int(torch.multinomial(probs, 1, generator=gen).item())
    return out
