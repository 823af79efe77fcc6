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
    attention_backend: str = "auto"  # auto: C++ decode kernel + fused layer ops when they build (CPU, fp32); torch; cpp
    linear_backend: str = "auto"  # auto: C++ panel GEMM on AVX-512, else oneDNN where it runs; cpp; onednn; torch
    # auto: int16 on a CPU with AVX512-VNNI for a float32 model with GGUF blocks (the C++ GEMM),
    # else the matrix products in `dtype` (model_runner.resolve_matmul_dtype); bfloat16 with dtype
    # float32: the decoder layers' products in bf16 (half the weight bytes; where the CPU has bf16
    # instructions, faster), all else float32; int8 / int16: a GGUF file's Q4_0/Q4_1/Q4_K/Q8_0
    # matrices multiply activations quantized to int8 / int16 per 32 k into their integer quants
    # (AVX512-VNNI; int16 gives the float32 model's output, int8 is llama.cpp's scheme)
    matmul_dtype: str = "auto"
    # auto: a GGUF file's Q4_0 / Q4_1 / Q4_K / Q6_K / Q8_0 matrices stay in their blocks and the
    # C++ GEMM multiplies from them (CPU, float32 activations; with float32 products the same
    # products as the dequantized weights, bit for bit), from 3-5x fewer weight bytes; off: dequantize at load
    quantized_weights: str = "auto"

    def __post_init__(self) -> None:
        _check(self.dtype in _DTYPES, "dtype", f"must be one of {_DTYPES}, got {self.dtype!r}")
        _check(self.device == "cpu" or self.device.startswith("cuda"), "device",
               f"must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        _check(self.num_threads >= 0, "num_threads", "must be >= 0")
        _check(self.attention_backend in ("auto", "torch", "cpp"), "attention_backend",
               f"must be auto, torch or cpp, got {self.attention_backend!r}")
        _check(self.linear_backend in ("auto", "cpp", "onednn", "torch"), "linear_backend",
               f"must be auto, cpp, onednn or torch, got {self.linear_backend!r}")
        _check(self.matmul_dtype in ("auto", self.dtype, "bfloat16", "int8", "int16"), "matmul_dtype",
               f"must be auto, {self.dtype!r}, bfloat16, int8 or int16 (with dtype float32), got {self.matmul_dtype!r}")
        _check(self.quantized_weights in ("auto", "off"), "quantized_weights",
               f"must be auto or off, got {self.quantized_weights!r}")
        _check(self.matmul_dtype not in ("int8", "int16")
               or (self.dtype == "float32" and self.quantized_weights == "auto"),
               "matmul_dtype", "integer matrix products multiply a GGUF file's blocks: they need dtype float32 and "
               f"quantized_weights auto, got dtype {self.dtype!r}, quantized_weights {self.quantized_weights!r}")
        _check(self.matmul_dtype not in ("int8", "int16")
               or (self.device == "cpu" and self.linear_backend in ("auto", "cpp")), "matmul_dtype",
               "integer matrix products run in the C++ GEMM on the CPU: they need device cpu and linear_backend "
               f"auto or cpp, got device {self.device!r}, linear_backend {self.linear_backend!r}")
        _check(self.matmul_dtype != "bfloat16" or self.dtype in ("float32", "bfloat16"), "matmul_dtype",
               f"bfloat16 matrix products need dtype float32 or bfloat16, got dtype {self.dtype!r}")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: `block_size` tokens per block, pool sized from `kv_cache_gb`
    unless `num_blocks` is given."""

    block_size: int = 16
    kv_cache_gb: float = 1.0
    num_blocks: int | None = None
    prefix_caching: bool = False
    # auto: float16 where the C++ attention kernels run (a float32 model on the CPU), else the model's
    # dtype (runner.model_runner.resolve_kv_cache_dtype); bfloat16 / float16: K/V stored in 16 bits
    # (half the bytes, twice the tokens per GB; attention math stays in the model's dtype); int8: a
    # scale per token and kv head (~0.53x float16's bytes; C++ kernels on the CPU only)
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        _check(self.block_size >= 1, "block_size", "must be >= 1")
        _check(self.kv_cache_dtype in ("auto",) + _DTYPES + ("int8",), "kv_cache_dtype",
               f"must be auto, int8 or one of {_DTYPES}, got {self.kv_cache_dtype!r}")
        _check(self.kv_cache_gb > 0, "kv_cache_gb", "must be > 0")
        _check(self.num_blocks is None or self.num_blocks >= 1, "num_blocks", "must be >= 1")


def kv_cache_dtype_name(model: ModelConfig, cache: CacheConfig) -> str:
    """The dtype the KV cache is stored in."""
    return model.dtype if cache.kv_cache_dtype == "auto" else cache.kv_cache_dtype


@dataclass(frozen=True)
class SchedulerConfig:
    """Step budgets and the batching policy (a name from `core.policies.POLICIES`).

    static / dynamic (request level): `window_ms` / `max_batch` (static's fixed values;
    dynamic's max batch starts at `max_batch`, its window moves in [window_min_ms,
    window_max_ms] and its cap is steered by measured P99 end-to-end latency against
    `slo_p99_ms`); `bucket_by_length` groups similar lengths into a batch.
    chunked: `chunk_size` tokens per prompt chunk. cascade: `prefill_max_batch` /
    `decode_max_batch` per stage, `cascade_ratio` decode steps between prefill steps while
    both stages have work, `cascade_workers` runs the stages in two worker processes.
    `latency_profile`: a JSON file written by `batchserve profile` (step-time model).
    """

    policy: str = "continuous"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    chunk_size: int = 512
    window_ms: float = 50.0
    max_batch: int = 32
    window_min_ms: float = 15.0
    window_max_ms: float = 120.0
    slo_p99_ms: float = 2000.0
    bucket_by_length: bool = False
    prefill_max_batch: int = 64
    decode_max_batch: int = 16
    cascade_ratio: int = 4
    cascade_workers: bool = False
    latency_profile: str | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        _check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1")
        _check(self.chunk_size >= 1, "chunk_size", "must be >= 1")
        _check(self.window_ms >= 0, "window_ms", "must be >= 0")
        _check(self.max_batch >= 1, "max_batch", "must be >= 1")
        _check(self.window_min_ms >= 0, "window_min_ms", "must be >= 0")
        _check(self.window_max_ms >= self.window_min_ms, "window_max_ms",
               f"must be >= window_min_ms ({self.window_min_ms}), got {self.window_max_ms}")
        _check(self.slo_p99_ms > 0, "slo_p99_ms", "must be > 0")
        _check(self.prefill_max_batch >= 1, "prefill_max_batch", "must be >= 1")
        _check(self.decode_max_batch >= 1, "decode_max_batch", "must be >= 1")
        _check(self.cascade_ratio >= 1, "cascade_ratio", "must be >= 1")
        _check(not self.cascade_workers or self.policy == "cascade", "cascade_workers",
               f"needs policy 'cascade', got {self.policy!r}")


_OVERFLOW = ("reject", "drop_oldest")
_KINDS = ("hard", "soft")


@dataclass(frozen=True)
class LevelConfig:
    """One priority level of the admission queue (S1.2, S1.3).

    `priorities`: the request priorities (0-10) it takes. `capacity`: queued requests it holds
    (None: unbounded). `overflow`: what a full level does with a new request: `reject` it
    (OverloadedError, HTTP 503) or `drop_oldest` (its oldest queued request ends as rejected).
    `deadline_ms` / `deadline_kind`: defaults for requests that carry none.
    """

    name: str
    priorities: tuple[int, ...] = tuple(range(11))
    capacity: int | None = None
    overflow: str = "reject"
    deadline_ms: float | None = None
    deadline_kind: str = "hard"

    def __post_init__(self) -> None:
        object.__setattr__(self, "priorities", tuple(sorted(set(self.priorities))))
        f = f"queue.levels[{self.name}]"
        _check(bool(self.name) and isinstance(self.name, str), "queue.levels.name", "must be a non-empty string")
        _check(bool(self.priorities) and all(isinstance(p, int) and 0 <= p <= 10 for p in self.priorities),
               f"{f}.priorities", f"must be integers in [0, 10], got {self.priorities!r}")
        _check(self.capacity is None or (isinstance(self.capacity, int) and self.capacity >= 1),
               f"{f}.capacity", "must be an integer >= 1 (or null: unbounded)")
        _check(self.overflow in _OVERFLOW, f"{f}.overflow", f"must be one of {_OVERFLOW}, got {self.overflow!r}")
        _check(self.deadline_ms is None or self.deadline_ms > 0, f"{f}.deadline_ms", "must be > 0")
        _check(self.deadline_kind in _KINDS, f"{f}.deadline_kind", f"must be one of {_KINDS}")


@dataclass(frozen=True)
class QueueConfig:
    """The admission queue: levels that together take every priority 0-10 exactly once, and
    the urgent lane. A request is promoted to the urgent lane when it has waited longer than
    `urgent_after_ms`, or when its slack (deadline - now - predicted service) drops under
    `urgent_slack_ms`; None switches either rule off. `retry_after_s` is the least Retry-After
    a refusal suggests. The default, one unbounded level, is a plain priority queue."""

    levels: tuple[LevelConfig, ...] = (LevelConfig("default"),)
    urgent_after_ms: float | None = None
    urgent_slack_ms: float | None = 50.0
    retry_after_s: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "levels", tuple(self.levels))
        _check(bool(self.levels), "queue.levels", "needs at least one level")
        names = [lv.name for lv in self.levels]
        _check(len(set(names)) == len(names), "queue.levels", f"names must be unique, got {names}")
        owners: dict[int, str] = {}
        for lv in self.levels:
            for p in lv.priorities:
                _check(p not in owners, "queue.levels", f"priority {p} is in both {owners.get(p)!r} and {lv.name!r}")
                owners[p] = lv.name
        missing = [p for p in range(11) if p not in owners]
        _check(not missing, "queue.levels", f"no level takes priorities {missing}")
        _check(self.urgent_after_ms is None or self.urgent_after_ms >= 0, "queue.urgent_after_ms", "must be >= 0")
        _check(self.urgent_slack_ms is None or self.urgent_slack_ms >= 0, "queue.urgent_slack_ms", "must be >= 0")
        _check(self.retry_after_s > 0, "queue.retry_after_s", "must be > 0")

    @classmethod
    def bounded(cls, capacity: int) -> "QueueConfig":
        """`--queue-capacity N`: one level, N requests, new ones refused when full."""
        return cls(levels=(LevelConfig("default", capacity=capacity, overflow="reject"),))

    @classmethod
    def from_dict(cls, d: dict) -> "QueueConfig":
        """From a parsed config file: either the queue mapping itself or a mapping with a
        `queue` key. `levels` is a list of mappings with a `name`, or a mapping name -> fields;
        `priorities` is a list of ints, one int, or a range string like "7-10"."""
        if not isinstance(d, dict):
            raise ConfigError(f"queue: expected a mapping, got {type(d).__name__}")
        if "queue" in d and isinstance(d["queue"], dict):
            d = d["queue"]
        unknown = set(d) - {"levels", "urgent_after_ms", "urgent_slack_ms", "retry_after_s"}
        _check(not unknown, "queue", f"unknown keys {sorted(unknown)}")
        raw = d.get("levels", [{"name": "default"}])
        if isinstance(raw, dict):
            raw = [{"name": k, **(v or {})} for k, v in raw.items()]
        levels = []
        for item in raw:
            _check(isinstance(item, dict), "queue.levels", "each level must be a mapping")
            item = dict(item)
            if "priorities" in item:
                item["priorities"] = _parse_priorities(item["priorities"])
            allowed = {"name", "priorities", "capacity", "overflow", "deadline_ms", "deadline_kind"}
            _check(set(item) <= allowed, "queue.levels", f"unknown keys {sorted(set(item) - allowed)}")
            _check("name" in item, "queue.levels", "each level needs a name")
            levels.append(LevelConfig(**item))
        kw = {k: d[k] for k in ("urgent_after_ms", "urgent_slack_ms", "retry_after_s") if k in d}
        return cls(levels=tuple(levels), **kw)


def _parse_priorities(v: object) -> tuple[int, ...]:
    if isinstance(v, int) and not isinstance(v, bool):
        return (v,)
    if isinstance(v, str):
        lo, sep, hi = v.partition("-")
        try:
            return tuple(range(int(lo), int(hi) + 1)) if sep else (int(lo),)
        except ValueError:
            raise ConfigError(f"queue.levels.priorities: bad range {v!r}") from None
    if isinstance(v, (list, tuple)) and all(isinstance(p, int) and not isinstance(p, bool) for p in v):
        return tuple(v)
    raise ConfigError(f"queue.levels.priorities: expected ints or 'lo-hi', got {v!r}")


@dataclass(frozen=True)
class EngineConfig:
    """The whole tree; CLI flags map onto its leaves."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    queue: QueueConfig = field(default_factory=QueueConfig)
