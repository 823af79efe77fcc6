"""The scheduler: owns the waiting queue, the running set and the KV bookkeeping.

    batch = scheduler.schedule(now)            # policy decides who runs, how many tokens each
    output = executor.execute(batch)
    changed = scheduler.update(batch, output, now)

Policies (core/policies/) decide only what differs between batching modes; the helpers here
(`schedule_running`, `admit`, `preempt`) are shared. Time is always passed in.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from batchserve.config import QueueConfig, SchedulerConfig
from batchserve.core import deadlines
from batchserve.core.batch import ScheduledBatch, ScheduledSeq, StepOutput
from batchserve.core.kv_cache import KVCacheManager
from batchserve.core.latency import LatencyModel, OnlineLinearModel
from batchserve.core.queue import AdmissionQueue
from batchserve.request import OverloadedError, Request, RequestStatus

_RUNNING = RequestStatus.RUNNING

if TYPE_CHECKING:
    from batchserve.core.policies.base import Policy


def build_seq(req: Request, n: int, block_table: list[int]) -> ScheduledSeq:
    """The request's next `n` tokens, from its computed count on."""
    start = req.num_computed_tokens
    return ScheduledSeq(req.request_id, req.tokens_slice(start, start + n), start, block_table,
                        start + n == req.num_tokens, req.params, req.num_output_tokens)


def priority_order(req: Request) -> tuple[int, float]:
    """Sort key of the running set: higher priority first, then earlier arrival."""
    return (-req.priority, req.arrival_time)


def is_decoding(req: Request) -> bool:
    """The request's KV is complete but for its newest token: its next step is a decode."""
    c = req.num_computed_tokens  # (num_tokens spelled out: policies call this per request per step)
    return c > 0 and len(req.prompt_token_ids) + len(req.output_token_ids) - c == 1


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, policy: "Policy",
                 queue: QueueConfig | None = None, latency: LatencyModel | None = None) -> None:
        self.config = config
        self.kv = kv
        self.policy = policy
        self.waiting = AdmissionQueue(queue)
        self.latency: LatencyModel = latency or OnlineLinearModel()  # the engine feeds it step times
        self.prediction_floor = 0.0  # lowest step prediction the queue's deadline looks rely on
        self.running: list[Request] = []
        self._order: list[Request] = []  # `running` sorted by priority_order (running_order())
        self._order_of: list[Request] = []  # the `running` that _order was sorted from
        self.requests: dict[str, Request] = {}
        self.finished_now: list[Request] = []  # finished outside update() since last drain
        self.num_preemptions = 0
        self.num_steps = 0

    # --- intake -----------------------------------------------------------------------
    def add(self, req: Request, now: float) -> None:
        """Admit a request through the queue. Raises OverloadedError when its level is full
        and refuses; a request that cannot make its hard deadline ends at once (`deadline`);
        a request dropped for this one ends as `rejected`. Ended ones show in the next step."""
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        self.waiting.classify(req)  # level defaults (deadline) first: admission checks use them
        self.requests[req.request_id] = req
        if deadlines.doomed_at_admission(self, req, now):
            return
        try:
            dropped = self.waiting.offer(req, now)
        except OverloadedError as e:
            del self.requests[req.request_id]
            req.set_status(RequestStatus.FINISHED_REJECTED)
            req.error, req.finish_time = str(e), now
            raise
        if dropped is not None:
            self.finish(dropped, RequestStatus.FINISHED_REJECTED, now)
        self.policy.on_add(self, req, now)

    def adopt(self, req: Request, num_computed: int, now: float) -> bool:
        """Take in a request whose first `num_computed` tokens' KV another worker computed
        (disaggregated prefill): it joins the running set directly, its blocks allocated for
        the caller to fill. False, with nothing changed, when the blocks don't fit."""
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        if not self.kv.allocate(req.request_id, num_computed, req.max_num_tokens):
            return False
        self.waiting.classify(req)
        self.requests[req.request_id] = req
        req.num_computed_tokens = num_computed
        req.set_status(RequestStatus.RUNNING)
        req.first_scheduled_time = now
        self.running.append(req)
        return True

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
        self.waiting.metrics.on_finish(req)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def drain_finished(self) -> list[Request]:
        out, self.finished_now = self.finished_now, []
        return out

    def release(self, finished: list[Request], now: float) -> list[Request]:
        """Which finished requests go back to the caller now (the policy may hold some, e.g.
        a static batch returns all its results together)."""
        return self.policy.release(self, finished, now)

    # --- one step ---------------------------------------------------------------------
    def schedule(self, now: float) -> ScheduledBatch:
        self.check_deadlines(now)
        batch = self.policy.schedule(self, now)
        self.num_steps += 1
        return batch

    def update(self, batch: ScheduledBatch, output: StepOutput, now: float) -> list[Request]:
        """Apply a step's results: advance counters, append sampled tokens, finish requests
        that hit EOS / a stop token / their length. Returns every request that changed."""
        changed: list[Request] = []
        requests, sampled = self.requests, output.sampled
        commit = self.kv.commit if self.kv.prefix_caching else None  # a no-op without prefix caching
        for seq in batch.seqs:
            rid = seq.request_id
            req = requests.get(rid)
            if req is None or req.status is not _RUNNING:
                continue  # aborted or finished while the step ran
            if req.deadline_ms is not None and deadlines.missed_during_step(req, now):
                deadlines.end_hard_miss(self, req, now)  # a result past a hard deadline is a failure
                continue
            req.num_computed_tokens += len(seq.token_ids)
            if commit is not None:
                commit(req)
            if not seq.sample:
                continue
            tok = sampled[rid]
            out_ids = req.output_token_ids
            out_ids.append(tok)
            if req.first_token_time is None:
                req.first_token_time = now
            changed.append(req)
            p = req.params
            if (not p.ignore_eos and tok == req.eos_token_id) or tok in p.stop_token_ids:
                self.finish(req, RequestStatus.FINISHED_STOPPED, now)
            elif len(out_ids) >= req.max_tokens:
                self.finish(req, deadlines.length_status(req), now)
        self.policy.on_update(self, batch, output, now)
        return changed

    # --- deadlines (core/deadlines.py) ----------------------------------------------------
    def check_deadlines(self, now: float) -> None:
        """End queued and running hard-deadline requests that missed or cannot make their
        deadline; cut soft-deadline ones to what fits; promote to the urgent lane. Runs at the
        start of every schedule(now); policies may call it again."""
        deadlines.check_deadlines(self, now)

    def predicted_service(self, req: Request, joining: bool = False) -> float:
        """Seconds the latency model predicts `req` still needs, to its max_tokens."""
        return deadlines.predicted_service(self, req, joining)

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
        req.decode_seq = None  # its block table is gone: a new one is built when it decodes again
        req.set_status(RequestStatus.PREEMPTED)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.set_status(RequestStatus.WAITING)
        self.waiting.push(req)

    def schedule_running(self, budget: int, chunk: int | None, out: list[ScheduledSeq],
                         select: Callable[[Request], bool] | None = None) -> int:
        """Give each running request its next tokens (1 for a decode, up to `chunk` for an
        unfinished prompt), preempting the least important when blocks run out. Returns the
        token budget left. `select` limits which requests are considered (checked as each
        comes up); requests already in `out` are skipped and never chosen as victims, so a
        policy may call this more than once per step (e.g. decodes first, then prompt chunks)."""
        earlier = {s.request_id for s in out} if out else ()  # given tokens by an earlier call this step
        grow = self.kv.grow
        bs = self.kv.block_size
        for req in self.running_order():
            if req.status is not _RUNNING:
                continue  # preempted earlier in this loop
            rid = req.request_id
            if rid in earlier:
                continue  # already given tokens
            if select is not None and not select(req):
                continue
            if budget <= 0:
                break
            start = req.num_computed_tokens
            prompt, out_ids = req.prompt_token_ids, req.output_token_ids
            total = len(prompt) + len(out_ids)
            seq = req.decode_seq
            if seq is not None and total - start == 1 and start % bs:
                # The steady decode (most requests, most steps): one token, and its position is
                # not the first of a block, so the block is already in the table and the KV
                # manager is not asked. The seq's table is the live list; a preemption, which
                # replaces the table, drops the seq.
                n, table = 1, seq.block_table
            else:
                n = min(total - start, budget)
                if chunk and chunk < n:
                    n = chunk
                if n <= 0:
                    continue
                table = grow(rid, start + n)
                while table is None:  # never preempt a request already in `out`
                    victim = self.pick_victim({s.request_id for s in out} | {rid}) or req
                    self.preempt(victim)
                    if victim is req:
                        break
                    table = grow(rid, start + n)
                if table is None:
                    continue  # preempted itself
            # build_seq, inlined (this loop runs for every running request every step)
            end = start + n
            p = len(prompt)
            if start >= p:  # decoding: last step's ScheduledSeq of this request, brought up to date
                toks = out_ids[start - p:end - p]
                if seq is None:
                    seq = req.decode_seq = ScheduledSeq(rid, toks, start, table, end == total, req.params,
                                                        len(out_ids))
                else:
                    seq.token_ids, seq.start_pos, seq.block_table = toks, start, table
                    seq.sample, seq.output_index = end == total, len(out_ids)
                out.append(seq)
            else:
                out.append(ScheduledSeq(rid, req.tokens_slice(start, end), start, table, end == total, req.params,
                                        len(out_ids)))
            budget -= n
        return budget

    def running_order(self) -> list[Request]:
        """`running` sorted by priority_order (stable: ties keep their running-set order).
        Sorted again only when `running` has changed since the last call; priority and
        arrival_time never change while a request runs. Read-only for the caller."""
        run = self.running
        if run != self._order_of:  # element identity (Request compares by identity): O(n) in C
            self._order = sorted(run, key=priority_order)
            self._order_of = run.copy()
        return self._order

    def prompt_blocks_owed(self) -> int:
        """Blocks the running requests still need to finish their prompts (chunked prefill)."""
        kv = self.kv
        return sum([kv.num_blocks_needed(r.request_id, r.num_tokens) for r in self.running])

    def admit(self, req: Request, n: int, now: float) -> ScheduledSeq | None:
        """Try to move the head-of-queue request into the running set with `n` tokens this step
        (after any cached prefix). None, with nothing changed, if its blocks don't fit."""
        if not self.kv.has(req.request_id):
            req.num_computed_tokens = self.kv.match_prefix(req)
            n = min(n, req.num_tokens - req.num_computed_tokens)
        if not self.kv.allocate(req.request_id, req.num_computed_tokens + n, req.max_num_tokens):
            self.kv.free(req.request_id)
            req.num_computed_tokens = 0
            return None
        self.waiting.remove(req.request_id)
        req.set_status(RequestStatus.RUNNING)
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
            self.waiting.metrics.on_wait(req.level, now - req.arrival_time)
        self.running.append(req)
        return self.make_seq(req, n)
