"""`continuous`: iteration-level batching. Every step, running requests decode; waiting
requests join (whole prompt in one step) while the token budget, `max_num_seqs` and free KV
blocks allow; finished requests leave at once. Two exceptions cut a prompt across steps: one
longer than the whole step budget (or it could never run), and one cut to what a step ceiling
lets it add beside running requests short of time (core/deadlines.py), since holding it back
whole would idle its seat for as long as they run."""
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
