"""Configuration: one tree of frozen dataclasses. Validation only, no I/O."""
from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_MODEL = "smollm2-135m-instruct"
_DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """A configuration value is out of range; the message names the field."""


def _check(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{name}: {msg}")


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to load and where to run them.

    `model` is a GGUF file, a Hugging Face directory, the alias `smollm2-135m-instruct`,
    or `dummy` (random weights of `dummy_config`, for benchmarks of other shapes).
    """

    model: str = DEFAULT_MODEL
    dtype: str = "float32"
    device: str = "cpu"
    num_threads: int = 0  # 0: leave torch's default
    dummy_config: dict | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        _check(self.dtype in _DTYPES, "dtype", f"must be one of {_DTYPES}, got {self.dtype!r}")
        _check(self.device == "cpu" or self.device.startswith("cuda"), "device",
               f"must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        _check(self.num_threads >= 0, "num_threads", "must be >= 0")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: `block_size` tokens per block, pool sized from `kv_cache_gb`
    unless `num_blocks` is given."""

    block_size: int = 16
    kv_cache_gb: float = 1.0
    num_blocks: int | None = None
    prefix_caching: bool = False

    def __post_init__(self) -> None:
        _check(self.block_size >= 1, "block_size", "must be >= 1")
        _check(self.kv_cache_gb > 0, "kv_cache_gb", "must be > 0")
        _check(self.num_blocks is None or self.num_blocks >= 1, "num_blocks", "must be >= 1")


@dataclass(frozen=True)
class SchedulerConfig:
    """Step budgets and the batching policy (a name from `core.policies.POLICIES`)."""

    policy: str = "continuous"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    chunk_size: int = 512
    window_ms: float = 50.0
    max_batch: int = 32
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        _check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1")
        _check(self.chunk_size >= 1, "chunk_size", "must be >= 1")
        _check(self.window_ms >= 0, "window_ms", "must be >= 0")
        _check(self.max_batch >= 1, "max_batch", "must be >= 1")


@dataclass(frozen=True)
class EngineConfig:
    """The whole tree; CLI flags map onto its leaves."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
