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
    g = p.add_argument_group("kv cache")
    g.add_argument("--kv-cache-gb", type=float, default=CacheConfig.kv_cache_gb)
    g.add_argument("--block-size", type=int, default=CacheConfig.block_size)
    g.add_argument("--num-blocks", type=int, default=None, help="override the pool size")
    g.add_argument("--prefix-caching", action="store_true")
    g = p.add_argument_group("scheduling")
    g.add_argument("--policy", default=SchedulerConfig.policy)
    g.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs)
    g.add_argument("--max-num-batched-tokens", type=int, default=SchedulerConfig.max_num_batched_tokens)
    g.add_argument("--chunk-size", type=int, default=SchedulerConfig.chunk_size)
    g.add_argument("--window-ms", type=float, default=SchedulerConfig.window_ms)
    g.add_argument("--max-batch", type=int, default=SchedulerConfig.max_batch)


def engine_config(a: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=a.model, dtype=a.dtype, device=a.device, num_threads=a.threads),
        cache=CacheConfig(block_size=a.block_size, kv_cache_gb=a.kv_cache_gb, num_blocks=a.num_blocks,
                          prefix_caching=a.prefix_caching),
        scheduler=SchedulerConfig(policy=a.policy, max_num_seqs=a.max_num_seqs,
                                  max_num_batched_tokens=a.max_num_batched_tokens, chunk_size=a.chunk_size,
                                  window_ms=a.window_ms, max_batch=a.max_batch),
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
    try:
        from batchserve.server.app import serve
    except ImportError:  # the HTTP layer is not there yet: run the offline demo instead
        a.prompts, a.raw, a.max_tokens, a.temperature, a.top_p, a.top_k, a.seed = (
            ["What is the capital of France?"], False, 64, 0.0, 1.0, 0, None)
        return cmd_generate(a)
    return serve(a)


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
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    add_engine_args(s)
    s.set_defaults(func=cmd_serve)
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
