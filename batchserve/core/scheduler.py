"""The scheduler: owns the waiting queue, the running set and the KV bookkeeping.

    batch = scheduler.schedule(now)            # policy decides who runs, how many tokens each
    output = executor.execute(batch)
    changed = scheduler.update(batch, output, now)

Policies (core/policies/) decide only what differs between batching modes; the helpers here
(`schedule_running`, `admit`, `preempt`) are shared. Time is always passed in.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from batchserve.config import SchedulerConfig
from batchserve.core.batch import ScheduledBatch, ScheduledSeq, StepOutput
from batchserve.core.kv_cache import KVCacheManager
from batchserve.core.queue import WaitQueue
from batchserve.request import Request, RequestStatus

if TYPE_CHECKING:
    from batchserve.core.policies.base import Policy


def build_seq(req: Request, n: int, block_table: list[int]) -> ScheduledSeq:
    """The request's next `n` tokens, from its computed count on."""
    start = req.num_computed_tokens
    return ScheduledSeq(request_id=req.request_id, token_ids=req.tokens_slice(start, start + n),
                        start_pos=start, block_table=block_table, sample=start + n == req.num_tokens,
                        params=req.params, output_index=req.num_output_tokens)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, policy: "Policy") -> None:
        self.config = config
        self.kv = kv
        self.policy = policy
        self.waiting = WaitQueue()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.finished_now: list[Request] = []  # finished outside update() since last drain
        self.num_preemptions = 0
        self.num_steps = 0

    # --- intake -----------------------------------------------------------------------
    def add(self, req: Request, now: float) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        self.requests[req.request_id] = req
        self.waiting.push(req)
        self.policy.on_add(self, req, now)

    def abort(self, request_id: str, now: float) -> Request | None:
        """End a request wherever it is; its blocks are freed at once."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        self.finish(req, RequestStatus.FINISHED_ABORTED, now)
        return req

    def finish(self, req: Request, status: RequestStatus, now: float) -> None:
        """Move a request to a final state, out of every queue, blocks back to the pool."""
        if req.finished:
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req.request_id)
        req.set_status(status)
        req.finish_time = now
        self.kv.free(req.request_id)
        self.requests.pop(req.request_id, None)
        self.finished_now.append(req)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def drain_finished(self) -> list[Request]:
        out, self.finished_now = self.finished_now, []
        return out

    # --- one step ---------------------------------------------------------------------
    def schedule(self, now: float) -> ScheduledBatch:
        batch = self.policy.schedule(self, now)
        self.num_steps += 1
        return batch

    def update(self, batch: ScheduledBatch, output: StepOutput, now: float) -> list[Request]:
        """Apply a step's results: advance counters, append sampled tokens, finish requests
        that hit EOS / a stop token / their length. Returns every request that changed."""
        changed: list[Request] = []
        for seq in batch.seqs:
            req = self.requests.get(seq.request_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted or finished while the step ran
            req.num_computed_tokens += seq.num_tokens
            self.kv.commit(req)
            if not seq.sample:
                continue
            tok = output.sampled[seq.request_id]
            req.output_token_ids.append(tok)
            if req.first_token_time is None:
                req.first_token_time = now
            changed.append(req)
            p = req.params
            if (not p.ignore_eos and tok == req.eos_token_id) or tok in p.stop_token_ids:
                self.finish(req, RequestStatus.FINISHED_STOPPED, now)
            elif req.num_output_tokens >= req.max_tokens:
                self.finish(req, RequestStatus.FINISHED_LENGTH, now)
        self.policy.on_update(self, batch, output, now)
        return changed

    # --- helpers for policies ------------------------------------------------------------
    def make_seq(self, req: Request, n: int) -> ScheduledSeq:
        return build_seq(req, n, self.kv.block_table(req.request_id))

    def pick_victim(self, exclude: set[str]) -> Request | None:
        """Preemption victim: lowest priority, then latest arrival."""
        cands = [r for r in self.running if r.request_id not in exclude]
        if not cands:
            return None
        return min(cands, key=lambda r: (r.priority, -r.arrival_time))

    def preempt(self, req: Request) -> None:
        """Preempt by recompute: blocks freed, counters reset, back to the waiting queue."""
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.set_status(RequestStatus.PREEMPTED)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.set_status(RequestStatus.WAITING)
        self.waiting.push(req)

    def schedule_running(self, budget: int, chunk: int | None, out: list[ScheduledSeq]) -> int:
        """Give each running request its next tokens (1 for a decode, up to `chunk` for an
        unfinished prompt), preempting the least important when blocks run out. Returns the
        token budget left."""
        scheduled: set[str] = set()
        for req in sorted(self.running, key=lambda r: (-r.priority, r.arrival_time)):
            if req.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if budget <= 0:
                break
            n = min(req.num_tokens - req.num_computed_tokens, budget, chunk or budget)
            if n <= 0:
                continue
            while not self.kv.allocate(req.request_id, req.num_computed_tokens + n):
                victim = self.pick_victim(scheduled | {req.request_id}) or req
                self.preempt(victim)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                continue
            out.append(self.make_seq(req, n))
            scheduled.add(req.request_id)
            budget -= n
        return budget

    def admit(self, req: Request, n: int, now: float) -> ScheduledSeq | None:
        """Try to move the head-of-queue request into the running set with `n` tokens this step
        (after any cached prefix). None, with nothing changed, if its blocks don't fit."""
        if not self.kv.has(req.request_id):
            req.num_computed_tokens = self.kv.match_prefix(req)
            n = min(n, req.num_tokens - req.num_computed_tokens)
        if not self.kv.allocate(req.request_id, req.num_computed_tokens + n):
            self.kv.free(req.request_id)
            req.num_computed_tokens = 0
            return None
        self.waiting.remove(req.request_id)
        req.set_status(RequestStatus.RUNNING)
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
        self.running.append(req)
        return self.make_seq(req, n)
