"""Shared setting of the case studies: the roofline of an A100-80GB SXM with Llama-2-7B in
FP16 (`sim.hardware`), 16-token KV blocks, at most 128 running sequences (the seed's own
figure for this pair, 4.2.2) and 4,096 tokens per step. Loads are fixed relative to the
capacity the engine itself reaches on the same hardware ("saturation": the workload's
requests all arriving at once), so a scenario means the same on any cost model."""
from __future__ import annotations

from typing import Any

from batchserve.config import CacheConfig, EngineConfig, QueueConfig, SchedulerConfig
from batchserve.sim.simulator import SimResult

GPU, MODEL = "a100-80gb", "llama-2-7b"
SATURATION_RATE = 10_000.0  # requests/s: the whole workload is queued at once


def engine(policy: str, queue: QueueConfig | None = None, **sched: Any) -> EngineConfig:
    s = SchedulerConfig(policy=policy, max_num_seqs=128, max_num_batched_tokens=4096, **sched)
    return EngineConfig(cache=CacheConfig(block_size=16), scheduler=s, queue=queue or QueueConfig())


def e2e(res: SimResult, cls: str | None = None, stat: str = "p99") -> float | None:
    s = res.summary if cls is None else res.summary["per_class"].get(cls)
    return None if s is None else s["latency"]["e2e_ms"][stat]


def rate_of(res: SimResult) -> float:
    return res.summary["throughput_rps"]


def batch_fill(res: SimResult, cap: int) -> float | None:
    """Requests per formed batch over the cap: the seed's "GPU utilisation" for request-level
    batching (a 50 ms window holding 10 of 32 requests is its 30%)."""
    n = res.engine_stats.get("num_batches")
    return res.summary["n_requests"] / n / cap if n else None


