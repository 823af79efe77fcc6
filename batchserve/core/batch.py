"""The contracts between scheduler, executor and caller: plain data, no tensors."""
from __future__ import annotations

from dataclasses import dataclass, field

from batchserve.request import SamplingParams


@dataclass
class ScheduledSeq:
    """One request's share of a step: `token_ids` at positions start_pos.. start_pos+len-1.

    A prompt chunk has len > 1, a decode len == 1. `sample` is True when the last of these
    tokens is the sequence's current end, so the step must produce its next token.
    `output_index` is how many tokens the request has generated so far (seeds use it so that
    sampling is reproducible whatever the batch around it).
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool
    params: SamplingParams
    output_index: int

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        return len(self.token_ids) == 1 and self.start_pos > 0


@dataclass
class ScheduledBatch:
    """What one forward pass computes. `num_padding_tokens` is accounting for request-level
    policies (tokens a padded batch would have wasted); the runner never pads."""

    seqs: list[ScheduledSeq] = field(default_factory=list)
    num_padding_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return sum([len(s.token_ids) for s in self.seqs])

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    @property
    def empty(self) -> bool:
        return not self.seqs


@dataclass
class StepOutput:
    """Executor's answer: the sampled token for every seq with `sample=True`."""

    sampled: dict[str, int]
    step_time: float = 0.0


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
    finish_reason: str | None = None
    text: str = ""
    new_text: str = ""
    error: str | None = None
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    priority: int = 5
    num_preemptions: int = 0
