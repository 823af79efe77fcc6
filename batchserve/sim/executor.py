"""SimExecutor: stands where the model runner stands, returns fake tokens and a predicted time."""
from __future__ import annotations

from batchserve.core.batch import ScheduledBatch, StepOutput
from batchserve.sim.cost import CostModel

BatchKey = tuple[tuple[str, int, int], ...]

TOKEN_BASE = 1000  # ordinary ids (no special tokens in common vocabularies live here)
TOKEN_SPAN = 20000
STOP_TOKEN = TOKEN_BASE - 1  # below every ordinary id (avoiding ids only moves those up)


def batch_key(batch: ScheduledBatch) -> BatchKey:
    """A batch as comparable data: (request id, tokens, start position) per sequence."""
    return tuple((s.request_id, len(s.token_ids), s.start_pos) for s in batch.seqs)


class SimExecutor:
    """Implements the engine's Executor protocol without a model.

    Every sequence that samples gets an ordinary token id (a function of its position, so
    identical prefixes get identical continuations, as greedy decoding would give), never an
    EOS or stop token, except at the position `ends` names for its request (request id ->
    the position of its last output token), where it gets STOP_TOKEN: a simulated request
    ends by its max_tokens, which is how the workload sets its output length, or where the
    workload says its model would stop (the caller sends such a request with STOP_TOKEN among
    its stop_token_ids). `step_time` is the cost model's prediction.
    """

    def __init__(self, cost: CostModel, block_size: int, num_blocks: int | None = None,
                 avoid_ids: tuple[int, ...] = (), record: bool = False) -> None:
        self.cost = cost
        self.num_blocks = num_blocks or cost.num_blocks(block_size)
        self.max_model_len = cost.max_model_len
        self.avoid_ids = frozenset(avoid_ids)
        self.num_steps = 0
        self.busy_time = 0.0  # seconds of predicted work
        self.num_tokens = 0
        self.trace: list[BatchKey] | None = [] if record else None  # every batch, as data
        self.last_step_time = 0.0
        self.ends: dict[str, int] = {}

    def token_for(self, position: int) -> int:
        tok = TOKEN_BASE + position % TOKEN_SPAN
        while tok in self.avoid_ids:
            tok += 1
        return tok

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        dt = self.cost.step_time(batch)
        self.num_steps += 1
        self.busy_time += dt
        self.last_step_time = dt
        seqs = batch.seqs
        if self.ends:  # some outputs end at a stop token
            token_for, ends = self.token_for, self.ends
            sampled = {s.request_id: STOP_TOKEN if ends.get(s.request_id) == (p := s.start_pos + len(s.token_ids))
                       else token_for(p) for s in seqs if s.sample}
        elif self.avoid_ids:
            token_for = self.token_for
            sampled = {s.request_id: token_for(s.start_pos + len(s.token_ids)) for s in seqs if s.sample}
        else:  # token_for without ids to avoid (one comprehension: this runs for every sequence every step)
            sampled = {s.request_id: TOKEN_BASE + (s.start_pos + len(s.token_ids)) % TOKEN_SPAN
                       for s in seqs if s.sample}
        self.num_tokens += batch.num_tokens
        if self.trace is not None:
            self.trace.append(batch_key(batch))
        return StepOutput(sampled, dt)

    def import_kv(self, block_table: list[int], kv: object) -> None:
        """Adopt another engine's K/V (disaggregated serving, LLMEngine.add_prefilled). There
        is no cache to write in a simulation, so nothing happens; the transfer's cost is
        charged by the caller (sim/loop.py) as a hand-off delay."""
