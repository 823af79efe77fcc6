"""torch.compile trial (issue 9, item 2): does compiling the forward pass pay on this machine?

    python -m batchserve.bench.compile_trial --out FILE.md [--reps 3] [--model dummy]

One process, one loaded model, every variant timed in the same run, the variants' order
rotating from repeat to repeat; the table gives medians over the repeats. Variants:

  eager             today's forward (attention_backend auto: the C++ decode kernel)
  eager-torch-attn  today's forward with the pure-PyTorch decode attention
  compile-forward   torch.compile(LlamaModel.forward, dynamic=True) as it stands: Dynamo breaks
                    the graph at the C++ kernel call, so it compiles pieces between breaks
  compile-blocks    per layer, two compiled functions: norm + QKV + rope, and O projection +
                    residual + norm + MLP + residual; attention eager in between
  compile-elem      only the elementwise pieces compiled (rope, residual add + norm, silu*up)
  compile-graph     the whole forward as one graph: attention goes in as an opaque custom op
                    (it reads the step's AttnMeta from a side slot, so no Python-level metadata
                    reaches the graph and nothing in it depends on the batch's composition)
  compile-frozen    compile-graph with inductor's `freezing` (weights become constants, and
                    inductor swaps every linear for oneDNN's on pre-packed weights; in the
                    graph it specialises for T = 1, MKL's packed GEMM instead), LM head too
  compile-frozen-autotune   (--autotune) compile-frozen with max_autotune; long compile
  eager-onednn      no compile: today's forward with each F.linear replaced by oneDNN's linear
                    on weights packed once at start (the part of compile-frozen that is not
                    compilation)

Compile times are measured cold: inductor gets a fresh cache directory unless --warm-cache.
"Graphs +N" counts graphs Dynamo compiled after the first call (at 32 tokens) while the same
variant then ran 8, 64, 1 and 1024 tokens; with dynamic shapes it should stay 0 except for
T = 1, which Dynamo specialises (sizes 0 and 1 always get their own graph).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch._dynamo
import torch._inductor.config as inductor_config
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

from batchserve.bench.foundation import GREEDY, write_section
from batchserve.bench.roofline import median_time
from batchserve.config import CacheConfig, ModelConfig
from batchserve.core.batch import ScheduledBatch, ScheduledSeq
from batchserve.core.kv_cache import KVCacheManager
from batchserve.runner.attention import AttnMeta, paged_attention
from batchserve.runner.models.llama import Linear, LlamaModel, apply_rope, rms_norm

HEADING = "## torch.compile trial"
DECODE_BATCHES = (1, 8, 32, 64)
CTX = 128
PREFILL = (4, 256)  # sequences x prompt tokens

# --- attention as an opaque op -------------------------------------------------------------
# The compiled graph sees only tensors; the step's AttnMeta (Python lists, per-request spans,
# the kernel handle) is parked here by the caller for the duration of one forward.
_STEP_META: list[AttnMeta | None] = [None]


@torch.library.custom_op("batchserve_trial::paged_attention", mutates_args=("k_cache", "v_cache"))
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor) -> torch.Tensor:
    meta = _STEP_META[0]
    assert meta is not None, "attention op called outside a step"
    return paged_attention(q, k, v, k_cache, v_cache, meta)


@_attention_op.register_fake
def _(q, k, v, k_cache, v_cache):
    return torch.empty_like(q)


def _layers(cfg, x, cos, sin, layers, kv_caches, attend: Callable, lin: Callable) -> torch.Tensor:
    """The decoder layers of LlamaModel.forward with the attention and the linear pluggable."""
    nq, nkv, hd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim
    T = x.shape[0]
    for layer, (kc, vc) in zip(layers, kv_caches):
        h = rms_norm(x, layer["attn_norm"], cfg.rms_norm_eps)
        qkv = lin(h, layer["wqkv"])
        q = apply_rope(qkv[:, :nq].view(T, cfg.num_heads, hd), cos, sin)
        k = apply_rope(qkv[:, nq:nq + nkv].view(T, cfg.num_kv_heads, hd), cos, sin)
        v = qkv[:, nq + nkv:].view(T, cfg.num_kv_heads, hd)
        o = attend(q, k, v, kc, vc)
        x = x + lin(o.reshape(T, nq), layer["wo"])
        h = rms_norm(x, layer["mlp_norm"], cfg.rms_norm_eps)
        gate, up = lin(h, layer["w_gate_up"]).chunk(2, dim=-1)
        x = x + lin(F.silu(gate) * up, layer["w_down"])
    return x


def dense_layers(model: LlamaModel) -> list[dict[str, torch.Tensor]]:
    """The layers' weights as plain tensors (the trial runs its runner with linear_backend=torch,
    so these are the model's own tensors, not copies)."""
    return [{k: (v.weight if isinstance(v, Linear) else v) for k, v in layer.items()} for layer in model.layers]


class _GraphModel(nn.Module):
    """The model's weights as (non-trainable) parameters sharing storage with LlamaModel's, so
    that inductor's freezing can treat them as constants; forward is one graph."""

    def __init__(self, model: LlamaModel) -> None:
        super().__init__()

        def p(t: torch.Tensor) -> nn.Parameter:
            return nn.Parameter(t, requires_grad=False)

        self.cfg = model.cfg
        self.embed, self.norm = p(model.embed), p(model.norm)
        self.layers = nn.ModuleList(nn.ParameterDict({k: p(t) for k, t in layer.items()})
                                    for layer in dense_layers(model))
        self.register_buffer("inv_freq", model.inv_freq, persistent=False)

    def forward(self, input_ids, positions, kv_caches):
        return self.run(input_ids, positions, kv_caches)

    def run(self, input_ids, positions, kv_caches):
        f = positions.float()[:, None] * self.inv_freq[None, :]
        cos, sin = f.cos()[:, None, :], f.sin()[:, None, :]
        x = F.embedding(input_ids, self.embed)
        x = _layers(self.cfg, x, cos, sin, self.layers, kv_caches, _attention_op, F.linear)
        return rms_norm(x, self.norm, self.cfg.rms_norm_eps)


# Dynamo keeps compiled graphs per code object, and the frozen variants differ from
# compile-graph only in inductor's config (which Dynamo's guards do not see): each gets a
# forward of its own so that none reuses another's graph.
class _FrozenGraphModel(_GraphModel):
    def forward(self, input_ids, positions, kv_caches):
        return self.run(input_ids, positions, kv_caches)


class _TunedGraphModel(_GraphModel):
    def forward(self, input_ids, positions, kv_caches):
        return self.run(input_ids, positions, kv_caches)


class _Head(nn.Module):
    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.w = nn.Parameter(w, requires_grad=False)

    def forward(self, hidden):
        return F.linear(hidden, self.w).float()


# --- variants ------------------------------------------------------------------------------
class Variant:
    """Overrides on the runner for one way of running the forward: model.forward, model.logits
    and whether the C++ decode kernel is handed to AttnMeta."""

    def __init__(self, name: str, forward: Callable | None = None, logits: Callable | None = None,
                 kernel: bool = True) -> None:
        self.name, self.forward, self.logits, self.kernel = name, forward, logits, kernel

    def apply(self, runner, kernel) -> None:
        m = runner.model
        for attr in ("forward", "logits"):
            fn = getattr(self, attr)
            if fn is None:
                m.__dict__.pop(attr, None)  # back to the class's method
            else:
                m.__dict__[attr] = fn
        runner.kernel = kernel if self.kernel else None


def _compile(fn, **kw):
    return torch.compile(fn, dynamic=True, **kw)


def make_variants(runner, with_autotune: bool) -> list[Variant]:
    m: LlamaModel = runner.model
    dense = dense_layers(m)
    cfg = m.cfg
    eps = cfg.rms_norm_eps
    nh, nkvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    nq, nkv = nh * hd, nkvh * hd
    out: list[Variant] = [Variant("eager"), Variant("eager-torch-attn", kernel=False)]

    # (c1) the forward as it stands
    whole = _compile(LlamaModel.forward.__wrapped__)

    def fwd_whole(input_ids, positions, meta, kv_caches):
        with torch.inference_mode():
            return whole(m, input_ids, positions, meta, kv_caches)

    out.append(Variant("compile-forward", fwd_whole))

    # (c2) two compiled blocks per layer
    def attn_in(x, norm_w, wqkv, cos, sin):
        T = x.shape[0]
        qkv = F.linear(rms_norm(x, norm_w, eps), wqkv)
        q = apply_rope(qkv[:, :nq].view(T, nh, hd), cos, sin)
        k = apply_rope(qkv[:, nq:nq + nkv].view(T, nkvh, hd), cos, sin)
        return q, k, qkv[:, nq + nkv:].view(T, nkvh, hd)

    def attn_out_mlp(x, o, wo, norm_w, w_gate_up, w_down):
        x = x + F.linear(o.reshape(x.shape[0], nq), wo)
        gate, up = F.linear(rms_norm(x, norm_w, eps), w_gate_up).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, w_down)

    blk_in, blk_out = _compile(attn_in), _compile(attn_out_mlp)

    def fwd_blocks(input_ids, positions, meta, kv_caches):
        with torch.inference_mode():
            cos, sin = m.rope(positions)
            x = F.embedding(input_ids, m.embed)
            for layer, (kc, vc) in zip(dense, kv_caches):
                q, k, v = blk_in(x, layer["attn_norm"], layer["wqkv"], cos, sin)
                o = paged_attention(q, k, v, kc, vc, meta)
                x = blk_out(x, o, layer["wo"], layer["mlp_norm"], layer["w_gate_up"], layer["w_down"])
            return rms_norm(x, m.norm, eps)

    out.append(Variant("compile-blocks", fwd_blocks))

    # (c3) elementwise pieces only; each layer's closing residual+norm is fused with the next norm
    def rope_split(qkv, cos, sin):
        T = qkv.shape[0]
        return (apply_rope(qkv[:, :nq].view(T, nh, hd), cos, sin),
                apply_rope(qkv[:, nq:nq + nkv].view(T, nkvh, hd), cos, sin),
                qkv[:, nq + nkv:].view(T, nkvh, hd))

    def add_norm(x, d, w):
        x = x + d
        return x, rms_norm(x, w, eps)

    def silu_mul(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def norm(x, w):
        return rms_norm(x, w, eps)

    c_rope, c_add_norm, c_silu, c_norm = (_compile(f) for f in (rope_split, add_norm, silu_mul, norm))

    def fwd_elem(input_ids, positions, meta, kv_caches):
        with torch.inference_mode():
            cos, sin = m.rope(positions)
            x = F.embedding(input_ids, m.embed)
            T = x.shape[0]
            h = c_norm(x, dense[0]["attn_norm"])
            for i, (layer, (kc, vc)) in enumerate(zip(dense, kv_caches)):
                q, k, v = c_rope(F.linear(h, layer["wqkv"]), cos, sin)
                o = paged_attention(q, k, v, kc, vc, meta)
                x, h = c_add_norm(x, F.linear(o.reshape(T, nq), layer["wo"]), layer["mlp_norm"])
                d = F.linear(c_silu(F.linear(h, layer["w_gate_up"])), layer["w_down"])
                nxt = dense[i + 1]["attn_norm"] if i + 1 < len(dense) else m.norm
                x, h = c_add_norm(x, d, nxt)
            return h

    out.append(Variant("compile-elem", fwd_elem))

    # (c4, c5) one graph, attention opaque; (c5) frozen weights, head compiled frozen too.
    # Inductor reads `freezing` from its global config when it compiles (torch.compile's
    # options= does not reach it), so the frozen variants patch the config around each call.
    def graph_forward(compiled, inductor_cfg: dict):
        def fwd(input_ids, positions, meta, kv_caches):
            _STEP_META[0] = meta
            try:
                with torch.inference_mode(), inductor_config.patch(inductor_cfg):
                    return compiled(input_ids, positions, kv_caches)
            finally:
                _STEP_META[0] = None
        return fwd

    out.append(Variant("compile-graph", graph_forward(_compile(_GraphModel(m).eval()), {})))
    frozen = {"freezing": True}
    frozen_head = _compile(_Head(m.lm_head.weight).eval())

    def head(hidden):
        with torch.inference_mode(), inductor_config.patch(frozen):
            return frozen_head(hidden)

    out.append(Variant("compile-frozen", graph_forward(_compile(_FrozenGraphModel(m).eval()), frozen), head))
    if with_autotune:
        tuned = {"freezing": True, "max_autotune": True}
        out.append(Variant("compile-frozen-autotune", graph_forward(_compile(_TunedGraphModel(m).eval()), tuned),
                           head))

    # (d) oneDNN linear on pre-packed weights, no compile
    if torch.backends.mkldnn.is_available() and m.embed.dtype == torch.float32:
        pack = torch.ops.mkldnn._reorder_linear_weight
        packed = [{k: (pack(t, None) if t.dim() == 2 else t) for k, t in layer.items()} for layer in dense]
        packed_head = pack(m.lm_head.weight, None)
        lp = torch.ops.mkldnn._linear_pointwise

        def lin(x, w):
            return lp(x, w, None, "none", [-1], "")

        def fwd_onednn(input_ids, positions, meta, kv_caches):
            with torch.inference_mode():
                cos, sin = m.rope(positions)
                x = F.embedding(input_ids, m.embed)
                x = _layers(cfg, x, cos, sin, packed, kv_caches,
                            lambda q, k, v, kc, vc: paged_attention(q, k, v, kc, vc, meta), lin)
                return rms_norm(x, m.norm, eps)

        def head_onednn(hidden):
            return lin(hidden, packed_head).float()

        out.append(Variant("eager-onednn", fwd_onednn, head_onednn))
    return out


# --- batches -------------------------------------------------------------------------------
def decode_batch(kv: KVCacheManager, tag: str, batch: int, ctx: int) -> ScheduledBatch:
    """As foundation.decode_batch, with request ids unique to this batch so that several
    batches can live in the cache at once."""
    seqs = []
    for i in range(batch):
        rid = f"{tag}{i}"
        kv.allocate(rid, ctx + 1)
        seqs.append(ScheduledSeq(rid, [100 + i], ctx, kv.block_table(rid), True, GREEDY, 0))
    return ScheduledBatch(seqs)


def prefill_batch(kv: KVCacheManager, nseq: int, plen: int) -> ScheduledBatch:
    seqs = []
    for i in range(nseq):
        kv.allocate(f"p{i}", plen)
        seqs.append(ScheduledSeq(f"p{i}", list(range(200 + i, 200 + i + plen)), 0, kv.block_table(f"p{i}"),
                                 True, GREEDY, 0))
    return ScheduledBatch(seqs)


# --- the run -------------------------------------------------------------------------------
def run(a: argparse.Namespace) -> str:
    from batchserve.profile import TINY_MODEL
    from batchserve.runner.loader import load_model
    from batchserve.runner.model_runner import ModelRunner

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 16)
    t_start = time.perf_counter()
    mcfg = ModelConfig(model=a.model, dummy_config=TINY_MODEL if a.model == "dummy" else None,
                       linear_backend="torch")  # the trial's baseline: F.linear (MKL), as when it was run
    runner = ModelRunner(load_model(mcfg), mcfg, CacheConfig(kv_cache_gb=a.kv_cache_gb))
    kernel = runner.kernel
    with torch.inference_mode():
        gen = torch.Generator().manual_seed(0)
        for k, v in runner.kv_caches:  # a plausible history rather than zeros
            k.normal_(generator=gen)
            v.normal_(generator=gen)
    kv = KVCacheManager(runner.num_blocks, runner.block_size)
    batches = {f"decode {b}": decode_batch(kv, f"b{b}_", b, CTX) for b in DECODE_BATCHES}
    batches[f"prefill {PREFILL[0]}x{PREFILL[1]}"] = prefill_batch(kv, *PREFILL)
    names = list(batches)
    ref_key = "decode 32"
    variants = make_variants(runner, a.autotune)
    if a.only:
        keep = set(a.only.split(",")) | {"eager"}
        variants = [v for v in variants if v.name in keep]

    # first calls: compile time, recompiles over other shapes, logits against eager
    info: dict[str, dict] = {}
    ref: dict[str, torch.Tensor] = {}
    first_order = [ref_key] + [n for n in names if n != ref_key]
    for var in variants:
        var.apply(runner, kernel)
        g0 = counters["stats"]["unique_graphs"]
        packs0 = counters["inductor"]["mkldnn_linear_weight_pack_matcher_count"]
        t = time.perf_counter()
        first = runner.compute_logits(batches[ref_key])
        compile_s = time.perf_counter() - t
        g1 = counters["stats"]["unique_graphs"]
        extra: list[str] = []
        outs = {ref_key: first}
        for n in first_order[1:]:
            before = counters["stats"]["unique_graphs"]
            t = time.perf_counter()
            outs[n] = runner.compute_logits(batches[n])
            dt = time.perf_counter() - t
            if counters["stats"]["unique_graphs"] > before:
                extra.append(f"{n.split()[1] if n.startswith('decode') else 'prefill'} "
                             f"(+{counters['stats']['unique_graphs'] - before}, {dt:.0f} s)")
        if var.name == "eager":
            ref = outs
        diff = max((outs[n] - ref[n]).abs().max().item() for n in names)
        packs = counters["inductor"]["mkldnn_linear_weight_pack_matcher_count"] - packs0
        info[var.name] = dict(compile_s=compile_s if g1 > g0 else None, graphs=g1 - g0, extra=extra,
                              diff=diff, packs=packs)
        print(f"{var.name}: first call {compile_s:.1f} s, graphs {g1 - g0}, later {extra}, "
              f"max |dlogit| {diff:.2e}, linears packed by inductor {packs}", flush=True)
    scale = max(r.abs().max().item() for r in ref.values())

    # timing: `reps` rounds, the variants' order rotating each round
    times: dict[str, dict[str, list[float]]] = {v.name: {n: [] for n in names} for v in variants}
    for rep in range(a.reps):
        order = variants[rep % len(variants):] + variants[:rep % len(variants)]
        for var in order:
            var.apply(runner, kernel)
            for n in names:
                calls = 1 if n.startswith("prefill") else 5
                times[var.name][n].append(median_time(lambda: runner.compute_logits(batches[n]), calls))
        print(f"round {rep + 1}/{a.reps} done ({time.perf_counter() - t_start:.0f} s)", flush=True)
    Variant("eager").apply(runner, kernel)

    med = {v: {n: statistics.median(ts) for n, ts in d.items()} for v, d in times.items()}
    ratio32 = {v: [t / e for t, e in zip(times[v][ref_key], times["eager"][ref_key])] for v in times}
    head = "| variant | " + " | ".join(n.replace("decode ", "B=") for n in names) + \
           " | B=32 vs eager (per round) | first call s | graphs +N after | linears packed | max abs Δlogit |"
    lines = [head, "|" + "---|" * (len(names) + 6)]
    for var in variants:
        d, i = med[var.name], info[var.name]
        rs = ratio32[var.name]
        first = "–" if i["compile_s"] is None else f"{i['compile_s']:.0f}"
        extra = ", ".join(i["extra"]) if i["extra"] else ("0" if i["graphs"] else "–")
        lines.append(f"| {var.name} | " + " | ".join(f"{d[n] * 1e3:.1f}" for n in names)
                     + f" | {statistics.median(rs):.2f} ({min(rs):.2f}–{max(rs):.2f}) | {first} | {extra} | "
                     f"{i['packs'] or '–'} | {i['diff']:.1e} |")
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    cmd = "python -m batchserve.bench.compile_trial" + (f" --model {a.model}" if a.model != mcfg.__class__.model else "")
    text = (f"{HEADING}\n\nCommand: `{cmd}`, {stamp}; {platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads; "
            f"{a.reps} rounds, whole run {time.perf_counter() - t_start:.0f} s.\n\n"
            f"Step ms (compute_logits: forward + LM head on the sampled rows), decode at {CTX}-token "
            f"context and one prefill of {PREFILL[0]} x {PREFILL[1]} tokens; medians over the rounds. "
            f"'first call s' is the first call at decode 32 with a cold inductor cache (compilation); "
            f"'graphs +N' lists the later shapes that made Dynamo compile again, with the time that "
            f"call took (all dynamic=True); 'linears packed' counts the matrix products (over all the variant's graphs) inductor moved "
            f"onto oneDNN with pre-packed weights; logits differences are against eager over all "
            f"five batches (largest |logit| {scale:.0f}).\n\n" + "\n".join(lines) + "\n"
            + summary(med, ratio32, ref_key))
    return text


def summary(med: dict, ratio32: dict, ref_key: str) -> str:
    """One line of facts: how each family of variants compares with eager at batch 32."""
    def best(prefix: str, exclude: str = "~") -> str:
        names = [v for v in med if v.startswith(prefix) and exclude not in v]
        if not names:
            return "not run"
        v = min(names, key=lambda n: statistics.median(ratio32[n]))
        return f"{v} {statistics.median(ratio32[v]):.2f}x eager"

    return (f"\nAt batch 32 the best compiled variant without weight freezing is "
            f"{best('compile-', 'frozen')}; with freezing {best('compile-frozen')}; no compile, "
            f"oneDNN linear {best('eager-onednn')} (step time ratios, median over rounds).\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="markdown file to write (its section replaced)")
    ap.add_argument("--model", default=ModelConfig.model)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--kv-cache-gb", type=float, default=0.75)
    ap.add_argument("--autotune", action="store_true",
                    help="also compile-frozen with max_autotune (long compile)")
    ap.add_argument("--warm-cache", action="store_true", help="keep inductor's usual cache directory")
    ap.add_argument("--only", default=None, help="comma-separated variant names (eager is always run)")
    a = ap.parse_args(argv)
    cache = None
    if not a.warm_cache:  # a fresh inductor cache, so that first calls show cold compile times
        cache = tempfile.mkdtemp(prefix="bs_compile_trial_")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    try:
        text = run(a)
    finally:
        if cache:
            shutil.rmtree(cache, ignore_errors=True)
    print(text)
    if a.out:
        write_section(a.out, HEADING, text)


if __name__ == "__main__":
    main()
