"""Request-level batching, the common part of `static` and `dynamic`.

A batch is formed once — after a collection window, or as soon as `max_batch` requests
wait — and then runs to completion: no request joins until every member is done, and the
members' results are released together when the last one finishes (the seed's static baseline).
Tokens of members still running stream as usual; what is held is each finished member's
final output, so a caller sees every result of a batch at the same moment.

Padding: a padded implementation would run the batch as B rows of (longest prompt + longest
output) tokens. Each step reports in `num_padding_tokens` the tokens such a padded batch
would have wasted (prompt padding on the first step, one token per finished member on every
later step), and `padding_tokens` / `useful_tokens` keep the running totals. By default that
is accounting only: the batch runs ragged. With `pay_padding` the same tokens are also put in
the batch as `padding` rows (`PadRow`), so the step is charged (simulator) and computes
(model runner) what a padded engine's would:
- first step: member i with n_i tokens (prompt) of a batch whose longest is L gets a row of
  L - n_i tokens at positions n_i .. L - 1 (right padding: attention over L positions);
- every later step: a member that has finished, with m tokens then, gets a one-token decode
  row at position m - 1 + k on the k-th step since (its row grows as a padded row would),
  that runs the LM head too.
What is not padded: the running members' own rows keep their own lengths, so their
attention does not span the other rows' padding as a dense [B, L] kernel's would.

Members reserve KV for their whole prompt + max_tokens when the batch forms, so a running
batch never needs preemption (real static batching allocates the padded maximum too).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from batchserve.config import SchedulerConfig
from batchserve.core.batch import PadRow, ScheduledBatch
from batchserve.core.policies.base import Policy
from batchserve.request import Request, RequestStatus

if TYPE_CHECKING:
    from batchserve.core.scheduler import Scheduler


class RequestLevelPolicy(Policy):
    name = "request-level"

    def __init__(self, config: SchedulerConfig | None = None) -> None:
        super().__init__(config)
        self.window_ms = self.config.window_ms
        self.max_batch = self.config.max_batch
        self.members: list[Request] = []  # the batch now running (some may not be admitted yet)
        self._member_ids: set[str] = set()
        self._held: list[Request] = []  # finished members whose results wait for the batch
        self._pending_padding = 0  # prompt padding, charged on the batch's first step
        self._pending_rows: list[PadRow] = []  # the same as rows, with pay_padding
        self._pad_pos: dict[str, int] = {}  # finished member -> its padded row's next position
        self.batch_start = 0.0
        self.useful_tokens = 0
        self.num_batches = 0

    # --- hooks for subclasses -------------------------------------------------------------
    def update_controls(self, sched: "Scheduler", now: float) -> None:
        """Every step, before anything else: adaptive policies move window_ms / max_batch."""

    def should_launch(self, sched: "Scheduler", now: float) -> bool:
        """Start a batch now? Fixed window from the oldest waiting arrival, or a full batch."""
        depth = len(sched.waiting)
        if depth == 0:
            return False
        return depth >= self.max_batch or (now - oldest_arrival(sched.waiting)) * 1000.0 >= self.window_ms

    def candidates(self, sched: "Scheduler") -> Iterable[Request]:
        """Waiting requests in the order they are offered a place in the next batch."""
        return iter(sched.waiting)

    def on_batch_end(self, sched: "Scheduler", members: list[Request], now: float) -> None:
        """The batch's results were released at `now`."""

    def next_step_due(self, sched: "Scheduler", now: float) -> float | None:
        """A batch being collected launches when its oldest request has waited the window."""
        if self.members or not len(sched.waiting):
            return None
        return oldest_arrival(sched.waiting) + self.window_ms / 1000.0

    # --- Policy -------------------------------------------------------------------------------
    def schedule(self, sched: "Scheduler", now: float) -> ScheduledBatch:
        self.update_controls(sched, now)
        if not self.members:
            if not self.should_launch(sched, now):
                return ScheduledBatch()
            self._form(sched, now)
        b = sched.builder(now)
        b.running(select=lambda r: r.request_id in self._member_ids)
        # members not admitted yet (the step budget ran out before them), in batch order
        b.admit((r for r in self.members if r.status is RequestStatus.WAITING and r.request_id in sched.requests))
        seqs = b.seqs
        done = [r for r in self.members if r.request_id not in sched.requests] if seqs else []
        padding = self._pending_padding + len(done)
        self._pending_padding = 0
        self.padding_tokens += padding
        self.useful_tokens += b.spent
        rows = None
        if self.config.pay_padding:
            rows, self._pending_rows = self._pending_rows, []
            rows.extend(PadRow(self._next_pad_pos(r), 1, True) for r in done)
        return b.batch(num_padding_tokens=padding, padding=rows)

    def _next_pad_pos(self, r: Request) -> int:
        pos = self._pad_pos.get(r.request_id, r.num_tokens - 1)
        self._pad_pos[r.request_id] = pos + 1
        return pos

    def release(self, sched: "Scheduler", finished: list[Request], now: float) -> list[Request]:
        out = []
        for req in finished:
            (self._held if req.request_id in self._member_ids else out).append(req)
        if self.members and not any(r.request_id in sched.requests for r in self.members):
            for req in self._held:
                req.finish_time = now  # the caller gets the result when the batch ends
            out.extend(self._held)
            members = self.members
            self.members, self._member_ids, self._held, self._pad_pos = [], set(), [], {}
            self.on_batch_end(sched, members, now)
        return out

    @property
    def padding_fraction(self) -> float:
        """Share of a padded implementation's tokens that would have been padding."""
        total = self.padding_tokens + self.useful_tokens
        return self.padding_tokens / total if total else 0.0

    # --- internals ------------------------------------------------------------------------
    def _form(self, sched: "Scheduler", now: float) -> None:
        cap = min(self.max_batch, sched.config.max_num_seqs)
        free = sched.kv.num_free_blocks - sum(sched.kv.num_blocks_needed(r.request_id, reserve(r))
                                              for r in sched.running)
        for req in self.candidates(sched):
            if len(self.members) >= cap:
                break
            need = sched.kv.num_blocks_needed(req.request_id, reserve(req))
            if need > free:
                break  # keep queue order; the rest waits for the next batch
            free -= need
            self.members.append(req)
        self._member_ids = {r.request_id for r in self.members}
        if self.members:
            longest = max(r.num_tokens for r in self.members)
            self._pending_padding = sum(longest - r.num_tokens for r in self.members)
            if self.config.pay_padding:
                self._pending_rows = [PadRow(r.num_tokens, longest - r.num_tokens, False)
                                      for r in self.members if r.num_tokens < longest]
            self.batch_start = now
            self.num_batches += 1


def reserve(req: Request) -> int:
    """Tokens of KV the request can need by its end: prompt + the rest of its output."""
    return req.num_prompt_tokens + req.max_tokens


def oldest_arrival(waiting: Iterable[Request]) -> float:
    return min(r.arrival_time for r in waiting)
