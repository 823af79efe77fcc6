"""Configuration: one tree of frozen dataclasses, the one place each default is written, and
the one place the sources of a configuration are merged.

A field that is a command-line flag says so in its metadata, which `batchserve.cli` reads to
generate the flag (name, type, default, choices, help); the flag's namespace attribute (its
dest) is the flag name without dashes. Metadata keys:

    help     the flag's help: one line (explanations belong in the class docstring)
    flag     the flag's name where it is not `--` + the field name with `_` -> `-`
    choices  what the flag accepts, where that is not the annotation's Literal
    metavar  argparse's metavar
    cli      False: not a flag (set in code or in a config file only)

`from_sources` layers, lowest first: the dataclass defaults, a command's own defaults, a config
file, flags given explicitly. Validation lives in `__post_init__`; the only I/O is reading the
YAML files that `--config` and `--queue-config` name (`read_yaml`).
"""
from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

from batchserve.request import MAX_PRIORITY, MIN_PRIORITY

DEFAULT_MODEL = "smollm2-135m-instruct"
Dtype = Literal["float32", "bfloat16", "float16"]
_DTYPES = typing.get_args(Dtype)


class ConfigError(ValueError):
    """A configuration value is out of range; the message names the field."""


def _check(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{name}: {msg}")


def _flag(default: Any, help: str, **meta: Any) -> Any:
    """A field that is a command-line flag: its default and one line of help (metadata above)."""
    return field(default=default, metadata={"help": help, **meta})


def _file_only(default: Any, help: str) -> Any:
    """A field that is no flag: set in code or in a config file (`help` documents it there)."""
    return field(default=default, metadata={"help": help, "cli": False})


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to load and where to run them.

    `model` is a GGUF file, a Hugging Face directory, the alias `smollm2-135m-instruct`,
    or `dummy` (random weights of `dummy_config`, for benchmarks of other shapes).

    `attention_backend`: decode attention and the fused layer ops. auto: the C++ decode kernel
    and fused layer ops where they build (CPU, float32), else PyTorch; torch: PyTorch only;
    cpp: require the C++ kernels.

    `linear_backend`: the float32 matrix products. auto: the C++ panel GEMM on an AVX-512 CPU,
    else oneDNN on packed weights where it runs, else F.linear; cpp, onednn, torch: require one.

    `matmul_dtype` (`runner.model_runner.resolve_matmul_dtype`): auto is int8 on a CPU with
    AVX512-VNNI or AVX2 for a float32 model with GGUF blocks (the C++ GEMM), else the products run
    in `dtype`. float32 gives products bit-identical to the dequantized weights'. bfloat16 with
    dtype float32 runs the decoder layers' products in bf16 (half the weight bytes; faster where
    the CPU has bf16 instructions) and all else in float32. int16 / int8: a GGUF file's Q4_0,
    Q4_1, Q4_K and Q8_0 matrices multiply activations quantized to int16 / int8 per 32 values
    (AVX512-VNNI or AVX2 integer dot products): int16 gives the float32 model's output, int8 is
    llama.cpp's scheme and differs more. Both need dtype float32, quantized_weights auto, device
    cpu and linear_backend auto or cpp.

    `cpu_isa` (`runner.models.llama.cpu_isa_in_use`): the code path of the C++ matrix products,
    float32 and integer alike. auto: the best this CPU has (AVX-512, its VNNI for integer products;
    else AVX2; else portable C++). avx512, avx2, portable force one for the whole model (refused,
    naming cpu_isa, when the CPU lacks it), so that one machine can run and check the paths other
    CPUs take; the auto choices of linear_backend and matmul_dtype then follow that path as they
    would on such a CPU. oneDNN and PyTorch pick their own code paths.

    `prompt_matmul` (`runner.model_runner.resolve_prompt_matmul`): the matrix products of prompt
    tokens (the rows of a request that has not yet generated). auto: on a CPU with AMX (Intel
    Sapphire Rapids and later), each layer's matrices are kept a second time as bf16 tiles and a
    prompt's rows multiply by them, while decodes keep the quantized blocks; a prompt's many rows
    share every weight, which AMX's bf16 tile products turn into several times AVX-512's
    multiply-adds per cycle. Taken where the default products are integer ones (matmul_dtype and
    cpu_isa auto) on the fused C++ path; elsewhere, float32 products included, prompts multiply
    as decodes do (off). amx: require it (refused where it cannot run). Each row's result is the
    same whatever rows share its step, so a request's tokens still do not depend on its batch.

    `quantized_weights`: auto keeps a GGUF file's Q4_0 / Q4_1 / Q4_K / Q6_K / Q8_0 matrices in
    their blocks and the C++ GEMM multiplies from them (CPU, float32 activations; with float32
    products the same products as the dequantized weights, bit for bit), reading several times
    fewer weight bytes than float32; off dequantizes at load.
    """

    model: str = _flag(DEFAULT_MODEL, "GGUF file, HF directory, alias or 'dummy'")
    dtype: Dtype = _flag("float32", "weights and activations dtype")
    device: str = _flag("cpu", "cpu or cuda[:N]")
    num_threads: int = _flag(0, "torch threads (0: torch default)", flag="--threads")
    dummy_config: dict | None = _file_only(None, "dummy: the Hugging Face config.json fields of the random model")
    seed: int = _file_only(0, "seed of the sampling generator")
    attention_backend: Literal["auto", "torch", "cpp"] = _flag(
        "auto", "decode attention and fused layer ops: C++ where it builds (auto), torch only, or require cpp")
    linear_backend: Literal["auto", "cpp", "onednn", "torch"] = _flag(
        "auto", "float32 matrix products: C++ GEMM or oneDNN where they run (auto), or require one")
    matmul_dtype: str = _flag("auto", "matrix products in (auto: int8 where it runs, else --dtype); int16 / int8 "
                              "need GGUF blocks", choices=("auto", "float32", "bfloat16", "int16", "int8"))
    quantized_weights: Literal["auto", "off"] = _flag(
        "auto", "auto: multiply from a GGUF file's quantized blocks as stored; off: dequantize at load")
    cpu_isa: Literal["auto", "avx512", "avx2", "portable"] = _flag(
        "auto", "code path of the C++ matrix products: the CPU's best (auto), or force one to run or check it")
    prompt_matmul: Literal["auto", "amx", "off"] = _flag(
        "auto", "prompt tokens' matrix products: bf16 AMX tiles where they run (auto), require them, or as decodes'")

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
        _check(self.cpu_isa in ("auto", "avx512", "avx2", "portable"), "cpu_isa",
               f"must be auto, avx512, avx2 or portable, got {self.cpu_isa!r}")
        _check(self.prompt_matmul in ("auto", "amx", "off"), "prompt_matmul",
               f"must be auto, amx or off, got {self.prompt_matmul!r}")
        _check(self.prompt_matmul != "amx" or (self.device == "cpu" and self.dtype == "float32"), "prompt_matmul",
               f"amx runs on the CPU with a float32 model, got device {self.device!r}, dtype {self.dtype!r}")
        _check(self.cpu_isa == "auto" or self.device == "cpu", "cpu_isa",
               f"forces a code path of the CPU's matrix products: it needs device cpu, got {self.device!r}")
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
    unless `num_blocks` is given.

    `kv_cache_dtype` (`runner.model_runner.resolve_kv_cache_dtype`): auto is int8 where the C++
    attention kernels run (a float32 model on the CPU) and the int8 cache's VNNI kernel built,
    float16 where only the former holds, else the model's dtype. bfloat16 /
    float16 store K/V in 16 bits (half float32's bytes, twice the tokens per GB; attention math
    stays in the model's dtype); int8 stores a scale per token and kv head besides (a little over
    half float16's bytes; C++ kernels on the CPU only); float32 keeps the cache exact.
    """

    block_size: int = _flag(16, "tokens per KV cache block")
    kv_cache_gb: float = _flag(1.0, "KV cache pool in GiB (unless --num-blocks)")
    num_blocks: int | None = _flag(None, "override the pool size")
    prefix_caching: bool = _flag(False, "reuse the KV blocks of prompt prefixes already computed")
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16", "int8"] = _flag(
        "auto", "KV cache storage dtype (auto: int8 or float16 where the C++ kernels run, else --dtype)")

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
    dynamic launches and sizes each batch, up to `max_batch`, by the control law in
    `core.controllers`, keeping to `slo_ttft_ms` / `slo_tpot_ms` / `slo_p99_ms` where set and
    waiting at most `window_max_ms` for company, and seating a request it held back as late
    once it has waited `overdue_factor` times its target); `bucket_by_length` groups similar
    lengths.
    chunked: `chunk_size` tokens per prompt chunk. cascade: `prefill_max_batch` /
    `decode_max_batch` per stage, `cascade_ratio` decode steps between prefill steps while
    both stages have work, `cascade_workers` runs the stages in two worker processes.
    `latency_profile`: a JSON file written by `batchserve profile` (step-time model).
    continuous / chunked: a waiting request preempts the least important running one when no
    seat or blocks are free and it outranks that one by `preempt_gap` priorities (0: never);
    a request is preempted so at most `max_preemptions` times (memory pressure has no bound).
    `soft_share_tokens`: with every seat taken, a running soft-deadline answer with at least
    this many tokens ends (shortened) to seat a queued soft-deadline request of no lower
    priority that would otherwise start too late to answer (core/deadlines.py); 0: never.
    `interject` (continuous / chunked, with tenants): a request of a tenant served less, arriving
    while a step of the others' requests runs, runs its first step at once, between two of
    that step's layers (`Scheduler.interjection`; the served engine only: the simulator and
    the offline engine take arrivals between steps).
    `pay_padding` (static / dynamic): the batch's padding is computed, not only counted — each
    step carries the rows a padded engine would run (prompts padded to the longest, finished
    members' decode rows), which the simulator charges and the model runner runs and discards
    (core/policies/request_level.py); other policies never pad.
    """

    policy: str = _flag("continuous", "static | dynamic | continuous | chunked | cascade")
    max_num_seqs: int = _flag(64, "most sequences in one step")
    max_num_batched_tokens: int = _flag(2048, "most tokens in one step")
    chunk_size: int = _flag(512, "chunked: tokens per prompt chunk")
    window_ms: float = _flag(50.0, "static: collection window")
    max_batch: int = _flag(32, "static: batch size; dynamic: the largest batch")
    window_max_ms: float = _flag(120.0, "dynamic: longest a request waits for company")
    slo_ttft_ms: float | None = _flag(None, "dynamic: time-to-first-token target (unset: none)")
    slo_tpot_ms: float | None = _flag(None, "dynamic: time-per-output-token target (unset: none)")
    slo_p99_ms: float | None = _flag(None, "dynamic: end-to-end target (unset: none)")
    overdue_factor: float = _flag(2.0, "dynamic: times its target a late request waits before it goes first "
                                       "(>= 1 advised)")
    bucket_by_length: bool = _flag(False, "dynamic: batch similar lengths together")
    prefill_max_batch: int = _flag(64, "cascade: prefill cap")
    decode_max_batch: int = _flag(16, "cascade: decode cap")
    cascade_ratio: int = _flag(4, "cascade: decode steps between prefill steps while both stages have work")
    cascade_workers: bool = _flag(False, "cascade: prefill and decode in two worker processes, KV handed across")
    latency_profile: str | None = _flag(None, "step-time model written by `batchserve profile`", metavar="FILE.json")
    preempt_gap: int = _flag(1, "a waiting request preempts a running one this many priorities below it (0: never)")
    max_preemptions: int = _flag(2, "most times one request is preempted for a more important one")
    soft_share_tokens: int = _flag(8, "a soft-deadline answer this long yields its seat to a waiting "
                                      "one about to miss (0: never)")
    pay_padding: bool = _flag(False, "static / dynamic: compute the padding a padded engine would, "
                                     "not only count it")
    interject: bool = _flag(True, "a tenant served less waits for the running step's end (default: it "
                                  "starts between two layers)")
    extra: dict = field(default_factory=dict, metadata={"cli": False, "help": "more settings for a policy"})

    def __post_init__(self) -> None:
        _check(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        _check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1")
        _check(self.chunk_size >= 1, "chunk_size", "must be >= 1")
        _check(self.window_ms >= 0, "window_ms", "must be >= 0")
        _check(self.max_batch >= 1, "max_batch", "must be >= 1")
        _check(self.window_max_ms >= 0, "window_max_ms", "must be >= 0")
        _check(0 < self.overdue_factor < math.inf, "overdue_factor",
               f"must be > 0 and finite, got {self.overdue_factor}")
        for name in ("slo_ttft_ms", "slo_tpot_ms", "slo_p99_ms"):
            v = getattr(self, name)
            _check(v is None or v > 0, name, f"must be > 0 when set, got {v}")
        _check(self.prefill_max_batch >= 1, "prefill_max_batch", "must be >= 1")
        _check(self.decode_max_batch >= 1, "decode_max_batch", "must be >= 1")
        _check(self.cascade_ratio >= 1, "cascade_ratio", "must be >= 1")
        _check(self.preempt_gap >= 0, "preempt_gap", "must be >= 0")
        _check(self.max_preemptions >= 0, "max_preemptions", "must be >= 0")
        _check(self.soft_share_tokens >= 0, "soft_share_tokens", "must be >= 0")
        _check(not self.cascade_workers or self.policy == "cascade", "cascade_workers",
               f"needs policy 'cascade', got {self.policy!r}")


_OVERFLOW = ("reject", "drop_oldest")
_KINDS = ("hard", "soft")


@dataclass(frozen=True)
class LevelConfig:
    """One priority level of the admission queue.

    `priorities`: the request priorities (0-10) it takes. `capacity`: queued requests it holds
    (None: unbounded). `overflow`: what a full level does with a new request: `reject` it
    (OverloadedError, HTTP 503) or `drop_oldest` (its oldest queued request ends as rejected).
    `deadline_ms` / `deadline_kind`: defaults for requests that carry none. `tpot_ms`: the
    time-per-output-token target of its requests: while one runs, requests of lower or equal
    priority join a step only while its predicted time stays under it.
    """

    name: str
    priorities: tuple[int, ...] = tuple(range(MIN_PRIORITY, MAX_PRIORITY + 1))
    capacity: int | None = None
    overflow: str = "reject"
    deadline_ms: float | None = None
    deadline_kind: str = "hard"
    tpot_ms: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "priorities", tuple(sorted(set(self.priorities))))
        f = f"queue.levels[{self.name}]"
        _check(bool(self.name) and isinstance(self.name, str), "queue.levels.name", "must be a non-empty string")
        _check(bool(self.priorities) and all(isinstance(p, int) and MIN_PRIORITY <= p <= MAX_PRIORITY
                                             for p in self.priorities),
               f"{f}.priorities", f"must be integers in [{MIN_PRIORITY}, {MAX_PRIORITY}], got {self.priorities!r}")
        _check(self.capacity is None or (isinstance(self.capacity, int) and self.capacity >= 1),
               f"{f}.capacity", "must be an integer >= 1 (or null: unbounded)")
        _check(self.overflow in _OVERFLOW, f"{f}.overflow", f"must be one of {_OVERFLOW}, got {self.overflow!r}")
        _check(self.deadline_ms is None or self.deadline_ms > 0, f"{f}.deadline_ms", "must be > 0")
        _check(self.deadline_kind in _KINDS, f"{f}.deadline_kind", f"must be one of {_KINDS}")
        _check(self.tpot_ms is None or self.tpot_ms > 0, f"{f}.tpot_ms", "must be > 0")


@dataclass(frozen=True)
class QueueConfig:
    """The admission queue: levels that together take every priority 0-10 exactly once, and
    the urgent lane. A request is promoted to the urgent lane when it has waited longer than
    `urgent_after_ms`, or when its slack (deadline - now - predicted service) drops under
    `urgent_slack_ms`; None switches either rule off. `retry_after_s` is the least Retry-After
    a refusal suggests. Tenants of a level share it by their service over about the last
    `tenant_memory_s` seconds. The default, one unbounded level, is a plain priority queue."""

    levels: tuple[LevelConfig, ...] = _file_only(
        (LevelConfig("default"),), "the priority levels (default: one unbounded level taking every priority)")
    urgent_after_ms: float | None = _file_only(None, "promote to the urgent lane after waiting this long")
    urgent_slack_ms: float | None = _file_only(50.0, "promote to the urgent lane when the slack drops under this")
    retry_after_s: float = _file_only(1.0, "the least Retry-After a refusal suggests")
    tenant_memory_s: float = _file_only(60.0, "time constant with which a tenant's past service stops counting")

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
        missing = [p for p in range(MIN_PRIORITY, MAX_PRIORITY + 1) if p not in owners]
        _check(not missing, "queue.levels", f"no level takes priorities {missing}")
        _check(self.urgent_after_ms is None or self.urgent_after_ms >= 0, "queue.urgent_after_ms", "must be >= 0")
        _check(self.urgent_slack_ms is None or self.urgent_slack_ms >= 0, "queue.urgent_slack_ms", "must be >= 0")
        _check(self.retry_after_s > 0, "queue.retry_after_s", "must be > 0")
        _check(self.tenant_memory_s > 0, "queue.tenant_memory_s", "must be > 0")

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
        unknown = set(d) - {"levels", "urgent_after_ms", "urgent_slack_ms", "retry_after_s", "tenant_memory_s"}
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
            allowed = {"name", "priorities", "capacity", "overflow", "deadline_ms", "deadline_kind", "tpot_ms"}
            _check(set(item) <= allowed, "queue.levels", f"unknown keys {sorted(set(item) - allowed)}")
            _check("name" in item, "queue.levels", "each level needs a name")
            levels.append(LevelConfig(**item))
        kw = {k: d[k] for k in ("urgent_after_ms", "urgent_slack_ms", "retry_after_s", "tenant_memory_s") if k in d}
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
    """The whole engine tree; CLI flags map onto its leaves."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    queue: QueueConfig = field(default_factory=QueueConfig)


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP layer of `batchserve serve`. `served_model_name` (default: the model's alias or
    file name) is the name clients pass as `model`; `default_max_tokens` caps chat answers that
    set no limit; on SIGTERM, requests in flight get `grace_period_s` to finish.

    What one client may cost the others is bounded: bodies by `max_body_bytes` and
    `max_json_depth`; connections by `max_connections` (those beyond get 503 at once; the
    process's open-file limit lowers it), request headers by `max_header_bytes` and
    `max_headers` (431) and by `header_timeout_s` (a client that has not sent its headers by
    then is cut off), idle keep-alive connections by `keep_alive_s`. A request field the server
    does not know is refused with a 400 naming it, unless `lenient_fields`. `allowed_hosts`
    (comma-separated; `*`: any) is what the Host header may name, by default the bind address
    (and localhost when it is a loopback one): a DNS-rebinding page cannot reach a local server.
    A model step running past `step_timeout_s` (0: no bound) marks the engine stalled: /health
    turns 503 and the requests in flight fail; an engine thread that dies ends the process.

    `priority_order` is how a request's `priority` reads: native, 0-10 with higher served first
    (default 5); vllm, vLLM's order, lower first (default 0), mapped at the HTTP boundary to
    native 5 - priority (so -5..5 covers the native scale; values beyond are refused). An answer
    cut short by a soft deadline reports finish_reason `length` (one of OpenAI's, which clients
    switch on) with `batchserve_finish_reason: deadline_truncated` beside it, or, with
    `native_finish_reasons`, `deadline_truncated` itself."""

    host: str = _flag("127.0.0.1", "address to listen on")
    port: int = _flag(8000, "port to listen on (0: any free port)")
    api_key: str | None = _flag(None, "require 'Authorization: Bearer KEY' on /v1/* and /metrics")
    max_body_bytes: int = _flag(1 << 20, "larger request bodies get 413")
    grace_period_s: float = _flag(30.0, "on SIGTERM, how long requests in flight may take to finish")
    served_model_name: str | None = _flag(None, "the model name clients use (default: the model's)")
    default_max_tokens: int = _flag(1024, "cap for chat requests that set no max_tokens")
    lenient_fields: bool = _flag(False, "ignore unknown request fields instead of refusing them with a 400")
    max_json_depth: int = _flag(32, "JSON bodies nested deeper get 400")
    max_connections: int = _flag(512, "open connections beyond this get 503 at once (lowered by the fd limit)")
    header_timeout_s: float = _flag(10.0, "close connections that have not sent complete headers by then")
    keep_alive_s: float = _flag(5.0, "close idle keep-alive connections after this long")
    max_header_bytes: int = _flag(32768, "larger request headers get 431")
    max_headers: int = _flag(100, "requests with more header lines get 431")
    allowed_hosts: str | None = _flag(None, "Host header names accepted, comma-separated, '*': any "
                                      "(default: the bind address)")
    step_timeout_s: float = _flag(60.0, "a model step running longer marks the engine stalled (0: no bound)")
    priority_order: Literal["native", "vllm"] = _flag(
        "native", "request priority: native 0-10, higher first (default 5); vllm: lower first (default 0)")
    native_finish_reasons: bool = _flag(False, "report a soft-deadline cut as finish_reason deadline_truncated, "
                                        "not length")

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ConfigError(f"server.port: must be an integer in [0, 65535], got {self.port!r}")
        if not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1024:
            raise ConfigError(f"server.max_body_bytes: must be an integer >= 1024, got {self.max_body_bytes!r}")
        if not isinstance(self.grace_period_s, (int, float)) or self.grace_period_s < 0:
            raise ConfigError(f"server.grace_period_s: must be >= 0, got {self.grace_period_s!r}")
        if not isinstance(self.default_max_tokens, int) or self.default_max_tokens < 1:
            raise ConfigError(f"server.default_max_tokens: must be an integer >= 1, got {self.default_max_tokens!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ConfigError("server.api_key: must be a non-empty string")
        for name, lo in (("max_json_depth", 2), ("max_connections", 1), ("max_header_bytes", 1024),
                         ("max_headers", 8)):
            v = getattr(self, name)
            _check(isinstance(v, int) and not isinstance(v, bool) and v >= lo, f"server.{name}",
                   f"must be an integer >= {lo}, got {v!r}")
        for name in ("header_timeout_s", "keep_alive_s"):
            v = getattr(self, name)
            _check(isinstance(v, (int, float)) and v > 0, f"server.{name}", f"must be > 0, got {v!r}")
        _check(isinstance(self.step_timeout_s, (int, float)) and self.step_timeout_s >= 0, "server.step_timeout_s",
               f"must be >= 0, got {self.step_timeout_s!r}")
        _check(self.allowed_hosts is None or (isinstance(self.allowed_hosts, str) and self.allowed_hosts.strip()),
               "server.allowed_hosts", "must be a non-empty string")
        _check(self.priority_order in ("native", "vllm"), "server.priority_order",
               f"must be 'native' or 'vllm', got {self.priority_order!r}")


# The sections of a configuration: EngineConfig's fields, then `server`. A config file has one
# mapping per section; flags are {section: {field: value}}.
SECTIONS: dict[str, type] = {**{f.name: f.default_factory for f in dataclasses.fields(EngineConfig)},
                             "server": ServerConfig}

# The namespace attribute in which batchserve.cli records the dests of the flags given on the
# command line (argparse itself does not tell a default from a value typed out).
EXPLICIT = "_explicit_dests"


def cli_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of a config dataclass that are command-line flags, in declaration order."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("cli", True)]


def flag_name(f: dataclasses.Field) -> str:
    """The flag of a field: metadata `flag`, else `--` + its name with `_` -> `-` (`--no-` +
    that for a bool whose default is True, since giving the flag switches it off)."""
    if "flag" in f.metadata:
        return f.metadata["flag"]
    name = f.name.replace("_", "-")
    return f"--no-{name}" if f.default is True else f"--{name}"


def flag_dest(f: dataclasses.Field) -> str:
    """The namespace attribute of a field's flag: the flag without dashes (and without `no-`)."""
    name = flag_name(f).removeprefix("--")
    if f.default is True:
        name = name.removeprefix("no-")
    return name.replace("-", "_")


def read_yaml(path: str, what: str) -> Any:
    """A YAML file's document ({} when empty); `what` (the flag) names it in errors."""
    import yaml

    try:
        with open(path) as f:
            return yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{what} {path}: {e}") from None


def queue_from_flags(capacity: int | None, path: str | None) -> QueueConfig | None:
    """The queue `--queue-capacity N` or `--queue-config FILE.yaml` asks for; None for neither."""
    if capacity is not None and path is not None:
        raise ConfigError("--queue-capacity and --queue-config: give one or the other")
    if capacity is not None:
        return QueueConfig.bounded(capacity)
    if path is not None:
        return QueueConfig.from_dict(read_yaml(path, "--queue-config"))
    return None


def _values(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def namespace_sources(ns: Any) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """(explicit, implicit) flag values of a parsed command line, as {section: {field: value}}.

    A field is read from the attribute named by `flag_dest`; one the namespace lacks (its
    command has no such flag) is left to the lower layers. Explicit: the dests the parser
    recorded under `EXPLICIT`; a namespace without that record (built by hand) counts each value
    that differs from its field's default. Implicit: the rest, the command's own defaults. The
    queue flags, when given, are explicit and set the whole queue section.
    """
    recorded = getattr(ns, EXPLICIT, None)
    explicit: dict[str, dict[str, Any]] = {}
    implicit: dict[str, dict[str, Any]] = {}
    for section, cls in SECTIONS.items():
        defaults = _values(cls())
        for f in cli_fields(cls):
            dest = flag_dest(f)
            if not hasattr(ns, dest):
                continue
            value = getattr(ns, dest)
            given = dest in recorded if recorded is not None else value != defaults[f.name]
            (explicit if given else implicit).setdefault(section, {})[f.name] = value
    queue = queue_from_flags(getattr(ns, "queue_capacity", None), getattr(ns, "queue_config", None))
    if queue is not None:
        explicit["queue"] = _values(queue)
    return explicit, implicit


def _file_section(name: str, cls: type, doc: Any) -> dict[str, Any]:
    """A config file's section as field values, checked against the dataclass."""
    if hasattr(cls, "from_dict"):  # a section with structure of its own (the queue's levels): set whole
        return _values(cls.from_dict(doc))
    if not isinstance(doc, dict):
        raise ConfigError(f"{name}: expected a mapping, got {type(doc).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(doc) - known)
    if unknown:
        raise ConfigError(f"{name}: unknown keys {unknown}; expected some of {sorted(known)}")
    return dict(doc)


def from_sources(file_doc: Mapping[str, Any] | None = None,
                 explicit: Mapping[str, Mapping[str, Any]] | None = None,
                 implicit: Mapping[str, Mapping[str, Any]] | None = None) -> tuple[EngineConfig, ServerConfig]:
    """The engine and server configs from every source, each field from the highest layer
    that sets it: `explicit` (flags given on the command line) over `file_doc` (a parsed
    `--config` file: a mapping of sections) over `implicit` (a command's own defaults) over
    the dataclass defaults. `explicit` and `implicit` are {section: {field: value}}."""
    explicit, implicit = explicit or {}, implicit or {}
    doc: Mapping[str, Any] = {} if file_doc is None else file_doc
    if not isinstance(doc, dict):
        raise ConfigError(f"config file: expected a mapping, got {type(doc).__name__}")
    engine_sections = [s for s in SECTIONS if s != "server"]
    unknown = sorted(set(doc) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"config file: unknown sections {unknown}; expected {sorted(engine_sections) + ['server']}")
    parts = {}
    for name, cls in SECTIONS.items():
        values = dict(implicit.get(name, {}))
        if doc.get(name) is not None:
            values.update(_file_section(name, cls, doc[name]))
        values.update(explicit.get(name, {}))
        try:
            parts[name] = cls(**values)
        except TypeError as e:
            raise ConfigError(f"{name}: {e}") from None
    server = parts.pop("server")
    return EngineConfig(**parts), server
