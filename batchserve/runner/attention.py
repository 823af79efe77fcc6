"""Attention over the paged KV cache, for a flat batch mixing prompt chunks and decodes.

Cache layout per layer: k, v of shape [num_blocks, n_kv, block_size, head_dim]. A token at
position p of a request lives in slot block_table[p // block_size] * block_size + p % block_size,
that is at offset p % block_size of its block, and each kv head's rows of a block are contiguous
(so one kv head of 16 tokens is one run of memory for the C++ decode kernel: over a request's
contiguous blocks faster from DRAM than a layout with all kv heads of a token side by
side, slower over blocks scattered one by one, which the KV manager's placement avoids;
measured in docs/performance.md, "The KV cache: dtype, layout and placement").
The PyTorch path reads and writes through `slot_rows`: a slot's rows in the cache viewed as
[num_blocks * n_kv * block_size, head_dim]. The metadata is built once per step
(`AttnMeta.build`) and shared by every layer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F


def slot_rows(slots: torch.Tensor, n_kv: int, block_size: int) -> torch.Tensor:
    """[S] slots -> [S, n_kv]: their rows in a cache viewed as [num_blocks * n_kv * block_size, head_dim]."""
    first = slots // block_size * (n_kv * block_size) + slots % block_size
    return first[:, None] + torch.arange(0, n_kv * block_size, block_size, device=slots.device)


def gather_rows(cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The cache's K or V at `rows` ([S, n_kv], from slot_rows) as [S, n_kv, head_dim]."""
    hd = cache.shape[-1]
    return cache.view(-1, hd).index_select(0, rows.reshape(-1)).view(*rows.shape, hd)


def scatter_rows(cache: torch.Tensor, rows: torch.Tensor, x: torch.Tensor) -> None:
    """Writes x [S, n_kv, head_dim] into the cache at `rows` ([S, n_kv], from slot_rows)."""
    hd = cache.shape[-1]
    cache.view(-1, hd).index_copy_(0, rows.reshape(-1), x.reshape(-1, hd).to(cache.dtype))


def gather_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The cache's K or V at `slots` ([S]) as [S, n_kv, head_dim]."""
    return gather_rows(cache, slot_rows(slots, cache.shape[1], cache.shape[2]))


@dataclass
class PrefillSpan:
    """A prompt chunk: flat tokens [start, end) at positions ctx_start.. of one request."""

    start: int
    end: int
    ctx_start: int
    slots: torch.Tensor  # the request's slots in position order, [max_blocks * block_size] (CPU)
    device: torch.device
    _context: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    def context(self, n_kv: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For the PyTorch path after cached history (ctx_start > 0): the cache rows to read
        ([ctx_start + n, n_kv], slot_rows) and the mask [n, ctx_start + n] (True = may attend).
        Built on demand: the C++ kernel needs neither, and the mask grows with chunk x context.
        Kept for the step's other layers."""
        if self._context is None:
            n = self.end - self.start
            ctx_rows = slot_rows(self.slots[:self.ctx_start + n].to(self.device), n_kv, block_size)
            q_pos = torch.arange(self.ctx_start, self.ctx_start + n, device=self.device)[:, None]
            self._context = ctx_rows, torch.arange(self.ctx_start + n, device=self.device)[None, :] <= q_pos
        return self._context


def _padded_tables(seqs: list[tuple[int, int, list[int]]]) -> torch.Tensor:
    """The block tables of `seqs` ((start_pos, num_tokens, block_table) each) as one int64
    [requests, longest table] tensor, padded with block 0."""
    max_blocks = max(len(t) for _, _, t in seqs)
    return torch.tensor([t + [0] * (max_blocks - len(t)) for _, _, t in seqs], dtype=torch.long)


@dataclass
class AttnMeta:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    dec_rows: torch.Tensor | None  # [Bd] flat indices of decode tokens
    dec_slots: torch.Tensor | None  # [Bd, Tmax] slots of each decode's context (padded with 0)
    dec_slots_flat: torch.Tensor | None  # the same, flattened [Bd * Tmax]
    dec_mask: torch.Tensor | None  # [Bd, 1, 1, Tmax] bool
    prefills: list[PrefillSpan]
    dec_contiguous: bool  # decode rows are one contiguous range [dec_lo, dec_hi)
    dec_lo: int = 0
    dec_hi: int = 0
    decode_only: bool = False  # every token is a decode and the C++ kernel runs: its output is the answer
    kernel: Any = None  # compiled decode kernel (runner/kernels.py), or None for the PyTorch path
    dec_tables: torch.Tensor | None = None  # [Bd, max_blocks] block tables, for the kernel
    dec_lens: torch.Tensor | None = None  # [Bd] context lengths, for the kernel
    block_size: int = 16
    pf_tables: torch.Tensor | None = None  # [S, max_blocks] block tables of the prompt chunks, for the kernel
    pf_spans: torch.Tensor | None = None  # [S, 3] (first flat row, tokens, first position), for the kernel
    # Rows whose matrix products take the model's prompt path (LlamaModel.prompt_layers): None for
    # none, ALL_ROWS for every row, else (those rows, the others), each a slice or an index tensor
    prompt_rows: Any = None
    # PyTorch path: slot_rows of slot_mapping ("new") and dec_slots_flat ("dec") per cache shape,
    # built by the first layer that needs them
    rows: dict = field(default_factory=dict)

    @staticmethod
    def build(seqs: list[tuple[int, int, list[int]]], block_size: int, device: torch.device,
              kernel: Any = None) -> "AttnMeta":
        """seqs: (start_pos, num_tokens, block_table) per request, in flat-batch order."""
        if kernel is not None and all(n == 1 and start > 0 for start, n, _ in seqs):
            return AttnMeta._build_decode(seqs, block_size, device, kernel)
        return AttnMeta._build_general(seqs, block_size, device, kernel)

    @staticmethod
    def _build_decode(seqs: list[tuple[int, int, list[int]]], block_size: int, device: torch.device,
                      kernel: Any) -> "AttnMeta":
        """`build` for a step of decodes only, for the C++ kernel: the same fields as
        `_build_general` gives, from Python ints (no [requests, max_blocks * block_size] slot
        matrix, whose size grows with every context each step): a few small tensors, one value per
        request plus the padded block tables."""
        n = len(seqs)
        slots = [t[p // block_size] * block_size + p % block_size for p, _, t in seqs]
        return AttnMeta(torch.tensor(slots, dtype=torch.long).to(device),
                        torch.arange(n, dtype=torch.long, device=device), None, None, None, [],
                        dec_contiguous=True, dec_lo=0, dec_hi=n, decode_only=True, kernel=kernel,
                        dec_tables=_padded_tables(seqs),
                        dec_lens=torch.tensor([p + 1 for p, _, _ in seqs], dtype=torch.long), block_size=block_size)

    @staticmethod
    def _build_general(seqs: list[tuple[int, int, list[int]]], block_size: int, device: torch.device,
                       kernel: Any = None) -> "AttnMeta":
        tables = _padded_tables(seqs)
        offs = torch.arange(block_size, dtype=torch.long)
        slots_all = (tables[:, :, None] * block_size + offs).view(len(seqs), -1)  # [R, max_blocks*bs]
        new_slots: list[torch.Tensor] = []
        dec_rows: list[int] = []
        dec_reqs: list[int] = []
        dec_lens: list[int] = []
        prefills: list[PrefillSpan] = []
        pf_reqs: list[int] = []
        flat = 0
        for i, (start, n, _) in enumerate(seqs):
            new_slots.append(slots_all[i, start:start + n])
            if n == 1 and start > 0:
                dec_rows.append(flat)
                dec_reqs.append(i)
                dec_lens.append(start + 1)
            else:
                prefills.append(PrefillSpan(flat, flat + n, start, slots_all[i], device))
                pf_reqs.append(i)
            flat += n
        meta = AttnMeta(torch.cat(new_slots).to(device), None, None, None, None, prefills, False,
                        kernel=kernel, block_size=block_size)
        if prefills and kernel is not None:
            meta.pf_tables = tables[pf_reqs]
            meta.pf_spans = torch.tensor([[sp.start, sp.end - sp.start, sp.ctx_start] for sp in prefills],
                                         dtype=torch.long)
        if dec_rows:
            tmax = max(dec_lens)
            lens = torch.tensor(dec_lens)
            meta.dec_rows = torch.tensor(dec_rows, dtype=torch.long, device=device)
            if kernel is not None:
                meta.dec_tables = tables[dec_reqs]
                meta.dec_lens = lens
            else:
                meta.dec_slots = slots_all[dec_reqs, :tmax].to(device)
                meta.dec_slots_flat = meta.dec_slots.reshape(-1)
                meta.dec_mask = (torch.arange(tmax)[None, :] < lens[:, None])[:, None, None, :].to(device)
            meta.dec_contiguous = dec_rows == list(range(dec_rows[0], dec_rows[0] + len(dec_rows)))
            meta.dec_lo, meta.dec_hi = dec_rows[0], dec_rows[0] + len(dec_rows)
            meta.decode_only = kernel is not None and not prefills and meta.dec_contiguous and len(dec_rows) == flat
        return meta


ALL_ROWS = slice(None)  # AttnMeta.prompt_rows: every row of the step


def split_rows(runs: list[tuple[int, bool]]) -> Any:
    """AttnMeta.prompt_rows of a step whose flat rows come in `runs` of (rows, whether they take
    the prompt path), in order."""
    total, yes = sum(n for n, _ in runs), sum(n for n, p in runs if p)
    if yes == 0:
        return None
    if yes == total:
        return ALL_ROWS

    def rows(want: bool) -> slice | torch.Tensor:
        spans: list[list[int]] = []
        at = 0
        for n, p in runs:
            if p == want and n:
                if spans and spans[-1][1] == at:
                    spans[-1][1] = at + n
                else:
                    spans.append([at, at + n])
            at += n
        return slice(*spans[0]) if len(spans) == 1 else torch.cat([torch.arange(a, b) for a, b in spans])

    return rows(True), rows(False)


FP16_MAX = 65504.0


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K or V rows as the cache stores them; float16 saturates at +-65504 (as the C++ store does)
    instead of overflowing to infinity, which would make every score of the row NaN."""
    if dtype == torch.float16 and x.dtype != torch.float16:
        x = x.clamp(-FP16_MAX, FP16_MAX)
    return x.to(dtype)


def _rows(meta: AttnMeta, what: str, slots: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """slot_rows of one of meta's slot lists for this cache's shape, built once a step (every layer
    shares it)."""
    key = (what, cache.shape[1], cache.shape[2])
    r = meta.rows.get(key)
    if r is None:
        r = meta.rows[key] = slot_rows(slots, cache.shape[1], cache.shape[2])
    return r


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMeta,
                    stored: bool = False, scale: float | None = None, window: int | None = None) -> torch.Tensor:
    """q: [T, n_h, hd]; k, v: [T, n_kv, hd] for the new tokens. Writes k, v into the cache
    (unless `stored`: the caller already did), then returns the attention output [T, n_h, hd].
    `scale`: the softmax scale (None: hd ** -0.5). `window`: each query attends only to the
    `window` latest positions, its own included (a sliding-window layer); the PyTorch path only,
    so a model with such layers runs without the C++ kernel (meta.kernel None)."""
    T, n_h, hd = q.shape
    if scale is None:
        scale = hd ** -0.5
    if window is not None and meta.kernel is not None:
        raise ValueError("sliding-window attention runs on the PyTorch path only (build AttnMeta without a kernel)")
    if not stored and k_cache.dtype == torch.uint8:  # int8 cache: quantized by the kernel (cpu_math.h)
        meta.kernel.kv_int8_store(k_cache, v_cache, k, v, meta.slot_mapping)
    elif not stored:
        rows = _rows(meta, "new", meta.slot_mapping, k_cache)
        scatter_rows(k_cache, rows, to_cache_dtype(k, k_cache.dtype))
        scatter_rows(v_cache, rows, to_cache_dtype(v, v_cache.dtype))
    if meta.decode_only:  # a pure decode step: the kernel's output is the answer
        return meta.kernel.paged_decode(q, k_cache, v_cache, meta.dec_tables, meta.dec_lens,
                                        meta.block_size, scale)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    g = n_h // k.shape[1]
    prefills = meta.prefills
    if prefills and meta.kernel is not None and meta.kernel.prefill_supported(hd):
        # every chunk at once, each cached K/V element read once per 16 queries, no copies
        meta.kernel.paged_prefill(q, k_cache, v_cache, meta.pf_tables, meta.pf_spans, meta.block_size,
                                  scale, out)
        prefills = []
    for sp in prefills:
        # 4-D inputs with the kv heads repeated: SDPA's `enable_gqa` and 3-D inputs both send the CPU
        # to its unfused math path (the whole score matrix, a dozen ops) instead of the tiled
        # flash kernel this shape gets.
        qs = q[sp.start:sp.end].transpose(0, 1)[None]  # [1, n_h, n, hd]
        mask = None
        if sp.ctx_start == 0:
            ks, vs = k[sp.start:sp.end], v[sp.start:sp.end]  # [n, n_kv, hd]
        else:
            ctx_rows, mask = sp.context(k_cache.shape[1], k_cache.shape[2])
            ks = gather_rows(k_cache, ctx_rows).to(q.dtype)  # [ctx, n_kv, hd]
            vs = gather_rows(v_cache, ctx_rows).to(q.dtype)
        if g > 1:
            ks, vs = ks.repeat_interleave(g, dim=1), vs.repeat_interleave(g, dim=1)
        ks, vs = ks.transpose(0, 1)[None], vs.transpose(0, 1)[None]  # [1, n_h, ctx, hd]
        if window is not None:
            n = sp.end - sp.start
            q_pos = torch.arange(sp.ctx_start, sp.ctx_start + n, device=q.device)[:, None]
            k_pos = torch.arange(ks.shape[2], device=q.device)[None, :] + (sp.ctx_start if mask is None else 0)
            near = k_pos > q_pos - window
            mask = near & (k_pos <= q_pos) if mask is None else mask & near
        if mask is None:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
        else:
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
        out[sp.start:sp.end] = o[0].transpose(0, 1)
    if meta.dec_rows is not None:
        qd = q[meta.dec_lo:meta.dec_hi] if meta.dec_contiguous else q[meta.dec_rows]  # [Bd, n_h, hd]
        if meta.kernel is not None:  # reads each cached K/V element once, no gathered copy
            o = meta.kernel.paged_decode(qd, k_cache, v_cache, meta.dec_tables, meta.dec_lens,
                                         meta.block_size, scale)
        else:
            o = _decode_torch(qd, k_cache, v_cache, meta, scale, window)
        if meta.dec_contiguous:
            out[meta.dec_lo:meta.dec_hi] = o
        else:
            out[meta.dec_rows] = o
    return out


def _decode_torch(qd: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMeta,
                  scale: float, window: int | None = None) -> torch.Tensor:
    """Decode attention by gathering each request's history (padded to the longest) and SDPA;
    `window`: only the latest `window` positions of each."""
    bd, n_h, hd = qd.shape
    n_kv = k_cache.shape[1]
    g = n_h // n_kv
    qd = qd.reshape(bd, n_kv, g, hd)  # the g query heads sharing a kv head act as g query rows
    tmax = meta.dec_slots.shape[1]
    # index_select on a flat row list copies whole rows; 2-D advanced indexing goes element by element
    rows = _rows(meta, "dec", meta.dec_slots_flat, k_cache)
    kd = gather_rows(k_cache, rows).to(qd.dtype).view(bd, tmax, n_kv, hd).transpose(1, 2)
    vd = gather_rows(v_cache, rows).to(qd.dtype).view(bd, tmax, n_kv, hd).transpose(1, 2)
    mask = meta.dec_mask  # [Bd, 1, 1, Tmax]
    if window is not None:
        lens = mask.sum(-1, keepdim=True)  # the context lengths
        mask = mask & (torch.arange(tmax, device=mask.device) >= lens - window)
    o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale)  # [Bd, n_kv, g, hd]
    return o.reshape(bd, n_h, hd)
