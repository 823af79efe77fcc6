"""Request: the single source of truth about one generation; RequestSpec, the typed request
that travels from the HTTP layer to the engine; SamplingParams; and the enums and constants
every layer shares (priorities, deadline kinds, finish reasons)."""
from __future__ import annotations

import enum
import math
from typing import Any
from dataclasses import dataclass, field

MIN_PRIORITY, MAX_PRIORITY = 0, 10
DEFAULT_PRIORITY = 5  # the priority of a request that names none; higher is more urgent
MAX_INT32 = 2**31 - 1  # the largest max_tokens / top_k / token id a request may name
MAX_STOPS, MAX_STOP_CHARS = 16, 1000
MAX_LOGIT_BIAS = 1024  # entries of logit_bias a request may set
MAX_LOGPROBS = 20  # most likely tokens reported beside each sampled one (vLLM's default cap)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class RequestError(ValueError):
    """A request field is invalid; `param` names the field (used for HTTP 400 bodies)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message

    def __reduce__(self):  # picklable (it crosses process boundaries with --ray)
        return (type(self), (self.param, self.message))


class OverloadedError(RuntimeError):
    """The admission queue refused a request (HTTP 503); retry after `retry_after_s` seconds."""

    def __init__(self, message: str, retry_after_s: float = 1.0, level: str | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.level = level

    def __reduce__(self):
        return (type(self), (str(self), self.retry_after_s, self.level))


class DeadlineKind(enum.StrEnum):
    """What missing a deadline means: `hard`, the request fails (HTTP 504) and is ended as soon
    as it cannot make it; `soft`, the answer is cut short to arrive in time."""

    HARD = "hard"
    SOFT = "soft"


class FinishReason(enum.StrEnum):
    """Why a request ended, as callers see it (a `str`: compares equal to its value)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    DEADLINE = "deadline"
    TRUNCATED = "deadline_truncated"
    REJECTED = "rejected"
    ERROR = "error"


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. temperature 0 means greedy.

    The logit adjustments follow OpenAI / vLLM, in vLLM's order: `logit_bias` ((token id, bias)
    pairs; a dict is taken too) is added; before `min_tokens` tokens the EOS token (unless
    ignore_eos) and `stop_token_ids` are masked; `repetition_penalty` divides the positive logits
    (multiplies the negative) of tokens in the prompt or output; `frequency_penalty` · count +
    `presence_penalty` · [count > 0] over the output is subtracted; after temperature, `min_p`
    drops tokens less likely than min_p times the most likely. `logprobs` (None: off) asks for
    each sampled token's log-probability and that many of the most likely tokens beside it
    (0 to MAX_LOGPROBS), from the model's logits before any of this; `prompt_logprobs` the same for
    each prompt token after the first (scoring: such a request skips the prefix cache, whose
    positions would go uncomputed). `adjusts_logits` and `penalized`
    (needs the token history) are derived once, so that the sampler's fast path reads a flag."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    adjusts_logits: bool = field(default=False, init=False, repr=False, compare=False)
    penalized: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(bias.items() if isinstance(bias, dict) else bias))
        self.validate()
        pen = self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
        object.__setattr__(self, "penalized", pen)
        object.__setattr__(self, "adjusts_logits", pen or bool(self.logit_bias) or self.min_tokens > 0
                           or (self.min_p > 0 and not self.greedy))

    def validate(self) -> None:
        """Raise RequestError naming the first bad field. Every field is bounded here, so that
        a value that passes can never fail in the sampler (on the engine thread, inside a step
        other requests share): integers fit the int64 tensors the sampler builds, floats are
        finite."""
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= MAX_INT32:
            raise RequestError("max_tokens", f"must be an integer in [1, {MAX_INT32}], got {self.max_tokens!r}")
        if not _is_num(self.temperature) or not 0.0 <= self.temperature <= 2.0:
            raise RequestError("temperature", f"must be a number in [0, 2], got {self.temperature!r}")
        if not _is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise RequestError("top_p", f"must be a number in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= MAX_INT32:
            raise RequestError("top_k", f"must be an integer in [0, {MAX_INT32}] (0: no cut), got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not -2**63 <= self.seed < 2**63):
            raise RequestError("seed", f"must be a 64-bit signed integer, got {self.seed!r}")
        if (not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in self.stop)
                or len(self.stop) > MAX_STOPS):
            raise RequestError("stop", f"must be up to {MAX_STOPS} non-empty strings of up to {MAX_STOP_CHARS} "
                               "characters")
        if len(self.stop_token_ids) > 64 or not all(_is_int(t) and 0 <= t <= MAX_INT32 for t in self.stop_token_ids):
            raise RequestError("stop_token_ids", f"must be up to 64 integers in [0, {MAX_INT32}]")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_num(v) or not -2.0 <= v <= 2.0:
                raise RequestError(name, f"must be a number in [-2, 2], got {v!r}")
        r = self.repetition_penalty
        if not _is_num(r) or not 0.0 < r <= 2.0:
            raise RequestError("repetition_penalty", f"must be a number in (0, 2], got {r!r}")
        if not _is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise RequestError("min_p", f"must be a number in [0, 1], got {self.min_p!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise RequestError("min_tokens", f"must be an integer in [0, max_tokens ({self.max_tokens})], "
                               f"got {self.min_tokens!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS or not all(
                isinstance(e, tuple) and len(e) == 2 and _is_int(e[0]) and 0 <= e[0] <= MAX_INT32
                and _is_num(e[1]) and -100 <= e[1] <= 100 for e in self.logit_bias):
            raise RequestError("logit_bias", f"must map up to {MAX_LOGIT_BIAS} token ids in [0, {MAX_INT32}] to "
                               "numbers in [-100, 100]")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise RequestError(name, f"must be an integer in [0, {MAX_LOGPROBS}], got {v!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_DEADLINE = "deadline"
    FINISHED_TRUNCATED = "deadline_truncated"
    FINISHED_REJECTED = "rejected"
    FINISHED_ERROR = "error"

    HANDED_OFF = "handed_off"  # left this engine to carry on in another (disaggregated serving)

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.PREEMPTED)

    @property
    def finish_reason(self) -> FinishReason | None:
        """What a caller is told; None while unfinished, or when the request left for another engine."""
        return _REASONS.get(self)


_S = RequestStatus
# a final status's value is its finish reason; HANDED_OFF has none (it finished elsewhere)
_REASONS = {s: FinishReason(s.value) for s in _S if s.value in FinishReason._value2member_map_}
_RUNNING, _WAITING, _PREEMPTED = _S.RUNNING, _S.WAITING, _S.PREEMPTED
_TRANSITIONS: dict[RequestStatus, frozenset[RequestStatus]] = {
    _S.WAITING: frozenset({_S.RUNNING} | {s for s in _S if s.finished}),
    _S.RUNNING: frozenset({_S.PREEMPTED} | {s for s in _S if s.finished}),
    _S.PREEMPTED: frozenset({_S.WAITING} | {s for s in _S if s.finished}),
}


def check_priority(priority: object) -> int:
    """`priority` as an int in [MIN_PRIORITY, MAX_PRIORITY], or RequestError naming it."""
    if not isinstance(priority, int) or isinstance(priority, bool) or not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise RequestError("priority", f"must be an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}], got {priority!r}")
    return priority


CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar")


@dataclass(frozen=True)
class Constraint:
    """What an answer must match. `kind`: "json" (`spec` a JSON schema as a dict or its text;
    an empty dict: any JSON object), "regex" (a regular expression, Rust syntax), "choice"
    (a tuple of strings: exactly one of them), "grammar" (Lark, or GBNF when it uses `::=`).
    `field` names where the request stated it, for error messages. `whitespace`: a regex for
    the whitespace JSON may use between tokens (None: none beyond the separators)."""

    kind: str
    spec: Any
    field: str = "response_format"
    whitespace: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise RequestError(self.field, f"unknown constraint kind {self.kind!r}; one of {', '.join(CONSTRAINT_KINDS)}")
        ok = {"json": lambda s: isinstance(s, (dict, str, bool)), "regex": lambda s: isinstance(s, str) and s,
              "choice": lambda s: isinstance(s, tuple) and s and all(isinstance(c, str) and c for c in s),
              "grammar": lambda s: isinstance(s, str) and s.strip()}[self.kind]
        if not ok(self.spec):
            want = {"json": "a JSON schema (an object)", "regex": "a non-empty string",
                    "choice": "a non-empty list of non-empty strings", "grammar": "a non-empty string"}[self.kind]
            raise RequestError(self.field, f"must be {want}, got {self.spec!r:.80}")


@dataclass(frozen=True)
class RequestSpec:
    """One request as its caller states it: what to generate from, how, and how urgently.

    Built once at the edge (the HTTP layer, the offline `LLM`, a simulator) and carried unchanged
    to the engine thread, which tokenizes it and makes the `Request`. This is the one place a
    request's priority and deadline are checked: a bad value raises RequestError naming it.
    `deadline_ms` / `deadline_kind` left None take the queue level's defaults; `arrival_time`
    (engine clock) left None is when the engine takes the request. `auto_max_tokens` set (for a
    caller that gave no limit): max_tokens becomes the room the context leaves, up to that many.
    `tenant` names who sent it (the OpenAI `user` field): a level's service is shared fairly
    between tenants. `constraint`: what the answer must match (structured outputs); preparing
    the spec compiles it into `grammar`, the request's own matcher (not for pickling).
    `group`: a name the copies of one prompt share (the choices of n > 1, best_of's candidates;
    same prompt, same engine): the engine prefills that prompt once for all of them."""

    params: SamplingParams
    prompt: str | list[int] | None = None  # text, or token ids
    messages: list[dict] | None = None  # chat messages, through the model's chat template
    request_id: str | None = None
    priority: int = DEFAULT_PRIORITY
    deadline_ms: float | None = None
    deadline_kind: DeadlineKind | None = None
    auto_max_tokens: int | None = None
    arrival_time: float | None = None
    tenant: str | None = None
    constraint: Constraint | None = None
    tools: list[dict] | None = None  # for the chat template (function calling)
    describe_tools: bool = False  # the model chooses whether to call: a template that renders no tools gets them as text
    template_options: dict[str, Any] | None = None  # chat template: add_generation_prompt, continue_final_message, variables
    group: str | None = None  # copies of one prompt: prefilled once (see the docstring)
    grammar: Any = field(default=None, repr=False, compare=False)

    def __getstate__(self) -> dict:  # a matcher stays in its process; the constraint travels
        return {**self.__dict__, "grammar": None}

    def __post_init__(self) -> None:
        check_priority(self.priority)
        t = self.tenant
        if t is not None and (not isinstance(t, str) or not 0 < len(t) <= 256):
            raise RequestError("user", f"must be a string of 1 to 256 characters, got {t!r}")
        d = self.deadline_ms
        if d is not None and (not isinstance(d, (int, float)) or isinstance(d, bool) or not 0 < d < math.inf):
            raise RequestError("deadline_ms", f"must be a positive number, got {d!r}")
        kind = self.deadline_kind
        if kind is not None and not isinstance(kind, DeadlineKind):
            try:
                object.__setattr__(self, "deadline_kind", DeadlineKind(kind))
            except ValueError:
                raise RequestError("deadline_kind", f"must be 'hard' or 'soft', got {kind!r}") from None
        if (self.prompt is None) == (self.messages is None):
            raise RequestError("prompt", "give exactly one of prompt and messages")


@dataclass(eq=False)
class Request:
    """One generation. Counters, not tensors: the scheduler reads and moves them.

    `num_computed_tokens` counts tokens whose KV is in the cache. After preemption by
    recompute it drops to 0 and the request re-reads prompt + output so far.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int = DEFAULT_PRIORITY  # MIN_PRIORITY..MAX_PRIORITY, higher is more urgent
    deadline_ms: float | None = None  # None: the queue level's default (which may be none)
    deadline_kind: DeadlineKind | None = None  # None: the queue level's default
    eos_token_id: int | None = None
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    max_tokens: int = 0  # effective cap; a soft deadline may lower it
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None  # when its newest token came (inter-token latency)
    finish_time: float | None = None
    num_preemptions: int = 0
    num_priority_preemptions: int = 0  # of those, to make room for a more important request
    work_tokens: int = 0  # tokens the model computed for it, recomputation included
    error: str | None = None
    level: str | None = None  # queue level, set by the admission queue
    urgent: bool = False  # promoted to the urgent lane
    aged: bool = False  # promoted for its wait: ahead of every level (bounds starvation)
    tenant: str | None = None  # who sent it: shares of a level are fair between tenants
    group: str | None = None  # copies of one prompt share its prefill (Scheduler: awaits_copy, fork)
    grammar: Any = None  # structured outputs: the matcher its tokens must pass (engine/structured.py)
    extras: bool = False  # a grammar or logprobs: each new token has more to do than be appended
    output_logprobs: list | None = None  # a TokenLogprob per output token, when params.logprobs is set
    # when params.prompt_logprobs is set: a TokenLogprob per prompt position (None for the first)
    prompt_logprobs: list | None = None
    # the scheduler's ScheduledSeq for this request's decode steps, updated in place each step
    # rather than built anew (StepBuilder.running; a batch is valid until the next schedule)
    decode_seq: object = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise RequestError("prompt", "must not be empty")
        if self.max_tokens == 0:
            self.max_tokens = self.params.max_tokens
        if self.params.logprobs is not None and self.output_logprobs is None:
            self.output_logprobs = []
        self.extras = self.extras or self.output_logprobs is not None or self.grammar is not None
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)

    # --- derived counters -------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens: the sequence whose KV the cache must hold."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_num_tokens(self) -> int:
        """Prompt plus the most tokens it may generate: how far its KV can grow."""
        return len(self.prompt_token_ids) + self.max_tokens

    @property
    def hard_deadline(self) -> bool:
        """True when missing the deadline is failure; an unset kind counts as hard."""
        return self.deadline_ms is not None and self.deadline_kind != DeadlineKind.SOFT

    @property
    def deadline(self) -> float | None:
        """Absolute deadline (same clock as arrival_time), or None."""
        return None if self.deadline_ms is None else self.arrival_time + self.deadline_ms / 1000.0

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def tokens_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    # --- state machine ------------------------------------------------------------------
    def set_status(self, new: RequestStatus) -> None:
        if new not in _TRANSITIONS.get(self.status, frozenset()):
            raise RuntimeError(f"request {self.request_id}: illegal transition {self.status.name} -> {new.name}")
        self.status = new

    @property
    def finished(self) -> bool:
        s = self.status  # hot (several reads per request per step): identity, not Enum.__hash__
        return s is not _RUNNING and s is not _WAITING and s is not _PREEMPTED
