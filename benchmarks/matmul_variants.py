"""Which matrix-product path is fastest here, at the model's own shapes and batch sizes?

    python -m benchmarks.matmul_variants --out BENCHMARKS.md     # about 2 minutes

Every variant runs all 30 layers' four fused matrices (QKV, O, gate/up, down; distinct tensors,
so weights stream from memory as in a real decode step) for M rows, median of several passes,
variants interleaved in one process:

- fp32 `F.linear(x, W)` with W [out, in] (MKL) — the model's path before the oneDNN one;
- fp32 C++ panel GEMM on weights packed once into 32-column panels (`runner/csrc/gemm.cpp`) —
  the default where the CPU has AVX-512;
- GGUF Q4_1 / Q8_0 blocks (Q4_0 and Q4_K files use the Q4_1 panels) multiplied by the same C++ GEMM, expanded to fp32 in registers
  (`--quantized-weights auto`, the default for such files: 0.75 / 1.125 bytes a weight);
- the same blocks times activations quantized to int16 or int8 per 32 k, integer dot products
  (`--matmul-dtype int16 / int8`, AVX512-VNNI; the quantization of x is inside the timed call);
- fp32 oneDNN linear on weights packed once (`runner/models/llama.Linear`) — the default before
  the panel GEMM, and where it has no AVX-512 path;
- fp32 `x @ Wt` with W stored transposed [in, out];
- fp32 MKL packed GEMM (`torch.ops.mkl._mkl_linear`, weights packed once for a batch size);
- int8 weight-only (`torch.ops.aten._weight_int8pack_mm`: int8 weights, per-channel scales,
  fp32 activations) — a quarter of the weight bytes, for the memory-bound small batches;
- bf16 `F.linear` (weights and activations bf16), for reference; bf16 oneDNN on packed weights
  and the panel GEMM's bf16 path (the `--matmul-dtype bfloat16` backends).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys

import torch
import torch.nn.functional as F

from batchserve.runner.models.llama import Linear, LlamaConfig, cpp_bf16_ok, cpp_linear_ok, onednn_linear_ok
from benchmarks.report_md import publish
from benchmarks.roofline import layer_shapes, median_time

TITLE = "## Matrix-product variants at the model's shapes"


def variants(cfg: LlamaConfig, m: int) -> dict[str, object]:
    """name -> a function running every layer's matrices once for `m` rows."""
    shapes = layer_shapes(cfg)
    torch.manual_seed(0)
    w32 = [[torch.randn(o, i) * 0.02 for i, o in shapes] for _ in range(cfg.num_layers)]
    xs = [torch.randn(m, i) for i, _ in shapes]
    out: dict[str, object] = {}
    out["fp32 F.linear (MKL)"] = lambda: [F.linear(x, w) for layer in w32 for x, w in zip(xs, layer)]
    if cpp_linear_ok(torch.zeros(1)):
        cp = [[Linear(w, "cpp") for w in layer] for layer in w32]
        out["fp32 C++ panel GEMM (model default on AVX-512)"] = lambda: [
            lin(x) for layer in cp for x, lin in zip(xs, layer)]
    if onednn_linear_ok(torch.zeros(1)):
        od = [[Linear(w, "onednn") for w in layer] for layer in w32]
        out["fp32 oneDNN on packed weights"] = lambda: [
            lin(x) for layer in od for x, lin in zip(xs, layer)]
    if cpp_linear_ok(torch.zeros(1)):
        try:
            import gguf
        except ImportError:
            gguf = None
        for kind, fmt in (("Q4_1", 0), ("Q8_0", 1)) if gguf else ():
            qt = gguf.GGMLQuantizationType[kind]
            ql = [[Linear.from_blocks(torch.from_numpy(gguf.quantize(w.numpy(), qt)), fmt) for w in layer]
                  for layer in w32]
            name = f"GGUF {kind} blocks, C++ GEMM, fp32 math" + (" (model default for Q4_1 files)" if fmt == 0 else "")
            out[name] = lambda ql=ql: [lin(x) for layer in ql for x, lin in zip(xs, layer)]
            raws = [[torch.from_numpy(gguf.quantize(w.numpy(), qt)) for w in layer] for layer in w32]
            for bits in (16, 8):
                il = [[Linear.from_blocks(r, fmt, act_bits=bits) for r in layer] for layer in raws]
                out[f"GGUF {kind} blocks x int{bits} activations (--matmul-dtype int{bits}, VNNI)"] = lambda il=il: [
                    lin(x) for layer in il for x, lin in zip(xs, layer)]
    wt = [[w.t().contiguous() for w in layer] for layer in w32]
    out["fp32 x @ W^T stored transposed"] = lambda: [x @ w for layer in wt for x, w in zip(xs, layer)]
    try:
        packed = [[torch.ops.mkl._mkl_reorder_linear_weight(w, m) for w in layer] for layer in w32]
        out["fp32 MKL packed GEMM"] = lambda: [torch.ops.mkl._mkl_linear(x, p, w, None, m)
                                               for layer, pl in zip(w32, packed) for x, w, p in zip(xs, layer, pl)]
    except (RuntimeError, AttributeError):
        pass
    try:
        q = []
        for layer in w32:
            row = []
            for w in layer:
                s = w.abs().amax(1) / 127
                row.append((torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8), s))
            q.append(row)
        torch.ops.aten._weight_int8pack_mm(xs[0], q[0][0][0], q[0][0][1])
        out["int8 weight-only (_weight_int8pack_mm)"] = lambda: [
            torch.ops.aten._weight_int8pack_mm(x, wq, s) for layer in q for x, (wq, s) in zip(xs, layer)]
    except (RuntimeError, AttributeError):
        pass
    wb = [[w.bfloat16() for w in layer] for layer in w32]
    xb = [x.bfloat16() for x in xs]
    out["bf16 F.linear"] = lambda: [F.linear(x, w) for layer in wb for x, w in zip(xb, layer)]
    if onednn_linear_ok(torch.zeros(1)):
        ob = [[Linear(w, "onednn") for w in layer] for layer in wb]
        out["bf16 oneDNN on packed weights"] = lambda: [lin(x) for layer in ob for x, lin in zip(xb, layer)]
    if cpp_bf16_ok():
        cb = [[Linear(w, "cpp") for w in layer] for layer in wb]
        out["bf16 C++ panel GEMM (AVX512-BF16, fp32 out)"] = lambda: [
            lin(x) for layer in cb for x, lin in zip(xb, layer)]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--rows", default="1,8,32,64,128,512")
    p.add_argument("--reps", type=int, default=7)
    a = p.parse_args(argv)
    cfg = LlamaConfig()  # SmolLM2-135M's shape
    rows = [int(r) for r in a.rows.split(",")]
    table: dict[str, dict[int, float]] = {}
    with torch.inference_mode():
        for m in rows:
            fns = variants(cfg, m)
            for _ in range(2):  # interleave: each variant twice, keep the better median
                for name, fn in fns.items():
                    t = median_time(fn, a.reps) * 1e3
                    table.setdefault(name, {})[m] = min(t, table.get(name, {}).get(m, t))
            print(f"M={m}: " + ", ".join(f"{n} {table[n][m]:.1f} ms" for n in fns), file=sys.stderr)
    base = table["fp32 F.linear (MKL)"]
    lines = [TITLE, "", f"`python -m benchmarks.matmul_variants {' '.join(argv or sys.argv[1:])}` — "
             f"{datetime.date.today().isoformat()}, {platform.machine()}, {os.cpu_count()} cores, torch "
             f"{torch.__version__}, {torch.get_num_threads()} threads. Milliseconds for all 30 layers' QKV, O, "
             "gate/up and down products (LM head excluded); in brackets, time relative to F.linear.", "",
             "| variant | " + " | ".join(f"M={m}" for m in rows) + " |", "|---|" + "---|" * len(rows)]
    for name, by_m in table.items():
        cells = [f"{by_m[m]:.1f} ({by_m[m] / base[m]:.2f}×)" for m in rows]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    return publish(text, a.out, TITLE)


if __name__ == "__main__":
    sys.exit(main())
