"""Cost models: how long a scheduled step takes, and how many KV blocks the device holds.

A cost model sees only the `ScheduledBatch` the real scheduler built — per sequence, the new
tokens n_i, the position p_i they start at, and whether the step samples its next token.

Roofline (`RooflineCost`), for a GPU spec and a model shape (`sim.hardware`). With
e = bytes per element (2 for FP16), L layers, H query heads, K KV heads, d head size:

    T      = sum_i n_i                                   tokens in the step
    S_smp  = #seqs with sample=True                      rows that run the LM head
    A      = sum_i n_i * (p_i + (n_i + 1) / 2)           query-key pairs (causal attention)
    F_lin  = 2 * T * P_lin + 2 * S_smp * V * h           P_lin: qkv, o, gate, up, down weights
    B_w    = (P_lin + V * h) * e                         every weight read once per step
    F_attn = 4 * L * H * d * A                           QK^T and PV
    B_kv   = kv_tok * sum_i (p_i + n_i)                  read each context's K, V, write new ones
    kv_tok = 2 * L * K * d * e

    step   = overhead + max(F_lin / (peak * eff_matmul), B_w / (bw * eff_mem))
                      + max(F_attn / (peak * eff_attn), B_kv / (bw * eff_mem))

The GEMMs and attention run one after the other, so each is its own roofline and the two add;
small batches are bound by reading the weights, big prompt chunks by FLOPs, long decodes by
reading the KV cache.

    KV capacity: blocks = floor((mem * mem_util - num_params * e - workspace) / (block_size * kv_tok))

Mixed steps (`interference` f, default 1). A step that runs decodes (one token past the
prompt, D below) beside prompt tokens is charged

    step_mixed = step(all) + (f - 1) * step(D alone)      f = 1: the roofline above, unchanged

that is, the decode rows take f times what they would take in a step of their own, on top of
sharing the step. The roofline makes a mixed step cheaper than its parts run apart (the
weights are read once for both); real devices lose some of that to the two shapes sharing
kernels, and f says how much. A step of prompts only or of decodes only is never changed.

Padding paid (`batch.padding`, the rows a padded engine would run: request-level policies with
`pay_padding`). Each pad row j, n_j tokens from position p_j, enters the sums above as one
more sequence:

    T     += sum_j n_j                         S_smp += #pad rows with sample=True
    A     += sum_j n_j * (p_j + (n_j + 1) / 2) ctx   += sum_j (p_j + n_j)

so prompt padding costs as prompt tokens and a finished member's padded decode row as a
decode at its context (with its LM head); without padding rows nothing changes. The mixed-step
term's D counts the requests' decodes only.

Profiled (`ProfiledCost`): the step-time model `batchserve profile` fitted on this machine and
this model (its JSON file), and a KV pool sized as the live engine sizes its own (CacheConfig).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Protocol

from batchserve.core.batch import PadRow, ScheduledBatch
from batchserve.core.latency import TERMS, ProfiledLatencyModel, features
from batchserve.sim.hardware import GPUSpec, ModelShape, get_gpu, get_model


class CostModel(Protocol):
    """What the SimExecutor needs: a step's duration, the pool size, the context limit."""

    name: str
    max_model_len: int

    def step_time(self, batch: ScheduledBatch) -> float: ...

    def num_blocks(self, block_size: int) -> int: ...

    def describe(self) -> dict[str, Any]: ...


_start_pos, _sample = attrgetter("start_pos"), attrgetter("sample")


@dataclass(frozen=True)
class StepShape:
    """The numbers a step's cost depends on, summed over its sequences."""

    num_tokens: int
    num_seqs: int
    num_sampled: int
    context_tokens: int  # sum of p_i + n_i: KV read and written
    attn_pairs: float  # A above

    @staticmethod
    def of(batch: ScheduledBatch) -> "StepShape":
        shape = StepShape._of_seqs(batch)
        if not batch.padding:
            return shape
        t, smp, ctx, pairs = shape.num_tokens, shape.num_sampled, shape.context_tokens, shape.attn_pairs
        for row in batch.padding:  # as sequences (module docstring, "Padding paid")
            n, p = row.num_tokens, row.start_pos
            t += n
            ctx += p + n
            pairs += n * (p + (n + 1) * 0.5)
            smp += row.sample
        return StepShape(t, shape.num_seqs + len(batch.padding), smp, ctx, pairs)

    @staticmethod
    def _of_seqs(batch: ScheduledBatch) -> "StepShape":
        seqs = batch.seqs
        if batch.num_tokens == len(seqs):  # one token a sequence (all decodes): p + 1 each, pairs = context
            ctx = sum(map(_start_pos, seqs)) + len(seqs)
            return StepShape(len(seqs), len(seqs), sum(map(_sample, seqs)), ctx, float(ctx))
        t = smp = ctx = 0
        pairs = 0.0
        for s in batch.seqs:
            n, p = len(s.token_ids), s.start_pos
            t += n
            ctx += p + n
            pairs += n * (p + (n + 1) * 0.5)
            smp += s.sample
        return StepShape(t, len(batch.seqs), smp, ctx, pairs)


class RooflineCost:
    """The analytic model of the module docstring."""

    def __init__(self, gpu: GPUSpec | str, model: ModelShape | str, elem_bytes: int = 2,
                 max_model_len: int | None = None, interference: float = 1.0) -> None:
        if not interference >= 1.0:
            raise ValueError(f"interference: must be >= 1 (1: a mixed step costs the roofline), got {interference}")
        self.gpu = get_gpu(gpu) if isinstance(gpu, str) else gpu
        self.model = get_model(model, max_model_len) if isinstance(model, str) else model
        self.elem_bytes = elem_bytes
        self.interference = interference
        self.name = f"roofline {self.gpu.name} / {self.model.name} ({8 * elem_bytes}-bit)"
        if interference != 1.0:
            self.name += f", mixed-step interference {interference:g}"
        self.max_model_len = max_model_len or self.model.max_position_embeddings
        m, g = self.model, self.gpu
        self.kv_tok = m.kv_bytes_per_token(elem_bytes)
        # per-step constants, folded once: the hot path is a few multiplies per step
        self._lin_flop_s = 2.0 * m.linear_params / (g.peak_flops * g.eff_matmul)  # per token
        self._head_flop_s = 2.0 * m.head_params / (g.peak_flops * g.eff_matmul)  # per sampled row
        self._weights_s = (m.linear_params + m.head_params) * elem_bytes / (g.mem_bw * g.eff_mem)
        self._attn_flop_s = 4.0 * m.num_layers * m.num_heads * m.head_dim / (g.peak_flops * g.eff_attn)
        self._kv_s = self.kv_tok / (g.mem_bw * g.eff_mem)  # per context token

    def time_of(self, shape: StepShape) -> float:
        lin = max(shape.num_tokens * self._lin_flop_s + shape.num_sampled * self._head_flop_s, self._weights_s)
        attn = max(shape.attn_pairs * self._attn_flop_s, shape.context_tokens * self._kv_s)
        return self.gpu.step_overhead_s + lin + attn

    def step_time(self, batch: ScheduledBatch) -> float:
        t = self.time_of(StepShape.of(batch))
        if self.interference != 1.0:  # f = 1 adds nothing: the common path stays one shape
            t += (self.interference - 1.0) * self.decode_alone_time(batch)
        return t

    def decode_alone_time(self, batch: ScheduledBatch) -> float:
        """step(D alone) of the module docstring: the step the batch's decodes would take on
        their own, when prompt tokens share the step with them; 0 when it is not mixed."""
        decodes = [s for s in batch.seqs if s.is_decode]
        if not decodes or len(decodes) == len(batch.seqs):
            return 0.0
        return self.time_of(StepShape.of(ScheduledBatch(decodes)))

    def num_blocks(self, block_size: int) -> int:
        g = self.gpu
        free = g.mem_bytes * g.mem_util - self.model.num_params * self.elem_bytes - g.workspace_bytes
        blocks = math.floor(free / (block_size * self.kv_tok))
        if blocks < 1:
            raise ValueError(f"{self.model.name} in {8 * self.elem_bytes}-bit does not fit {g.name}: "
                             f"{self.model.num_params * self.elem_bytes / 1e9:.1f} GB of weights")
        return blocks

    def describe(self) -> dict[str, Any]:
        return {"cost_model": "roofline", "gpu": self.gpu.name, "model": self.model.name,
                "elem_bytes": self.elem_bytes, "max_model_len": self.max_model_len,
                "interference": self.interference,
                "weights_gb": self.model.num_params * self.elem_bytes / 1e9,
                "kv_bytes_per_token": self.kv_tok}


class ProfiledCost:
    """Step times from a `batchserve profile` JSON file (this machine, this model).

    The profile's fitted model (see `core.latency.ProfiledLatencyModel`) is evaluated on the
    step's own sequences (and its paid padding rows, alike): prompt chunks as (start, n), decodes
    by their context, so the
    per-sequence detail the scheduler produced is used, not just token and sequence counts.
    The KV pool is the one the live engine allocates for the same cache settings: `num_blocks`
    if given, else `kv_cache_gb` over the profile's bytes per token, else the profiled pool.
    A step is `runner_time * scale + overhead_s`: `overhead_s` is the engine's own host time
    (scheduling, bookkeeping), which the profile, timing the runner alone, leaves out; `scale`
    corrects for a machine that runs slower or faster now than when profiled
    (`benchmarks.fidelity` measures both on a warm-up run). `prompt_scale`, when given, is the
    scale of steps with prompt tokens, `scale` then that of decode-only ones: the fit errs
    differently on the two (they take different paths through the model), and one ratio
    measured on a warm-up made mostly of decodes would carry the decodes' error onto prompts.
    """

    def __init__(self, path: str, num_blocks: int | None = None, kv_cache_gb: float | None = None,
                 overhead_s: float = 0.0, scale: float = 1.0, prompt_scale: float | None = None) -> None:
        self.path = path
        self.profile = ProfiledLatencyModel.load(path)
        self._coef = [self.profile.coef[t] for t in TERMS]
        self._terms = TERMS
        self._features = features
        self.name = f"profiled ({os.path.basename(path)})"
        self.max_model_len = self.profile.max_model_len or 8192
        self._num_blocks = num_blocks
        self._kv_cache_gb = kv_cache_gb
        self.overhead_s = overhead_s  # host time per step outside the runner (the profile times the runner)
        self.scale = scale  # measured / profiled runner time, when the machine runs differently now
        self.prompt_scale = scale if prompt_scale is None else prompt_scale  # the same, of steps with prompt tokens

    def step_time(self, batch: ScheduledBatch) -> float:
        prefills, decode_ctx = step_rows(batch)
        return self._predict(prefills, decode_ctx) * (self.prompt_scale if prefills else self.scale) + self.overhead_s

    def runner_time(self, batch: ScheduledBatch) -> float:
        """The profile's prediction for the runner alone."""
        return self._predict(*step_rows(batch))

    def _predict(self, prefills: list[tuple[int, int]], decode_ctx: list[int]) -> float:
        x = self._features(prefills, decode_ctx, self.profile.row_knee)  # the profile's own regressors
        return max(0.0, sum(c * v for c, v in zip(self._coef, x)))

    def num_blocks(self, block_size: int) -> int:
        if self._num_blocks:
            return self._num_blocks
        per_tok = self.profile.kv_bytes_per_token
        if self._kv_cache_gb and per_tok:
            return max(1, int(self._kv_cache_gb * 2**30) // (per_tok * block_size))
        if not self.profile.kv_blocks:
            raise ValueError(f"profile {self.path}: no KV pool size in it; pass --num-blocks")
        return int(self.profile.kv_blocks)

    def describe(self) -> dict[str, Any]:
        return {"cost_model": "profiled", "profile": self.path, "coef": dict(zip(self._terms, self._coef)),
                "overhead_s": self.overhead_s, "scale": self.scale, "prompt_scale": self.prompt_scale,
                "max_model_len": self.max_model_len}


def step_rows(batch: ScheduledBatch) -> tuple[list[tuple[int, int]], list[int]]:
    """A step's prompt chunks as (start, n) and its decodes by context, paid padding rows
    counted like any other: the profile's view of a step."""
    prefills: list[tuple[int, int]] = []
    decode_ctx: list[int] = []
    for s in batch.seqs:
        if s.is_decode:  # one token over start_pos tokens of context
            decode_ctx.append(s.start_pos)
        else:
            prefills.append((s.start_pos, len(s.token_ids)))
    for row in batch.padding:
        if _decode_row(row):
            decode_ctx.append(row.start_pos)
        else:
            prefills.append((row.start_pos, row.num_tokens))
    return prefills, decode_ctx


def has_prompt(batch: ScheduledBatch) -> bool:
    """Whether a step computes prompt tokens (its own or paid padding's), not only decodes."""
    return any(not s.is_decode for s in batch.seqs) or any(not _decode_row(r) for r in batch.padding)


def _decode_row(row: PadRow) -> bool:
    """A paid padding row that is a decode (a finished member's row, which samples), not a
    prompt's padding: one token of that is a prompt chunk too, when two prompts differ by one."""
    return row.sample


def make_cost_model(hardware: str | None = None, profile: str | None = None, model: str = "llama-2-7b",
                    elem_bytes: int = 2, max_model_len: int | None = None, interference: float = 1.0,
                    **kw: Any) -> CostModel:
    """`--profile FILE` gives a ProfiledCost (`kw`: its options), otherwise a RooflineCost for
    `--hardware` (default A100-80GB) and `--model` (a named shape or a config.json), with
    `interference` its mixed-step factor (a profile fitted on mixed steps has its own)."""
    if profile:
        if interference != 1.0:
            raise ValueError("interference: a roofline setting; a profile's fitted steps already hold their own")
        return ProfiledCost(profile, **kw)
    return RooflineCost(hardware or "a100-80gb", model, elem_bytes, max_model_len, interference)
