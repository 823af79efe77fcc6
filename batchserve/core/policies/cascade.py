"""`cascade`: prefill and decode batched as two stages, each with its own cap and
token budget.

- Prefill stage: up to `prefill_max_batch` prompts (continued ones first, then new ones,
  whole prompts unless one exceeds the budget) within `max_num_batched_tokens`.
- Decode stage: continuous batching of up to `decode_max_batch` requests whose prompt is
  done, one token each; a request keeps its decode slot until it finishes, and free slots
  are filled from the prefilled requests waiting for one (the hand-off queue).

In one process the stages alternate: a prefill step runs when there is prompt work and
either nothing to decode, or `cascade_ratio` decode steps have run since the last prefill
and the hand-off queue holds less than one decode batch (so prefill never runs far ahead
of decode and fills the KV cache). With `cascade_workers` the two stages are separate
worker processes, so every step carries both parts and the executor runs them at once.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from batchserve.config import SchedulerConfig
from batchserve.core.admission import StepBuilder, is_decoding
from batchserve.core.batch import ScheduledBatch
from batchserve.core.policies.base import Policy
from batchserve.request import RequestStatus

if TYPE_CHECKING:
    from batchserve.core.scheduler import Scheduler


class CascadePolicy(Policy):
    name = "cascade"

    def __init__(self, config: SchedulerConfig | None = None) -> None:
        super().__init__(config)
        self.max_batch = self.config.decode_max_batch
        self.decoding: list[str] = []  # the decode batch, in the order requests joined it
        self.since_prefill = 0
        self.num_prefill_steps = 0
        self.num_decode_steps = 0

    def schedule(self, sched: "Scheduler", now: float) -> ScheduledBatch:
        cfg = sched.config
        self._refresh_decode_set(sched)
        ready = [r for r in sched.running if is_decoding(r)]
        backlog = len(ready) - len(self.decoding)
        prompt_work = (any(not is_decoding(r) for r in sched.running)
                       or (len(sched.waiting) > 0 and len(sched.running) < cfg.max_num_seqs))
        b = sched.builder(now)
        if cfg.cascade_workers:  # both stages every step, on two workers
            self._decode(sched, b)
            if prompt_work and backlog < cfg.decode_max_batch:
                self._prefill(sched, b)
            return b.batch()
        want_prefill = prompt_work and (not ready or (self.since_prefill >= cfg.cascade_ratio
                                                       and backlog < cfg.decode_max_batch))
        if want_prefill:
            self._prefill(sched, b)
        if not b.seqs:  # no prefill wanted, or none fitted: decode instead of idling
            self._decode(sched, b)
        if not b.seqs and prompt_work and not want_prefill:
            self._prefill(sched, b)
        return b.batch()

    def _refresh_decode_set(self, sched: "Scheduler") -> None:
        """Drop finished or preempted members, then fill free slots from the hand-off queue."""
        def still(rid: str) -> bool:
            r = sched.requests.get(rid)
            return r is not None and r.status == RequestStatus.RUNNING and is_decoding(r)

        self.decoding = [rid for rid in self.decoding if still(rid)]
        members = set(self.decoding)
        for r in sched.running_order():
            if len(self.decoding) >= sched.config.decode_max_batch:
                break
            if r.request_id not in members and is_decoding(r):
                self.decoding.append(r.request_id)
                members.add(r.request_id)

    def _decode(self, sched: "Scheduler", b: StepBuilder) -> None:
        """The decode stage: one token for each member of the decode set."""
        cfg = sched.config
        members = set(self.decoding)
        b.stage(min(cfg.decode_max_batch, cfg.max_num_batched_tokens))
        b.running(select=lambda r: r.request_id in members)
        if b.stage_seqs:
            self.num_decode_steps += 1
            self.since_prefill += 1

    def _prefill(self, sched: "Scheduler", b: StepBuilder) -> None:
        """The prefill stage: continued prompts, then new ones, up to `prefill_max_batch`."""
        cfg = sched.config
        b.stage(cfg.max_num_batched_tokens)
        b.running(select=lambda r: not is_decoding(r), max_seqs=cfg.prefill_max_batch)
        b.admit(whole_prompts=True, max_seqs=cfg.prefill_max_batch)
        if b.stage_seqs:
            self.num_prefill_steps += 1
            self.since_prefill = 0
