"""`chunked` (token-level batching): every step spends its token budget (max_num_batched_tokens)
on decodes first — one token for each running request whose prompt is done — then on
prompt chunks of at most `chunk_size` tokens, continuing prompts before admitting new
ones. A long prompt therefore never stalls running requests, chunks of several prompts
share a step with the decodes, a request leaves as soon as its last token is out, and
nothing is ever padded."""
from __future__ import annotations

from typing import TYPE_CHECKING

from batchserve.core.admission import is_decoding
from batchserve.core.batch import ScheduledBatch
from batchserve.core.policies.base import Policy

if TYPE_CHECKING:
    from batchserve.core.scheduler import Scheduler


class ChunkedPolicy(Policy):
    name = "chunked"
    preemptive = True

    def schedule(self, sched: "Scheduler", now: float) -> ScheduledBatch:
        chunk = sched.config.chunk_size
        b = sched.builder(now)
        b.running(select=is_decoding)
        b.running(chunk=chunk)  # unfinished prompts, a chunk each
        b.admit(chunk=chunk, cover_prompts=True)
        return b.batch()
