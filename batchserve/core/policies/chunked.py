"""`chunked` (S3.3 token level): every step spends its token budget (max_num_batched_tokens)
on decodes first — one token for each running request whose prompt is done — then on
prompt chunks of at most `chunk_size` tokens, continuing prompts before admitting new
ones. A long prompt therefore never stalls running requests, chunks of several prompts
share a step with the decodes, a request leaves as soon as its last token is out, and
nothing is ever padded."""
from __future__ import annotations

from typing import TYPE_CHECKING

from batchserve.core.batch import ScheduledBatch, ScheduledSeq
from batchserve.core.policies.base import Policy
from batchserve.core.scheduler import is_decoding

if TYPE_CHECKING:
    from batchserve.core.scheduler import Scheduler


class ChunkedPolicy(Policy):
    name = "chunked"

    def schedule(self, sched: "Scheduler", now: float) -> ScheduledBatch:
        cfg = sched.config
        chunk = cfg.chunk_size
        seqs: list[ScheduledSeq] = []
        budget = sched.schedule_running(cfg.max_num_batched_tokens, None, seqs, select=is_decoding)
        budget = sched.schedule_running(budget, chunk, seqs)  # unfinished prompts, a chunk each
        # Start a prompt only when the free blocks cover all of it beside what the prompts
        # already under way still need: admitting on the first chunk alone lets many long
        # prompts start at once and then preempt each other over and over.
        owed = sched.prompt_blocks_owed()
        while budget > 0 and len(sched.running) < cfg.max_num_seqs:
            req = sched.waiting.peek()
            if req is None:
                break
            if sched.kv.num_free_blocks - owed < sched.kv.blocks_for(req.num_tokens):
                break
            seq = sched.admit(req, min(chunk, budget, req.num_tokens - req.num_computed_tokens), now)
            if seq is None:
                break
            seqs.append(seq)
            budget -= seq.num_tokens
            owed += sched.kv.num_blocks_needed(req.request_id, req.num_tokens)
        return ScheduledBatch(seqs, total_tokens=cfg.max_num_batched_tokens - budget)
