"""ModelRunner: ScheduledBatch -> flat inputs -> forward -> sample -> StepOutput.

It owns the model and the KV tensors and never sees a Request or a policy.

Padding (`batch.padding`, set only when a request-level policy pays it): each PadRow runs
through the model as one more sequence of pad tokens (id 0) after the batch's own, so the
step does a padded engine's extra work: the embedding, every layer's matrix products, RoPE,
attention over the row's whole context (p + n positions) and, for a padded decode row, the
LM head. Its K/V are written to, and its context read from, one scratch block the KV manager
never hands out (the pool has `num_blocks` blocks; the tensors hold one more), so no
request's cache is touched and no block is taken from the pool; its outputs are discarded.
Not emulated: the values (a pad row attends to the scratch block's leftovers, not to its
member's prompt) and a dense kernel's shape (the rows stay ragged in one flat batch)."""
from __future__ import annotations

import logging
import math
import mmap
import time
from typing import Any, Callable

import torch

from batchserve.config import CacheConfig, ModelConfig, kv_cache_dtype_name
from batchserve.core.batch import ScheduledBatch, ScheduledSeq, StepOutput
from batchserve.runner.attention import (ALL_ROWS, AttnMeta, gather_rows, scatter_rows, slot_rows, split_rows,
                                        to_cache_dtype)
from batchserve.runner.kernels import build_all, fused_ops_ext, paged_attention_ext
from batchserve.runner.loader import LazyWeights, LoadedModel
from batchserve.runner import weight_cache
from batchserve.runner.models.llama import INT_MATMUL, LlamaModel, cpu_isa_in_use, has_int_blocks
from batchserve.runner.sampler import log_probs, sample, token_logprobs

log = logging.getLogger(__name__)


def kv_block_shapes(loaded_cfg, block_size: int, dtype: torch.dtype) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """One block of one layer's K and V caches, each [n_kv, block_size, row]: row = head_dim
    elements; for the int8 cache (uint8) head_dim bytes plus float32 scales, one per 16 elements
    for K and one per row for V (the kernels' layout, runner/csrc/cpu_math.h)."""
    hd = loaded_cfg.head_dim
    k_row, v_row = (hd + hd // 4, hd + 4) if dtype == torch.uint8 else (hd, hd)
    return (loaded_cfg.num_kv_heads, block_size, k_row), (loaded_cfg.num_kv_heads, block_size, v_row)


def kv_bytes_per_block(loaded_cfg, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.tensor([], dtype=dtype).element_size()
    k, v = kv_block_shapes(loaded_cfg, block_size, dtype)
    return loaded_cfg.num_layers * (k[0] * k[1] * k[2] + v[0] * v[1] * v[2]) * elem


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros(shape), without writing the zeros on the CPU: an anonymous memory mapping is
    zero pages the OS fills in on first write, so a KV cache costs neither the time to fill it
    at start (a gigabyte by default) nor resident memory before its blocks are first used; each
    block's first write pays its page faults instead, in the step that writes it. The mapping
    keeps the ordinary 4 KiB pages (page-aligned, no huge-page advice): a transparent huge page
    would fault 2 MB in at once in the middle of a step."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes)  # the tensor keeps it alive
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


def cpp_attention_wanted(model_cfg: ModelConfig, weight_dtype: torch.dtype) -> bool:
    """Whether the C++ attention kernels and fused ops are to run: a float32 model on the CPU,
    unless the PyTorch path is asked for (whether they built is the caller's question)."""
    return (model_cfg.attention_backend != "torch" and torch.device(model_cfg.device).type == "cpu"
            and weight_dtype == torch.float32)


def resolve_kv_cache_dtype(model_cfg: ModelConfig, cache_cfg: CacheConfig, cfg: Any = None) -> torch.dtype:
    """The KV cache's storage dtype. `auto`, where the C++ attention kernels run (a float32 model
    on the CPU, the kernels built), is int8 when its integer decode kernel built here (AVX512-VNNI)
    and the model's shape suits it (`int8_kv_fits`), else float16. int8 reads a little over half
    float16's bytes per decode step and holds about 1.7x the tokens per GB; its perplexity stays
    within the 0.5 % of the float32 model's that the defaults are held to (BENCHMARKS.md, "Output
    quality"). float16 halves float32's bytes with the float32 cache's output, as llama.cpp stores
    K/V by default; values past its range are stored as +-65504, not infinity. Elsewhere `auto`
    is the model's dtype; `float32` keeps the exact cache. `cfg`: the loaded model's config, for
    the shape check (without it, auto assumes a shape the int8 kernels take)."""
    name = kv_cache_dtype_name(model_cfg, cache_cfg)
    if name == "int8":
        return _int8_kv_dtype(model_cfg, cache_cfg)
    if (cache_cfg.kv_cache_dtype == "auto" and cpp_attention_wanted(model_cfg, getattr(torch, model_cfg.dtype))
            and paged_attention_ext() is not None and fused_ops_ext() is not None):
        return torch.uint8 if int8_kv_fits(cache_cfg, cfg) else torch.float16
    return getattr(torch, name)


def int8_kv_fits(cache_cfg: CacheConfig, cfg: Any = None) -> bool:
    """Whether `auto` takes the int8 cache: its VNNI decode kernel and its prompt kernel run here
    (with cfg, for its head_dim), blocks are a multiple of 16 tokens, no sliding-window layers."""
    ext = paged_attention_ext()
    if ext is None or not ext.int8_fast_path() or cache_cfg.block_size % 16:
        return False
    return cfg is None or (cfg.sliding_window is None and ext.prefill_supported(cfg.head_dim))


def _int8_kv_dtype(model_cfg: ModelConfig, cache_cfg: CacheConfig) -> torch.dtype:
    """torch.uint8, the int8 cache's storage (a byte per value plus float32 scales, kv_block_shapes),
    after checking that its kernels run here; else a ValueError naming what is missing."""
    why = None
    if cache_cfg.block_size % 16:
        why = f"needs block_size a multiple of 16, got {cache_cfg.block_size}"
    elif not cpp_attention_wanted(model_cfg, getattr(torch, model_cfg.dtype)):
        why = "needs the C++ attention kernels: a float32 model (--dtype float32) on the CPU, attention_backend auto or cpp"
    elif paged_attention_ext() is None or fused_ops_ext() is None:
        why = "needs the C++ attention kernels, which did not build here (see the log)"
    if why:
        raise ValueError(f"kv_cache_dtype=int8 {why}")
    return torch.uint8


# The integer paths (LlamaModel's cpu_isa_in_use(..., integer=True)) on which int8 products beat
# the float32 ones at the model's shapes, so that matmul_dtype auto takes them (BENCHMARKS.md).
FAST_INT8_ISAS = frozenset({"avx512", "avx2"})


def resolve_matmul_dtype(model_cfg: ModelConfig, loaded: LoadedModel) -> torch.dtype | None:
    """The matrix products' dtype (None: the weights' own). `auto` means int8 dot products on a
    GGUF file's Q4_0/Q4_1/Q4_K/Q8_0 blocks where that runs fast (float32 model on the CPU, the
    C++ GEMM, blocks kept, and an integer path in FAST_INT8_ISAS: AVX512-VNNI, where one
    instruction does four times the multiply-adds of a float32 FMA, or AVX2, whose byte products
    still beat its float32 ones; `cpu_isa` chooses the path as for the products themselves): the
    activations are quantized per 32 values as llama.cpp does. It is the default because it is the
    fastest setting whose perplexity stays within 0.5 % of the dequantized float32 model's, as
    int16 does too (BENCHMARKS.md, "Output quality"; greedy continuations do differ where the
    model's top two tokens nearly tie). Everywhere else (the portable path included), and with
    `float32` asked for, the float32 products."""
    if model_cfg.matmul_dtype != "auto":
        return None if model_cfg.matmul_dtype == model_cfg.dtype else getattr(torch, model_cfg.matmul_dtype)
    if (model_cfg.dtype != "float32" or model_cfg.device != "cpu" or model_cfg.quantized_weights != "auto"
            or model_cfg.linear_backend not in ("auto", "cpp")
            or not has_int_blocks(loaded.quantized)):
        return None
    from batchserve.runner.kernels import gemm_ext

    if gemm_ext() is None:
        return None
    if model_cfg.cpu_isa == "avx512" and not gemm_ext().has_vnni():
        return None  # AVX-512 float products asked for, and this CPU has no AVX-512 integer path
    return torch.int8 if cpu_isa_in_use(model_cfg.cpu_isa, integer=True) in FAST_INT8_ISAS else None


def resolve_prompt_matmul(model_cfg: ModelConfig, mm: torch.dtype | None, fused: Any, cfg: Any = None) -> bool:
    """Whether prompt rows multiply by AMX bf16 tiles (ModelConfig.prompt_matmul): `amx` asks for
    it (a RuntimeError where it cannot run); `auto` takes it where it runs, the CPU and OS giving
    AMX tiles, and the default products are integer ones (matmul_dtype auto, cpu_isa auto): a
    model whose products are float32 keeps them for prompts too. `cfg` (the model's LlamaConfig):
    its matrices' sides must be multiples of 32, as the tiles are."""
    if model_cfg.prompt_matmul == "off":
        return False
    from batchserve.runner.kernels import gemm_ext

    sides = () if cfg is None else (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim,
                                     (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim)
    runs = (fused is not None and mm in (None, torch.float32, torch.int8, torch.int16) and model_cfg.device == "cpu"
            and model_cfg.dtype == "float32" and all(n % 32 == 0 for n in sides)
            and (cfg is None or cfg.is_plain_llama)  # the fused layer loop, which the prompt path is part of
            and gemm_ext() is not None and gemm_ext().has_amx())
    if model_cfg.prompt_matmul == "amx":
        if not runs:
            raise RuntimeError("prompt_matmul=amx: no AMX bf16 tiles here (needs an AMX CPU and OS, the C++ kernels "
                               "built, a float32 plain-Llama model with matrix sides in multiples of 32, and float32 "
                               "or integer matrix products)")
        return True
    return runs and model_cfg.matmul_dtype == "auto" and model_cfg.cpu_isa == "auto" and mm in (torch.int8, torch.int16)


class ModelRunner:
    def __init__(self, loaded: LoadedModel, model_cfg: ModelConfig, cache_cfg: CacheConfig) -> None:
        if model_cfg.num_threads:
            torch.set_num_threads(model_cfg.num_threads)
        self.device = torch.device(model_cfg.device)
        if self.device.type == "cpu" and (model_cfg.attention_backend != "torch"
                                          or model_cfg.linear_backend in ("auto", "cpp")):
            build_all()  # the kernels this runner may use, compiled at once on a first start
        self.cfg = loaded.config
        # the weights' dtype; a GGUF file's (LazyWeights) without making the embedding here, since
        # LlamaModel may take it from the packed-weight cache instead
        w = loaded.weights
        dtype = getattr(torch, model_cfg.dtype) if isinstance(w, LazyWeights) else w["model.embed_tokens.weight"].dtype
        self.kv_dtype = resolve_kv_cache_dtype(model_cfg, cache_cfg, self.cfg)
        cpp_ok = cpp_attention_wanted(model_cfg, dtype)
        fused = fused_ops_ext() if cpp_ok else None
        # sliding-window layers run on the PyTorch attention path (the C++ kernels attend to all)
        windowed = self.cfg.sliding_window is not None
        self.kernel = paged_attention_ext() if cpp_ok and not windowed else None
        if model_cfg.attention_backend == "cpp" and windowed:
            raise ValueError(f"attention_backend=cpp: this model's sliding-window layers (window "
                             f"{self.cfg.sliding_window}) run on the PyTorch path only; use auto or torch")
        if model_cfg.attention_backend == "cpp" and (self.kernel is None or fused is None):
            raise RuntimeError("attention_backend=cpp: the C++ kernels did not build (see the log)")
        if windowed and self.kv_dtype == torch.uint8:
            raise ValueError("kv_cache_dtype=int8 needs the C++ attention kernels, which do not compute this "
                             f"model's sliding-window layers (window {self.cfg.sliding_window})")
        mm = resolve_matmul_dtype(model_cfg, loaded)
        blocks = loaded.quantized if model_cfg.quantized_weights == "auto" else None
        cached = bits = None
        if blocks and loaded.path and self.device.type == "cpu" and model_cfg.dtype == "float32":
            bits = INT_MATMUL.get(mm, 0)
            cached = weight_cache.load(loaded.path, bits)
        self.model = LlamaModel(loaded.config, loaded.weights, model_cfg.linear_backend, mm, fused, blocks,
                                cpu_isa=model_cfg.cpu_isa, packed=cached,
                                prompt_amx=resolve_prompt_matmul(model_cfg, mm, fused, loaded.config))
        if bits is not None and self.model.packed and not set(self.model.packed) <= set(cached or {}):
            weight_cache.save(loaded.path, bits, {**(cached or {}), **self.model.packed})
        if self.model.prompt_layers is not None:
            log.info("prompt tokens: matrix products on AMX bf16 tiles, decodes as above (--prompt-matmul off: "
                     "prompts as decodes)")
        if self.model.quantized_matrices:
            log.info("weights: %d matrices multiplied from their GGUF blocks (C++ GEMM)%s",
                     self.model.quantized_matrices,
                     f", {self.model.int_matrices} of them as integer dot products ({str(mm).split('.')[-1]} "
                     "activations" + ("; --matmul-dtype float32 for float32 products" if model_cfg.matmul_dtype == "auto"
                                      else "") + ")" if self.model.int_matrices else "")
        self.dtype = self.model.embed.dtype
        self.block_size = cache_cfg.block_size
        per_block = kv_bytes_per_block(self.cfg, self.block_size, self.kv_dtype)
        self.num_blocks = cache_cfg.num_blocks or max(1, int(cache_cfg.kv_cache_gb * 2**30) // per_block)
        slots = self.num_blocks * self.block_size
        if self.kv_dtype == torch.uint8 and not self.kernel.prefill_supported(self.cfg.head_dim):
            raise ValueError(f"kv_cache_dtype=int8: head_dim {self.cfg.head_dim} is not supported by the prompt "
                             "kernel here (64 or 128 on an AVX-512 CPU)")
        k_shape, v_shape = kv_block_shapes(self.cfg, self.block_size, self.kv_dtype)  # layout: attention.py
        self.scratch_block = self.num_blocks  # padding rows' K/V (module docstring); not in the pool
        self.kv_caches = [(zeroed((self.num_blocks + 1, *k_shape), self.kv_dtype, self.device),
                           zeroed((self.num_blocks + 1, *v_shape), self.kv_dtype, self.device))
                          for _ in range(self.cfg.num_layers)]
        self.generator = torch.Generator(device=self.device).manual_seed(model_cfg.seed)
        self._between: Callable[[], float] | None = None
        self._paused = 0.0  # seconds the step running now spent in between_layers
        log.info("KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB, %s%s)", self.num_blocks,
                 self.block_size, slots, self.num_blocks * per_block / 2**30,
                 "int8" if self.kv_dtype == torch.uint8 else str(self.kv_dtype).split(".")[-1],
                 "; --kv-cache-dtype float32 for an exact float32 cache"
                 if cache_cfg.kv_cache_dtype == "auto" and self.kv_dtype in (torch.float16, torch.uint8) else "")

    @property
    def between_layers(self) -> Callable[[], float] | None:
        """Called between two layers of every step while set: it may run whole steps of its own
        (other requests, their own blocks) before the paused one goes on, which is safe because a
        step's state between layers is its local tensors and the K/V of its own positions. It
        returns the seconds it spent; the paused step's `step_time` leaves them out."""
        return self._between

    @between_layers.setter
    def between_layers(self, fn: Callable[[], float] | None) -> None:
        self._between = fn
        self.model.between_layers = None if fn is None else self._pause

    def _pause(self) -> None:
        self._paused += self._between()

    @property
    def max_model_len(self) -> int:
        return self.cfg.max_position_embeddings

    def compute_logits(self, batch: ScheduledBatch, scores: dict | None = None) -> torch.Tensor:
        """Run the forward pass; return float32 logits [S, V] for the seqs with sample=True.
        `scores`, if given, receives for each seq with prompt_targets the TokenLogprob of each
        target (the prompt logprobs). The batch's padding rows run too (module docstring);
        their logits are computed and dropped."""
        ids: list[int] = []
        pos: list[int] = []
        sample_rows: list[int] = []
        spans: list[tuple[ScheduledSeq, int]] = []
        for s in batch.seqs:
            if s.prompt_targets:
                spans.append((s, len(ids)))
            ids.extend(s.token_ids)
            pos.extend(range(s.start_pos, s.start_pos + len(s.token_ids)))
            if s.sample:
                sample_rows.append(len(ids) - 1)
        rows = [(s.start_pos, len(s.token_ids), s.block_table) for s in batch.seqs]
        num_real = len(sample_rows)
        for pad in batch.padding:  # after the real rows: every scratch-table position is the scratch block
            end = pad.start_pos + pad.num_tokens
            ids.extend([0] * pad.num_tokens)
            pos.extend(range(pad.start_pos, end))
            rows.append((pad.start_pos, pad.num_tokens, [self.scratch_block] * -(-end // self.block_size)))
            if pad.sample:
                sample_rows.append(len(ids) - 1)
        meta = AttnMeta.build(rows, self.block_size, self.device, self.kernel)
        if self.model.prompt_layers is not None:  # the rows of requests not yet generating, and padded prompts
            meta.prompt_rows = split_rows([(len(s.token_ids), s.output_index == 0) for s in batch.seqs]
                                          + [(p.num_tokens, p.num_tokens > 1) for p in batch.padding])
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions = torch.tensor(pos, dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, positions, meta, self.kv_caches)  # [T, H]
        with torch.inference_mode():
            if spans and scores is not None:
                for s, row in spans:
                    lp = torch.log_softmax(self.model.logits(hidden[row:row + len(s.prompt_targets)]).float(), dim=-1)
                    scores[s.request_id] = token_logprobs(lp, s.prompt_targets,
                                                          [s.params.prompt_logprobs] * len(s.prompt_targets))
            if len(sample_rows) == len(ids):  # every row samples (decodes only): no gathered copy
                logits = self.model.logits(hidden)
            else:
                logits = self.model.logits(hidden[torch.tensor(sample_rows, dtype=torch.long, device=self.device)])
            return logits if num_real == len(sample_rows) else logits[:num_real]

    def prompt_logprobs(self, token_ids: list[int], block_table: list[int], chunk_tokens: int = 512) -> torch.Tensor:
        """Scores a token sequence: float32 [n - 1], entry i - 1 = log P(token_ids[i] |
        token_ids[:i]) under this runner's model and numerics (matrix-product and KV cache
        dtypes included), the quantity perplexity and prompt logprobs are made of. The sequence
        runs as a chunked prefill of `chunk_tokens` tokens a step, its K/V written into the
        blocks of `block_table`, which must cover len(token_ids) tokens and which the caller
        owns (no running request may hold them)."""
        n = len(token_ids)
        if len(block_table) * self.block_size < n:
            raise ValueError(f"block_table covers {len(block_table) * self.block_size} tokens, need {n}")
        if n > self.max_model_len:
            raise ValueError(f"{n} tokens exceed the model's context of {self.max_model_len}")
        targets = torch.tensor(token_ids[1:], dtype=torch.long, device=self.device)
        out: list[torch.Tensor] = []
        for start in range(0, n - 1, chunk_tokens):
            chunk = token_ids[start:min(n - 1, start + chunk_tokens)]  # the last token predicts nothing
            meta = AttnMeta.build([(start, len(chunk), block_table)], self.block_size, self.device, self.kernel)
            meta.prompt_rows = ALL_ROWS
            hidden = self.model(torch.tensor(chunk, dtype=torch.long, device=self.device),
                                torch.arange(start, start + len(chunk), dtype=torch.long, device=self.device),
                                meta, self.kv_caches)
            with torch.inference_mode():
                logp = torch.log_softmax(self.model.logits(hidden), dim=-1)
                out.append(logp.gather(1, targets[start:start + len(chunk), None]).squeeze(1))
        return torch.cat(out) if out else torch.zeros(0)

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        t0 = time.perf_counter()
        outer, self._paused = self._paused, 0.0  # a step run inside another's pause keeps its own count
        try:
            sampled, logprobs, scores = self._sample(batch)
            return StepOutput(sampled, time.perf_counter() - t0 - self._paused, logprobs, scores or None)
        finally:
            self._paused = outer

    def _sample(self, batch: ScheduledBatch) -> tuple[dict[str, int], dict | None, dict]:
        scores: dict = {}
        logits = self.compute_logits(batch, scores)
        seqs = [s for s in batch.seqs if s.sample]
        sampled: dict[str, int] = {}
        logprobs = None
        if seqs:
            with torch.inference_mode():  # the logits are inference tensors: adjustments write in place
                want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
                lp = log_probs(logits, want) if want else None  # before sampling rewrites any row
                toks = sample(logits, [s.params for s in seqs], [s.output_index for s in seqs], self.generator,
                              history=[s.history for s in seqs], eos_token_id=self.cfg.eos_token_id,
                              allowed=[s.allowed for s in seqs])
                if want:
                    logprobs = {seqs[i].request_id: e for i, e in zip(want, token_logprobs(
                        lp, [toks[i] for i in want], [seqs[i].params.logprobs for i in want]))}
            sampled = {s.request_id: t for s, t in zip(seqs, toks)}
        return sampled, logprobs, scores

    # --- KV hand-off (disaggregated prefill/decode, batchserve.distributed) ---------------
    def _slots(self, block_table: list[int], n: int) -> torch.Tensor:
        pos = torch.arange(n)
        table = torch.tensor(block_table, dtype=torch.long)
        return (table[pos // self.block_size] * self.block_size + pos % self.block_size).to(self.device)

    def export_kv(self, block_table: list[int], n: int) -> torch.Tensor:
        """The K/V of a request's first `n` positions, as one CPU tensor [layers, 2, n, kv_heads, head_dim]."""
        if self.kv_dtype == torch.uint8:  # dequantized: [blocks, n_kv, bs, hd] -> positions
            blocks = torch.tensor(block_table[:(n + self.block_size - 1) // self.block_size], dtype=torch.long)
            return torch.stack([torch.stack([x.transpose(1, 2).reshape(-1, *x.shape[1::2])[:n]  # [n, n_kv, hd]
                                             for x in self.kernel.kv_int8_load(k, v, blocks)])
                                for k, v in self.kv_caches])
        slots = self._slots(block_table, n)
        with torch.inference_mode():
            rows = slot_rows(slots, self.cfg.num_kv_heads, self.block_size)
            out = torch.stack([torch.stack((gather_rows(k, rows), gather_rows(v, rows))) for k, v in self.kv_caches])
        return out.cpu()

    def import_kv(self, block_table: list[int], kv: torch.Tensor) -> None:
        """Write `kv` (as export_kv returns it) into the blocks of `block_table`."""
        n = kv.shape[2]
        expect = (len(self.kv_caches), 2, n, self.cfg.num_kv_heads, self.cfg.head_dim)
        if tuple(kv.shape) != expect:
            raise ValueError(f"KV hand-off: shape {tuple(kv.shape)} does not match this model's {expect}")
        slots = self._slots(block_table, n)
        if self.kv_dtype == torch.uint8:  # quantized as the kernels store a token's rows
            for layer, (k, v) in enumerate(self.kv_caches):
                self.kernel.kv_int8_store(k, v, kv[layer, 0], kv[layer, 1], slots)
            return
        kv = to_cache_dtype(kv.to(self.device), self.kv_dtype)
        rows = slot_rows(slots, self.cfg.num_kv_heads, self.block_size)
        with torch.inference_mode():
            for layer, (k, v) in enumerate(self.kv_caches):
                scatter_rows(k, rows, kv[layer, 0])
                scatter_rows(v, rows, kv[layer, 1])
