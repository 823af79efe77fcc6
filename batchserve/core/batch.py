"""The contracts between scheduler, executor and caller: plain data, no tensors."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from batchserve.request import DEFAULT_PRIORITY, FinishReason, SamplingParams


@dataclass
class ScheduledSeq:
    """One request's share of a step: `token_ids` at positions start_pos.. start_pos+len-1.

    A prompt chunk has len > 1, a decode len == 1. `sample` is True when the last of these
    tokens is the sequence's current end, so the step must produce its next token.
    `output_index` is how many tokens the request has generated so far (seeds use it so that
    sampling is reproducible whatever the batch around it). `history`: the request's (prompt ids,
    output ids), the live lists, set only where its params are `penalized` (the sampler counts
    them); None otherwise, so that a batch crossing a process boundary carries no more.
    `allowed`: for a constrained request (structured outputs) that samples, the bitmask of the
    tokens it may sample (int32 words, bit t % 32 of word t // 32); None: any token.
    `prompt_targets`: for a request that asks for prompt logprobs, the prompt tokens that follow
    these positions (position start_pos + i predicts prompt_targets[i]; shorter than the chunk
    where the prompt ends in it); the executor reports their logprobs.
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool
    params: SamplingParams
    output_index: int
    history: tuple[list[int], list[int]] | None = None
    allowed: Any = None
    prompt_targets: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        return len(self.token_ids) == 1 and self.start_pos > 0


@dataclass(frozen=True)
class PadRow:
    """Padding a padded engine would compute in this step: `num_tokens` tokens at positions
    start_pos.. of a row that belongs to no request. A prompt's padding (to the batch's longest
    prompt) is a row of n >= 1 tokens that samples nothing; a finished member's padded decode
    row is one token that runs the LM head too (`sample`), its logits thrown away."""

    start_pos: int
    num_tokens: int
    sample: bool


@dataclass
class ScheduledBatch:
    """What one forward pass computes. `num_padding_tokens` is accounting for request-level
    policies (tokens a padded batch would have wasted). `padding` is that padding as rows to
    compute, set only when the scheduler is told to pay it (`SchedulerConfig.pay_padding`):
    the cost models charge them and the model runner runs them, results discarded; empty,
    the runner pads nothing.

    A batch is valid until the next schedule(): a decoding request's ScheduledSeq is one object
    updated in place from step to step (copy what must outlive the step)."""

    seqs: list[ScheduledSeq] = field(default_factory=list)
    num_padding_tokens: int = 0
    # the seqs' tokens, when the policy counted them as it scheduled (its budget spent); else
    # counted on each read of num_tokens
    total_tokens: int | None = None
    padding: list[PadRow] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        n = self.total_tokens
        return sum([len(s.token_ids) for s in self.seqs]) if n is None else n

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    @property
    def empty(self) -> bool:
        return not self.seqs


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability under the model (its logits before temperature and
    every adjustment, as vLLM reports them by default), and the `top` most likely tokens at that
    position as (token id, logprob), most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class StepOutput:
    """Executor's answer: the sampled token for every seq with `sample=True`, and for those
    whose params ask for logprobs, their TokenLogprob."""

    sampled: dict[str, int]
    step_time: float = 0.0
    logprobs: dict[str, TokenLogprob] | None = None
    # per seq with prompt_targets: a TokenLogprob for each target, in order
    prompt_logprobs: dict[str, list[TokenLogprob]] | None = None


@dataclass(frozen=True)
class StepRecord:
    """What one model step ran: its size and the executor's time for it; `token_gaps`, for
    each token it gave a request that already had one, the time since that request's previous
    token (inter-token latency, a preemption's pause included)."""

    num_seqs: int
    num_tokens: int
    num_sampled: int
    step_time: float
    token_gaps: list[float] = field(default_factory=list, compare=False)


@dataclass
class RequestOutput:
    """What the caller sees after a step for one request: the new tokens (and text) plus,
    once finished, the finish reason. `token_ids` is every output token so far: while the
    request runs it is the engine's live list (it keeps growing), once finished a final copy.
    The engine builds these positionally: keep the field order."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None = None
    text: str = ""
    new_text: str = ""
    error: str | None = None
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    priority: int = DEFAULT_PRIORITY
    num_preemptions: int = 0
    # for a request that asked for logprobs: a TokenLogprob per token of token_ids / new_token_ids
    logprobs: list[TokenLogprob] | None = None
    new_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # once finished, when asked for
    level: str | None = None  # the queue level it ran in
    tenant: str | None = None  # who sent it (the OpenAI `user` field)


_OUTPUT_FIELDS = tuple(f.name for f in fields(RequestOutput))


class RunningOutput(RequestOutput):
    """A running request's output after a step (the engine builds one per running request per
    step, so it is made from the few values that can still change, not through the
    fifteen-field constructor). It reads the same as a RequestOutput taken at that moment: the
    request's identity, prompt and timestamps come from the request (they are fixed by then:
    `first_token_time` is set, `finish_time` is not), `token_ids` is the live list as in every
    running output, `new_token_ids` the `n`-th token, and text, new text, error and the
    preemption count are kept as they were. Pickled (a worker or replica boundary) or merged, it
    becomes a plain RequestOutput."""

    __slots__ = ("_req", "_n", "text", "new_text", "error", "num_preemptions")
    finished = False
    finish_reason = None
    finish_time = None

    def __init__(self, req, n: int, text: str, new_text: str) -> None:  # the dataclass __init__ is not called
        self._req, self._n, self.text, self.new_text = req, n, text, new_text
        self.error, self.num_preemptions = req.error, req.num_preemptions

    request_id = property(lambda self: self._req.request_id)
    prompt_token_ids = property(lambda self: self._req.prompt_token_ids)
    token_ids = property(lambda self: self._req.output_token_ids)
    new_token_ids = property(lambda self: self._req.output_token_ids[self._n - 1:self._n])
    logprobs = property(lambda self: self._req.output_logprobs)
    prompt_logprobs = None
    new_logprobs = property(lambda self: None if self._req.output_logprobs is None
                            else self._req.output_logprobs[self._n - 1:self._n])
    arrival_time = property(lambda self: self._req.arrival_time)
    first_scheduled_time = property(lambda self: self._req.first_scheduled_time)
    first_token_time = property(lambda self: self._req.first_token_time)
    priority = property(lambda self: self._req.priority)
    level = property(lambda self: self._req.level)
    tenant = property(lambda self: self._req.tenant)

    def _values(self) -> tuple:
        return tuple(getattr(self, f) for f in _OUTPUT_FIELDS)

    def __eq__(self, other: object) -> bool:  # equal to the RequestOutput it reads as
        if not isinstance(other, RequestOutput):
            return NotImplemented
        return self._values() == tuple(getattr(other, f) for f in _OUTPUT_FIELDS)

    __hash__ = None

    def plain(self) -> RequestOutput:
        return RequestOutput(*self._values())

    def __reduce__(self):
        return RequestOutput, self._values()
