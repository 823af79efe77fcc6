"""The `--device cuda` path on a GPU, checked in one run: numerics against the CPU's float32
reference, the engine's features, offline throughput, and the HTTP server.

    python -m benchmarks.cuda_check --json out.json --md out.md [--stages dummy,quality,speed,http,profile]

Stages (each runs on its own; a failure is recorded with its traceback and the next goes on):
- dummy: random weights (`--model dummy`), CUDA against the CPU's PyTorch float32 path on the
  same weights: max |Δ log P| over a 700-token prompt scored as a chunked prefill; then every
  sampling option (temperature / top-k / top-p with seeds, penalties, logit_bias, min_tokens,
  logprobs, prompt_logprobs) and a prompt longer than the step's token budget, all in one
  generate call, and the KV hand-off (export_kv, import_kv into other blocks, export again).
- quality: the default model (SmolLM2-135M-Instruct, Q4_1 GGUF), perplexity on
  benchmarks/data/pd_english.txt and greedy agreement (benchmarks/perplexity.py's scheme and
  prompts) for CUDA float32 / bfloat16 / float16 against the CPU reference: the GGUF's matrices
  dequantized to float32, PyTorch ops (`--quantized-weights off --matmul-dtype float32
  --kv-cache-dtype float32 --attention-backend torch --linear-backend torch`).
- speed: the 64-request offline workload of benchmarks/foundation.py on CUDA per dtype and
  max_num_seqs; transformers' generate on the same GPU as one static batch of the same requests.
- http: `batchserve serve --device cuda` in a subprocess; 32 concurrent chat completions, one
  streamed, one with a JSON schema, a bad request (expects 400 naming the field), /metrics.
- profile: `batchserve profile --device cuda`: the step-time sweep and the knee it finds.

The C++ kernels are CPU-only and are not built here: the CPU reference runs on PyTorch ops.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback

import numpy as np
import torch

DEVICE = "cuda"  # --device: cpu runs the script itself here, as a dry run
STAGES = ("dummy", "quality", "speed", "http", "profile")
MODEL = "smollm2-135m-instruct"
CPU_REF = {"device": "cpu", "quantized_weights": "off", "matmul_dtype": "float32", "kv_cache_dtype": "float32",
           "attention_backend": "torch", "linear_backend": "torch"}


def no_cpp_kernels() -> None:
    """Mark every C++ kernel unavailable: nothing compiles, and the CPU runs PyTorch ops."""
    from batchserve.runner import kernels

    for name in kernels.KERNELS:
        kernels._cached[name] = None


def stage_dummy() -> dict:
    from batchserve.llm import LLM
    from batchserve.request import SamplingParams

    out: dict = {}
    gpu = LLM(model="dummy", device=DEVICE, kv_cache_gb=1.0, max_num_seqs=32, max_num_batched_tokens=256)
    cpu = LLM(model="dummy", kv_cache_gb=0.5, max_num_seqs=32, max_num_batched_tokens=256, **{
        k: v for k, v in CPU_REF.items() if k != "quantized_weights"})
    vocab = gpu.engine.executor.cfg.vocab_size
    ids = np.random.default_rng(0).integers(10, vocab - 10, 700).tolist()
    a, b = np.array(gpu.prompt_logprobs(ids)), np.array(cpu.prompt_logprobs(ids))
    out["logprob_max_abs_diff"] = float(np.abs(a - b).max())
    out["logprob_mean_abs_diff"] = float(np.abs(a - b).mean())
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, top_k=50, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=1.0, min_p=0.05, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.7, presence_penalty=0.5, frequency_penalty=0.3,
                             repetition_penalty=1.2, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.0, logit_bias=((5, 100.0),), ignore_eos=True),
              SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0),
              SamplingParams(max_tokens=12, temperature=0.0, logprobs=5, prompt_logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)]
    prompts = [ids[:20 + 9 * i] for i in range(len(params) - 1)] + [ids[:600]]  # the last > the token budget
    t0 = time.perf_counter()
    res = gpu.generate(prompts, params)
    out["generate_s"] = time.perf_counter() - t0
    out["output_lengths"] = [len(r.token_ids) for r in res]
    out["logit_bias_row_all_5"] = all(t == 5 for t in res[4].token_ids)
    out["logprobs_rows"] = len(getattr(res[6], "logprobs", None) or [])
    assert out["output_lengths"] == [12] * len(params), out["output_lengths"]
    assert out["logit_bias_row_all_5"], res[4].token_ids
    same = gpu.generate(prompts[1:2], params[1:2])[0].token_ids
    out["seeded_sample_repeats"] = same == res[1].token_ids
    # the KV hand-off: a prompt's K/V exported, imported into other blocks, exported again
    runner, kv = gpu.engine.executor, gpu.engine.kv
    kv.allocate("src", 100), kv.allocate("dst", 100)
    try:
        runner.prompt_logprobs(ids[:100], kv.block_table("src"))
        x = runner.export_kv(kv.block_table("src"), 100)
        runner.import_kv(kv.block_table("dst"), x)
        y = runner.export_kv(kv.block_table("dst"), 100)
        out["kv_handoff_equal"] = bool(torch.equal(x, y))
        out["kv_handoff_shape"] = list(x.shape)
    finally:
        kv.free("src"), kv.free("dst")
    assert out["kv_handoff_equal"]
    return out


def stage_quality() -> dict:
    from benchmarks.perplexity import PROMPTS, TEXT, run_batchserve, windows
    from batchserve.config import ModelConfig
    from batchserve.runner.loader import load_tokenizer

    tok = load_tokenizer(ModelConfig())
    with open(TEXT) as fh:
        ids = tok.encode(fh.read(), add_special_tokens=False)
    wins = windows(ids, 512)
    configs = [("CPU reference: dequantized float32, PyTorch ops", CPU_REF),
               ("cuda float32 (defaults)", {"device": DEVICE}),
               ("cuda --dtype bfloat16", {"device": DEVICE, "dtype": "bfloat16"}),
               ("cuda --dtype float16", {"device": DEVICE, "dtype": "float16"}),
               ("cuda float32, --kv-cache-dtype bfloat16", {"device": DEVICE, "kv_cache_dtype": "bfloat16"})]
    rows, ref = [], None
    for name, opts in configs:
        t0 = time.perf_counter()
        try:
            r = run_batchserve(opts, wins, 512)
        except Exception as e:  # noqa: BLE001 - recorded, the next configuration goes on
            rows.append({"name": name, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()})
            continue
        lp = np.array(r["logprobs"])
        ref = ref or {"lp": lp, "greedy": r["greedy"]}
        d = np.abs(lp - ref["lp"])
        first_diff = [next((i for i, (x, y) in enumerate(zip(g, h)) if x != y), len(g))
                      for g, h in zip(r["greedy"], ref["greedy"])]
        rows.append({"name": name, "ppl": math.exp(-lp.mean()), "dlogp_mean": float(d.mean()),
                     "dlogp_max": float(d.max()), "greedy_same": sum(g == h for g, h in zip(r["greedy"], ref["greedy"])),
                     "greedy_prefix": float(np.mean(first_diff)), "kv": r["kv"], "mm": r["mm"],
                     "seconds": time.perf_counter() - t0})
        print(f"quality: {rows[-1]}", file=sys.stderr, flush=True)
    return {"tokens": len(ids), "windows": len(wins), "scored": len(ref["lp"]) if ref else 0,
            "prompts": len(PROMPTS), "rows": rows}


def stage_speed(requests: int) -> dict:
    from benchmarks.foundation import offline_workload, run_offline
    from batchserve.llm import LLM

    rows = []
    work = None
    for dtype, seats in (("float32", 64), ("bfloat16", 64), ("bfloat16", 256)):
        llm = LLM(device=DEVICE, dtype=dtype, kv_cache_gb=4.0, max_num_seqs=seats, max_num_batched_tokens=4096)
        work = work or offline_workload(requests, 0, llm.engine.executor.cfg.vocab_size)
        run_offline(llm, work[:8])  # warm-up: CUDA context, allocator, kernels' first launch
        runs = sorted((run_offline(llm, work) for _ in range(2)), key=lambda r: r["tok_s"])
        steps = sum(len(r["steps"]) for r in runs)
        rows.append({"dtype": dtype, "max_num_seqs": seats, "tok_s": [r["tok_s"] for r in runs],
                     "tokens": runs[0]["tokens"], "mean_batch": runs[-1]["mean_batch"],
                     "ms_per_step": 1e3 * sum(r["seconds"] for r in runs) / steps})
        print(f"speed: {rows[-1]}", file=sys.stderr, flush=True)
        del llm
        if DEVICE.startswith("cuda"):
            torch.cuda.empty_cache()
    hf = {}
    try:
        hf = run_hf_cuda(work)
    except Exception as e:  # noqa: BLE001
        hf = {"error": f"{type(e).__name__}: {e}"}
    return {"requests": requests, "rows": rows, "hf": hf}


def sync() -> None:
    if DEVICE.startswith("cuda"):
        torch.cuda.synchronize()


def run_hf_cuda(work) -> dict:
    """transformers on the same GPU, the requests as one left-padded static batch (bf16)."""
    from benchmarks.foundation import hf_model, left_padded

    m = hf_model(torch.bfloat16).to(DEVICE)
    x, mask = (t.to(DEVICE) for t in left_padded(work))
    kw = dict(do_sample=False, eos_token_id=[], pad_token_id=0, max_new_tokens=max(n for _, n in work))
    m.generate(x[:4], attention_mask=mask[:4], **{**kw, "max_new_tokens": 8})  # warm-up
    sync()
    t0 = time.perf_counter()
    m.generate(x, attention_mask=mask, **kw)
    sync()
    dt = time.perf_counter() - t0
    useful = sum(n for _, n in work)
    return {"static_tok_s": useful / dt, "seconds": dt}


def stage_http(port: int) -> dict:
    import httpx

    from benchmarks.standard import wait_healthy

    cmd = [sys.executable, "-m", "batchserve", "serve", "--device", DEVICE, "--port", str(port),
           "--kv-cache-gb", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base, out = f"http://127.0.0.1:{port}", {}
    try:
        t0 = time.perf_counter()
        wait_healthy(base, proc, 180.0)  # on failure, the server's log is in the finally below
        out["startup_s"] = time.perf_counter() - t0

        import asyncio

        async def many() -> list:
            async with httpx.AsyncClient(base_url=base, timeout=120) as c:
                body = lambda i: {"model": MODEL, "max_tokens": 48,  # noqa: E731
                                  "messages": [{"role": "user", "content": f"Name {i % 7 + 2} colours."}]}
                return await asyncio.gather(*(c.post("/v1/chat/completions", json=body(i)) for i in range(32)))

        t0 = time.perf_counter()
        rs = asyncio.run(many())
        out["concurrent_s"] = time.perf_counter() - t0
        out["concurrent_status"] = sorted({r.status_code for r in rs})
        out["concurrent_tokens"] = sum(r.json()["usage"]["completion_tokens"] for r in rs if r.status_code == 200)
        out["sample_answer"] = rs[0].json()["choices"][0]["message"]["content"][:200]
        with httpx.stream("POST", base + "/v1/chat/completions", timeout=60, json={
                "model": MODEL, "max_tokens": 24, "stream": True,
                "messages": [{"role": "user", "content": "Count to five."}]}) as r:
            out["stream_status"] = r.status_code
            chunks = [ln for ln in r.iter_lines() if ln.startswith("data:")]
        out["stream_chunks"], out["stream_done"] = len(chunks), bool(chunks) and chunks[-1].strip() == "data: [DONE]"
        schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
        r = httpx.post(base + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "max_tokens": 40, "messages": [{"role": "user", "content": "Capital of France as JSON."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}})
        out["json_status"] = r.status_code
        text = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else r.text
        try:
            out["json_parsed"] = json.loads(text)
        except ValueError:
            out["json_text"] = text[:300]
        r = httpx.post(base + "/v1/chat/completions", timeout=30, json={"model": MODEL, "max_tokens": -3,
                                                                       "messages": [{"role": "user", "content": "x"}]})
        out["bad_request"] = [r.status_code, r.text[:300]]
        m = httpx.get(base + "/metrics", timeout=10)
        out["metrics_lines"] = len(m.text.splitlines()) if m.status_code == 200 else m.status_code
    finally:
        proc.terminate()
        try:
            log = proc.communicate(timeout=30)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            log = proc.communicate()[0]
        out["server_log_tail"] = log[-2500:]
    return out


def stage_profile(path: str) -> dict:
    cmd = [sys.executable, "-m", "batchserve", "profile", "--device", DEVICE, "--out", path]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    return {"rc": p.returncode, "seconds": time.perf_counter() - t0, "log": (p.stdout + p.stderr)[-4000:]}


def markdown(res: dict) -> str:
    env = res["env"]
    lines = [f"`python -m benchmarks.cuda_check` — {env['date']}, {env['gpu']}, torch {env['torch']}, "
             f"{env['cpus']} CPU cores ({env['cpu']}). The CPU reference ran on the same machine.", ""]
    d = res.get("dummy", {})
    if "error" in d:
        lines.append(f"- Random weights: **failed**: {d['error']}")
    elif d:
        lines.append(f"- Random weights, CUDA against the CPU's float32 PyTorch path: a 700-token prompt "
                     f"scored as a chunked prefill, |Δ log P| mean {d['logprob_mean_abs_diff']:.2e}, max "
                     f"{d['logprob_max_abs_diff']:.2e}; every sampling option in one batch with a prompt over the "
                     f"step's token budget: all {len(d['output_lengths'])} requests ran to their 12 tokens, "
                     f"logit_bias held, a seeded sample repeated: {d['seeded_sample_repeats']}; KV hand-off "
                     f"round trip equal: {d['kv_handoff_equal']}.")
    q = res.get("quality", {})
    if "error" in q:
        lines.append(f"- Output quality: **failed**: {q['error']}")
    elif q:
        lines += ["", f"Output quality (SmolLM2-135M-Instruct Q4_1; {q['windows']} windows of 512 tokens, "
                  f"{q['scored']} scored; greedy: {q['prompts']} prompts x 32 tokens against the CPU reference):", "",
                  "| configuration | perplexity | mean / max abs Δ log P | greedy identical | mean tokens before a "
                  "difference |", "|---|---|---|---|---|"]
        for r in q["rows"]:
            if "error" in r:
                lines.append(f"| {r['name']} | failed: {r['error'][:200]} | | | |")
            else:
                lines.append(f"| {r['name']} | {r['ppl']:.4f} | {r['dlogp_mean']:.4f} / {r['dlogp_max']:.3f} | "
                             f"{r['greedy_same']}/{q['prompts']} | {r['greedy_prefix']:.1f} |")
    s = res.get("speed", {})
    if "error" in s:
        lines.append(f"- Offline throughput: **failed**: {s['error']}")
    elif s:
        lines += ["", f"Offline throughput, the {s['requests']}-request workload of benchmarks/foundation.py "
                  "(two runs after a warm-up):", "", "| dtype | max_num_seqs | tok/s (runs) | mean running batch | "
                  "ms per step |", "|---|---|---|---|---|"]
        for r in s["rows"]:
            lines.append(f"| {r['dtype']} | {r['max_num_seqs']} | " + ", ".join(f"{x:.0f}" for x in r["tok_s"])
                         + f" | {r['mean_batch']:.1f} | {r['ms_per_step']:.1f} |")
        hf = s.get("hf", {})
        lines.append("\ntransformers on the same GPU, one static bf16 batch of the same requests: "
                     + (f"{hf['static_tok_s']:.0f} tok/s." if "static_tok_s" in hf else f"failed: {hf.get('error')}"))
    h = res.get("http", {})
    if "error" in h:
        lines.append(f"- HTTP: **failed**: {h['error'][:500]}")
    elif h:
        lines.append(f"\n- HTTP (`batchserve serve --device cuda`): healthy after {h['startup_s']:.1f} s; 32 concurrent "
                     f"chat completions: status {h['concurrent_status']}, {h['concurrent_tokens']} tokens in "
                     f"{h['concurrent_s']:.1f} s; streamed: {h['stream_chunks']} chunks, [DONE] {h['stream_done']}; "
                     f"JSON schema: status {h['json_status']}, parsed {'json_parsed' in h}; bad request: "
                     f"{h['bad_request'][0]}; /metrics {h['metrics_lines']} lines.")
    p = res.get("profile", {})
    if p:
        said = [ln for ln in p.get("log", "").splitlines() if ln.startswith(("step time", "fit error", "decode throughput",
                                                                              "knee", "WARNING"))]
        lines.append(f"- `batchserve profile --device cuda`: rc {p.get('rc')}, {p.get('seconds', 0):.0f} s"
                     + "".join(f"\n  - {ln}" for ln in said))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="cuda_check.json", help="where the results are written (JSON)")
    ap.add_argument("--md", default=None, help="where the markdown summary is written")
    ap.add_argument("--stages", default=",".join(STAGES), help="comma-separated stages to run")
    ap.add_argument("--requests", type=int, default=64, help="offline workload size")
    ap.add_argument("--port", type=int, default=8123, help="the HTTP stage's server port")
    ap.add_argument("--profile-out", default="cuda_profile.json", help="where the profile stage writes its profile")
    ap.add_argument("--device", default=DEVICE, help="cuda[:N]; cpu runs the stages here as a dry run of the script")
    a = ap.parse_args(argv)
    globals()["DEVICE"] = a.device
    gpu = a.device.startswith("cuda")
    if gpu and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    no_cpp_kernels()
    res: dict = {"env": {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
                         "gpu": torch.cuda.get_device_name(0) if gpu else "no GPU (dry run)", "cpus": os.cpu_count(),
                         "cpu": platform.processor() or platform.machine(), "python": platform.python_version()}}
    print(json.dumps(res["env"]), file=sys.stderr, flush=True)
    for st in a.stages.split(","):
        t0 = time.perf_counter()
        try:
            res[st] = {"dummy": stage_dummy, "quality": stage_quality, "speed": lambda: stage_speed(a.requests),
                       "http": lambda: stage_http(a.port), "profile": lambda: stage_profile(a.profile_out)}[st]()
        except Exception as e:  # noqa: BLE001 - recorded; the next stage goes on
            res[st] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
        res[st]["stage_s"] = time.perf_counter() - t0
        print(f"== {st} ({res[st]['stage_s']:.0f} s): " + json.dumps(res[st], default=str)[:3000], file=sys.stderr,
              flush=True)
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=1, default=str)
        if a.md:
            with open(a.md, "w") as fh:
                fh.write(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
