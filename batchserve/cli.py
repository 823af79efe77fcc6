"""Command line: `batchserve generate | serve` (more subcommands plug in here)."""
from __future__ import annotations

import argparse
import logging
import sys
import time

from batchserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Flags that map onto EngineConfig fields."""
    g = p.add_argument_group("model")
    g.add_argument("--model", default=ModelConfig.model, help="GGUF file, HF directory, alias or 'dummy'")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    g.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "cpp"],
                   help="decode attention and fused layer ops: C++ when they build (auto), PyTorch only, "
                        "or require C++")
    g.add_argument("--linear-backend", default="auto", choices=["auto", "cpp", "onednn", "torch"],
                   help="float32 matrix products: the C++ panel GEMM on AVX-512 CPUs, else oneDNN on packed weights "
                        "where it runs (auto); or require the C++ GEMM, oneDNN, or F.linear")
    g.add_argument("--matmul-dtype", default="auto", choices=["auto", "float32", "bfloat16", "int16", "int8"],
                   help="int16 / int8: a GGUF file's Q4_0/Q4_1/Q4_K/Q8_0 matrices multiply activations quantized "
                        "to int16 / int8 per 32 values (AVX512-VNNI integer dot products, ~1.5x / ~2.5x the float32 "
                        "rate; int16 gives the float32 model's output, int8 is llama.cpp's scheme and differs more); "
                        "float32: float32 products (bit-identical to the dequantized weights); bfloat16: the decoder "
                        "layers' products in bf16; auto: int16 where it runs (VNNI CPU, GGUF blocks), else as --dtype")
    g.add_argument("--quantized-weights", default="auto", choices=["auto", "off"],
                   help="auto: multiply from a GGUF file's Q4_0/Q4_1/Q4_K/Q6_K/Q8_0 blocks as stored (C++ GEMM; "
                        "~5x fewer bytes than float32, see --matmul-dtype for the arithmetic); off: dequantize at load")
    g = p.add_argument_group("kv cache")
    g.add_argument("--kv-cache-gb", type=float, default=CacheConfig.kv_cache_gb)
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16", "int8"],
                   help="KV cache storage (auto: float16 where the C++ attention kernels run on the CPU, else as "
                        "--dtype); 16 bits halve the bytes per token; int8 (a scale per token and kv head, C++ "
                        "kernels only) takes 0.53x float16's; float32 for an exact cache")
    g.add_argument("--block-size", type=int, default=CacheConfig.block_size)
    g.add_argument("--num-blocks", type=int, default=None, help="override the pool size")
    g.add_argument("--prefix-caching", action="store_true")
    g = p.add_argument_group("scheduling")
    g.add_argument("--policy", default=SchedulerConfig.policy,
                   help="static | dynamic | continuous | chunked | cascade")
    g.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs)
    g.add_argument("--max-num-batched-tokens", type=int, default=SchedulerConfig.max_num_batched_tokens)
    g.add_argument("--chunk-size", type=int, default=SchedulerConfig.chunk_size)
    g.add_argument("--window-ms", type=float, default=SchedulerConfig.window_ms)
    g.add_argument("--max-batch", type=int, default=SchedulerConfig.max_batch)
    d = SchedulerConfig
    g.add_argument("--window-min-ms", type=float, default=d.window_min_ms, help="dynamic: shortest window")
    g.add_argument("--window-max-ms", type=float, default=d.window_max_ms, help="dynamic: longest window")
    g.add_argument("--slo-p99-ms", type=float, default=d.slo_p99_ms,
                   help="dynamic: P99 end-to-end target that steers the max batch and caps the window")
    g.add_argument("--bucket-by-length", action="store_true", help="dynamic: batch similar lengths together")
    g.add_argument("--prefill-max-batch", type=int, default=d.prefill_max_batch, help="cascade: prefill cap")
    g.add_argument("--decode-max-batch", type=int, default=d.decode_max_batch, help="cascade: decode cap")
    g.add_argument("--cascade-ratio", type=int, default=d.cascade_ratio,
                   help="cascade: decode steps between prefill steps while both stages have work")
    g.add_argument("--cascade-workers", action="store_true",
                   help="cascade: prefill and decode in two worker processes, KV handed across")
    g.add_argument("--latency-profile", default=None, metavar="FILE.json",
                   help="step-time model written by `batchserve profile`")
    g = p.add_argument_group("admission queue")
    g.add_argument("--queue-capacity", type=int, default=None, metavar="N",
                   help="one queue level holding at most N waiting requests; more are refused (503)")
    g.add_argument("--queue-config", default=None, metavar="FILE.yaml",
                   help="priority levels, caps, overflow policies, default deadlines, urgent lane")


def engine_config(a: argparse.Namespace) -> EngineConfig:
    from batchserve.config import ConfigError, QueueConfig

    capacity, path = getattr(a, "queue_capacity", None), getattr(a, "queue_config", None)
    if capacity is not None and path is not None:
        raise ConfigError("--queue-capacity and --queue-config: give one or the other")
    queue = QueueConfig()
    if capacity is not None:
        queue = QueueConfig.bounded(capacity)
    elif path is not None:
        import yaml

        try:
            with open(path) as f:
                queue = QueueConfig.from_dict(yaml.safe_load(f) or {})
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"--queue-config {path}: {e}") from None
    return EngineConfig(
        model=ModelConfig(model=a.model, dtype=a.dtype, device=a.device, num_threads=a.threads,
                          attention_backend=getattr(a, "attention_backend", "auto"),
                          linear_backend=getattr(a, "linear_backend", "auto"),
                          matmul_dtype=getattr(a, "matmul_dtype", "auto"),
                          quantized_weights=getattr(a, "quantized_weights", "auto")),
        cache=CacheConfig(block_size=a.block_size, kv_cache_gb=a.kv_cache_gb, num_blocks=a.num_blocks,
                          prefix_caching=a.prefix_caching, kv_cache_dtype=getattr(a, "kv_cache_dtype", "auto")),
        scheduler=SchedulerConfig(policy=a.policy, max_num_seqs=a.max_num_seqs,
                                  max_num_batched_tokens=a.max_num_batched_tokens, chunk_size=a.chunk_size,
                                  window_ms=a.window_ms, max_batch=a.max_batch,
                                  window_min_ms=a.window_min_ms, window_max_ms=a.window_max_ms,
                                  slo_p99_ms=a.slo_p99_ms, bucket_by_length=a.bucket_by_length,
                                  prefill_max_batch=a.prefill_max_batch, decode_max_batch=a.decode_max_batch,
                                  cascade_ratio=a.cascade_ratio, cascade_workers=a.cascade_workers,
                                  latency_profile=a.latency_profile),
        queue=queue,
    )


def cmd_generate(a: argparse.Namespace) -> int:
    from batchserve.llm import LLM
    from batchserve.request import SamplingParams

    llm = LLM(config=engine_config(a))
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p,
                            top_k=a.top_k, seed=a.seed)
    t0 = time.perf_counter()
    if a.raw:
        outs = llm.generate(a.prompts, params)
    else:
        outs = llm.chat([[{"role": "user", "content": p}] for p in a.prompts], params)
    dt = time.perf_counter() - t0
    ntok = sum(len(o.token_ids) for o in outs)
    for o in outs:
        print(o.text)
    print(f"[{ntok} tokens in {dt:.2f} s: {ntok / dt:.1f} tokens/s; finish: "
          f"{', '.join(o.finish_reason or '?' for o in outs)}]", file=sys.stderr)
    return 0


def cmd_serve(a: argparse.Namespace) -> int:
    from batchserve.server.run import serve

    return serve(a)


def add_server_args(p: argparse.ArgumentParser) -> None:
    """Flags that map onto ServerConfig fields (server/config.py), and --config."""
    from batchserve.server.config import ServerConfig

    g = p.add_argument_group("server")
    g.add_argument("--host", default=ServerConfig.host)
    g.add_argument("--port", type=int, default=ServerConfig.port)
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    g.add_argument("--max-body-bytes", type=int, default=ServerConfig.max_body_bytes,
                   help="larger request bodies get 413")
    g.add_argument("--grace-period-s", type=float, default=ServerConfig.grace_period_s,
                   help="on SIGTERM, how long requests in flight may take to finish")
    g.add_argument("--served-model-name", default=None, help="the model name clients use (default: the model's)")
    g.add_argument("--default-max-tokens", type=int, default=ServerConfig.default_max_tokens,
                   help="cap for chat requests that set no max_tokens")
    g.add_argument("--config", default=None, metavar="FILE.yaml",
                   help="sections model/cache/scheduler/queue/server mapping onto the config dataclasses; "
                        "flags with non-default values win")
    g = p.add_argument_group("ray (pip install 'batchserve[ray]'; docs/ray.md)")
    g.add_argument("--ray", action="store_true", help="run the engines as Ray actors behind this endpoint")
    g.add_argument("--address", default=None,
                   help="Ray cluster to join: auto, ray://host:10001 or host:6379 (default: start a local Ray)")
    g.add_argument("--replicas", type=int, default=1, help="engine replicas (each a full engine)")
    g.add_argument("--prefill-workers", type=int, default=0,
                   help="disaggregated: prefill workers (with --decode-workers; replaces --replicas)")
    g.add_argument("--decode-workers", type=int, default=0, help="disaggregated: decode workers")
    g.add_argument("--replica-cpus", type=float, default=1.0,
                   help="CPUs Ray reserves per replica / worker (also its torch threads unless --threads)")
    g.add_argument("--replica-gpus", type=float, default=0.0, help="GPUs Ray reserves per replica (with --device cuda)")
    g.add_argument("--object-store-mb", type=int, default=512, help="object store of a local Ray (KV hand-offs)")


def cmd_simulate(a: argparse.Namespace) -> int:
    from batchserve.sim.runner import run_cli

    return run_cli(a, engine_config(a))


def add_simulate_parser(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """`batchserve simulate`: the real scheduler on a virtual clock over a cost model."""
    from batchserve.sim.hardware import GPUS, MODELS
    from batchserve.scenarios import CHOICES

    s = sub.add_parser("simulate", parents=[common], help="simulate a workload: real scheduler, predicted steps")
    g = s.add_argument_group("simulation")
    g.add_argument("--workload", default="chat", help="mix (chat, mixed, short-long, priority-flood) or trace.jsonl")
    g.add_argument("--requests", type=int, default=None, help="requests in the workload (default 1000)")
    g.add_argument("--rate", type=float, default=10.0, help="mean arrival rate, requests/s")
    g.add_argument("--arrival", default="poisson", help="poisson | gamma | step | ramp | onoff | replay")
    g.add_argument("--burstiness", type=float, default=None, help="gamma arrivals: CV^2 of the gaps")
    g.add_argument("--arrival-args", default=None, help='JSON of more arrival parameters, e.g. \'{"step_s": 5}\'')
    g.add_argument("--scale", type=float, default=None, help="multiply every length of the mix")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--hardware", default=None, choices=sorted(GPUS), help="roofline GPU (default a100-80gb)")
    g.add_argument("--profile", default=None, metavar="FILE.json", help="step times from `batchserve profile`")
    g.add_argument("--max-model-len", type=int, default=None, help="override the model's context length")
    g.add_argument("--slo-ms", type=float, default=None, help="E2E target for goodput and --sweep "
                                                               "(default --slo-p99-ms)")
    g.add_argument("--sweep", default=None, metavar="FIELD=V1,V2",
                   help="rate=1,2,4 or a scheduler field (window_ms, max_batch, chunk_size, ...): "
                        "the best setting under the SLO")
    g.add_argument("--scenario", default=None, choices=CHOICES,
                   help="one of the seed's case studies (A100-80GB, Llama-2-7B FP16), or all")
    g.add_argument("--token-times", action=argparse.BooleanOptionalAction, default=None,
                   help="keep every token's time (ITL); default: on up to 20,000 requests")
    g.add_argument("--out", default=None, metavar="DIR", help="records.jsonl, summary.json, timeline, plots")
    add_engine_args(s)
    s.set_defaults(func=cmd_simulate, model="llama-2-7b", dtype="float16")
    s.epilog = f"--model takes {', '.join(sorted(MODELS))} or a config.json (roofline)."


def cmd_profile(a: argparse.Namespace) -> int:
    import dataclasses

    from batchserve.runner.profiler import TINY_MODEL, report, run_profile, save

    cfg = engine_config(a)
    if a.quick:  # a tiny random model and a small grid: seconds, for tests and smoke checks
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, model="dummy", dummy_config=TINY_MODEL),
                                  cache=dataclasses.replace(cfg.cache, kv_cache_gb=0.01))
    prof = run_profile(cfg, quick=a.quick, reps=a.reps)
    save(prof, a.out)
    print(report(prof))
    print(f"saved {a.out}")
    return 0


def add_profile_parser(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """`batchserve profile`: step times on this machine -> latency model, memory bound, knee."""
    s = sub.add_parser("profile", parents=[common], help="measure step times, fit a latency model (JSON)")
    s.add_argument("--out", default="profile.json", metavar="FILE.json")
    s.add_argument("--quick", action="store_true", help="tiny dummy model, small grid (seconds)")
    s.add_argument("--reps", type=int, default=3, help="timed repetitions per point (median)")
    add_engine_args(s)
    s.set_defaults(func=cmd_profile)


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", default="INFO")
    p = argparse.ArgumentParser(prog="batchserve", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", parents=[common], help="generate offline for one or more prompts")
    g.add_argument("prompts", nargs="+")
    g.add_argument("--raw", action="store_true", help="no chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    add_engine_args(g)
    g.set_defaults(func=cmd_generate)
    s = sub.add_parser("serve", parents=[common], help="serve the OpenAI-compatible HTTP API")
    add_server_args(s)
    add_engine_args(s)
    s.set_defaults(func=cmd_serve)
    add_simulate_parser(sub, common)
    add_profile_parser(sub, common)
    from batchserve.bench.cli import add_bench_parser

    add_bench_parser(sub, [common])
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from batchserve.config import ConfigError
    from batchserve.request import RequestError

    try:
        return a.func(a)
    except (ConfigError, RequestError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
