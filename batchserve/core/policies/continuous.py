"""`continuous` (S4.1): iteration-level batching. Every step, running requests decode; waiting
requests join (whole prompt in one step) while the token budget, `max_num_seqs` and free KV
blocks allow; finished requests leave at once. A prompt longer than the whole step budget is
the one exception: it is split across steps, or it could never run."""
from __future__ import annotations

from typing import TYPE_CHECKING

from batchserve.core.batch import ScheduledBatch
from batchserve.core.policies.base import Policy

if TYPE_CHECKING:
    from batchserve.core.scheduler import Scheduler


class ContinuousPolicy(Policy):
    name = "continuous"

    def schedule(self, sched: "Scheduler", now: float) -> ScheduledBatch:
        cfg = sched.config
        seqs = []
        budget = sched.schedule_running(cfg.max_num_batched_tokens, None, seqs)
        while budget > 0 and len(sched.running) < cfg.max_num_seqs:
            req = sched.waiting.peek()
            if req is None:
                break
            n = req.num_tokens - req.num_computed_tokens
            if budget < n <= cfg.max_num_batched_tokens:
                break  # whole prompts only; it runs in a later step with a fresh budget
            seq = sched.admit(req, min(n, budget), now)
            if seq is None:
                break
            seqs.append(seq)
            budget -= seq.num_tokens
        return ScheduledBatch(seqs, total_tokens=cfg.max_num_batched_tokens - budget)
