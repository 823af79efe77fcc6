"""`continuous`: iteration-level batching. Every step, running requests decode; waiting
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
    preemptive = True

    def schedule(self, sched: "Scheduler", now: float) -> ScheduledBatch:
        b = sched.builder(now)
        b.running()
        b.admit(whole_prompts=True)  # a cut prompt would run in a later step with a fresh budget
        return b.batch()
