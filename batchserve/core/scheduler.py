"""The scheduler: owns the waiting queue, the running set, the KV bookkeeping and the latency
model, and is the only code that changes them.

    batch = scheduler.schedule(now)            # policy decides who runs, how many tokens each
    output = executor.execute(batch)
    changed = scheduler.update(batch, output, now)

Policies (core/policies/) decide only what differs between batching modes, and build their
batch through a `StepBuilder` (core/admission.py), the one implementation of "give running
requests their tokens, then admit from the queue within budget, seats and blocks". Deadline
rules (core/deadlines.py) return decisions that `apply` carries out. Time is always passed in.

Copies of one prompt (a `group`: the choices of n > 1, the candidates of best_of) prefill it
once. While one copy runs and has not yet computed the prompt's full blocks, the others wait
in the queue (`awaits_copy`: admission looks past them, so they hold back no one); once it has,
each is admitted as a fork of a copy that holds them (`KVCacheManager.fork`): those blocks are
shared, refcounted and read-only, and the copy computes only the rest of its prompt (at most
one block, the last, which is never shared) and its own tokens. So the token budget and
`num_computed_tokens` count only what each copy computes, every copy frees exactly its own
references (finish, abort, preemption), and a copy that ends early, the first included,
leaves the others their blocks. A copy with no running copy to wait for prefills as usual.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from batchserve.config import QueueConfig, SchedulerConfig
from batchserve.core.admission import StepBuilder, build_seq
from batchserve.core.batch import ScheduledBatch, ScheduledSeq, StepOutput
from batchserve.core.deadlines import Decision, DeadlineRules, Miss, length_status, sharing
from batchserve.core.kv_cache import KVCacheManager
from batchserve.core.latency import LatencyModel, OnlineLinearModel, ProfiledLatencyModel
from batchserve.core.queue import AdmissionQueue
from batchserve.request import OverloadedError, Request, RequestStatus

_RUNNING = RequestStatus.RUNNING

if TYPE_CHECKING:
    from batchserve.core.policies.base import Policy


def priority_order(req: Request) -> tuple[int, float]:
    """Sort key of the running set: higher priority first, then earlier arrival."""
    return (-req.priority, req.arrival_time)


class Scheduler:
    """Owns the waiting queue (`waiting`), the running set (`running`, admission order), every
    live request by id (`requests`), the KV block manager and the latency model. Callers change
    them only through its verbs: add / adopt / abort / hand_off / fail, then schedule(now) and
    update(batch, output, now) each step; finished requests come out of drain_finished().
    Policies read the state and build batches through `builder()`."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, policy: "Policy",
                 queue: QueueConfig | None = None, latency: LatencyModel | None = None) -> None:
        self.config = config
        self.kv = kv
        self.policy = policy
        self.waiting = AdmissionQueue(queue)
        self.latency: LatencyModel = latency or OnlineLinearModel()  # fed each step's time by update()
        # a profile tells a step of several prompts from one chunk: it is told how many a step had
        self._count_prompts = isinstance(self.latency, ProfiledLatencyModel)
        self.deadlines = DeadlineRules(config, self.latency, self.waiting.config)
        self.running: list[Request] = []
        self._order: list[Request] = []  # `running` sorted by priority_order (running_order())
        self._order_of: list[Request] = []  # the `running` that _order was sorted from
        self.requests: dict[str, Request] = {}
        self._finished: list[Request] = []  # finished since the last drain_finished()
        self._scheduled_at: float | None = None  # when the batch now running was scheduled
        self._paused_at: float | None = None  # the paused step's _scheduled_at while an interjection runs
        self.parked: dict[str, Request] = {}  # preempted, waiting, still holding their KV blocks (read-only)
        self.groups: dict[str, list[Request]] = {}  # copies of one prompt, live ones, by Request.group
        self.num_preemptions = 0
        self.num_steps = 0
        self.num_interjections = 0
        self.token_gaps: list[float] = []  # the last update's inter-token latencies, one per token

    # --- intake -----------------------------------------------------------------------
    def add(self, req: Request, now: float) -> None:
        """Admit a request through the queue. Raises OverloadedError when its level is full
        and refuses; a request that cannot make its hard deadline ends at once (`deadline`);
        a request dropped for this one ends as `rejected`. Ended ones show in the next step."""
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        copies = self.groups.get(req.group) if req.group is not None else None
        if copies and copies[0].prompt_token_ids != req.prompt_token_ids:
            raise ValueError(f"request {req.request_id!r}: the copies of group {req.group!r} must share one prompt")
        self.waiting.resolve(req)  # level defaults (deadline) first: admission checks use them
        self.requests[req.request_id] = req
        if req.group is not None:
            self.groups.setdefault(req.group, []).append(req)
        idle = not self.running and not len(self.waiting)
        miss = self.deadlines.at_admission(req, sharing(req, self.running), now, idle=idle)
        if miss is not None:
            self.apply(miss, now)
            return
        try:
            dropped = self.waiting.offer(req, now)
        except OverloadedError as e:
            del self.requests[req.request_id]
            self._leave_group(req)
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
        self.waiting.resolve(req)
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

    def fail(self, request_ids: list[str], error: str, now: float) -> None:
        """End each of these requests still here with finish reason "error" and `error`."""
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None and not req.finished:
                req.error = error
                self.finish(req, RequestStatus.FINISHED_ERROR, now)

    def hand_off(self, request_id: str, now: float) -> Request | None:
        """The request leaves this scheduler to carry on elsewhere (another engine decodes it,
        or the caller takes it back): out of every queue, blocks back to the pool, and no
        output for it here — it is not finished, only no longer this scheduler's."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        self._end(req, RequestStatus.HANDED_OFF, now)
        return req

    def finish(self, req: Request, status: RequestStatus, now: float) -> None:
        """Move a request to a final state, out of every queue, blocks back to the pool; its
        output comes out of the next drain_finished()."""
        if req.finished:
            return
        self._end(req, status, now)
        self._finished.append(req)

    def _end(self, req: Request, status: RequestStatus, now: float) -> None:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req.request_id)
        req.set_status(status)
        req.finish_time = now
        self.kv.free(req.request_id)
        self.parked.pop(req.request_id, None)
        self.requests.pop(req.request_id, None)
        self._leave_group(req)
        self.waiting.metrics.on_finish(req)

    def _leave_group(self, req: Request) -> None:
        members = self.groups.get(req.group) if req.group is not None else None
        if members is None:
            return
        if req in members:
            members.remove(req)
        if not members:
            del self.groups[req.group]

    # --- copies of one prompt (see the module docstring) ------------------------------------
    def shared_prompt(self, req: Request) -> int:
        """The prompt tokens `req` may share with the other copies of its group: its full
        blocks but for at least one token, which each copy computes for its own logits (0 for
        a request in no group, or one scoring its prompt, which computes every position)."""
        if req.group is None or req.prompt_logprobs is not None:
            return 0
        bs = self.kv.block_size
        return (len(req.prompt_token_ids) - 1) // bs * bs

    def _fork_source(self, req: Request, share: int) -> Request | None:
        """A copy of `req`'s group whose table holds the shared prompt computed (copies of a
        group have one prompt: `add` checks it)."""
        for m in self.groups.get(req.group, ()):
            if m is not req and m.num_computed_tokens >= share and self.kv.has(m.request_id):
                return m
        return None

    def forkable(self, req: Request) -> int:
        """The prompt tokens waiting `req` would take from another copy if admitted now (0: none;
        it has blocks of its own, or no copy holds the shared ones computed)."""
        if req.group is None or self.kv.has(req.request_id):
            return 0
        share = self.shared_prompt(req)
        return share if share and self._fork_source(req, share) is not None else 0

    def awaits_copy(self, req: Request) -> bool:
        """Whether waiting `req` should stay queued for now: another copy of its prompt runs
        and is still computing the shared blocks, and no copy holds them yet. Admission looks
        past such a request (it holds back no one) and tries it again next step."""
        if req.group is None or self.kv.has(req.request_id):
            return False
        share = self.shared_prompt(req)
        if not share or self._fork_source(req, share) is not None:
            return False
        return any(m is not req and m.status is _RUNNING for m in self.groups.get(req.group, ()))

    def apply(self, decision: Decision, now: float) -> None:
        """Carry out a deadline rule's decision."""
        req = decision.req
        if isinstance(decision, Miss):
            req.error = decision.error
            self.finish(req, RequestStatus.FINISHED_DEADLINE, now)
            return
        if decision.max_tokens is not None:
            if req.max_tokens == req.params.max_tokens:
                self.waiting.metrics.on_truncate()
            req.max_tokens = decision.max_tokens  # no `error`: a truncated reply is a success (HTTP 200)
        if decision.finish:
            self.finish(req, RequestStatus.FINISHED_TRUNCATED, now)

    @property
    def has_unfinished(self) -> bool:
        """Requests queued or running, or finished with their outputs not yet drained."""
        return bool(self.requests) or bool(self._finished)

    def drain_finished(self) -> list[Request]:
        out, self._finished = self._finished, []
        return out

    def release(self, finished: list[Request], now: float) -> list[Request]:
        """Which finished requests go back to the caller now (the policy may hold some, e.g.
        a static batch returns all its results together)."""
        return self.policy.release(self, finished, now)

    # --- one step ---------------------------------------------------------------------
    def schedule(self, now: float) -> ScheduledBatch:
        """The next step's batch (possibly empty), after the deadline rules have run."""
        self.check_deadlines(now)
        batch = self.policy.schedule(self, now)
        self.num_steps += 1
        self._scheduled_at = None if batch.empty else now
        return batch

    def interjection(self, now: float, in_flight: set[str] | frozenset[str]) -> ScheduledBatch:
        """A step to run at once, between two layers of the step in flight (whose requests are
        `in_flight`), or an empty batch. The one such step: the first of a tenant served less
        (`fair_yield`'s head, and the heads after it that qualify in turn), when every request
        in flight is one that may sit a step out for it or a decode of its own tenant's with no
        deadline (never another's prompt). Without it that request would wait for the step in flight to end, which, when that step carries
        the other tenants' prompts, takes as long as its own first step. Its whole prompt must
        fit one step and the free blocks (else no interjection); with every seat taken it takes
        the seat the next step would give it (`fair_victim`, among those that may sit out, is
        preempted keeping its blocks: the token it has in flight is dropped and computed again
        when it resumes). Nothing else in flight is touched and no deadline rule runs (the next
        schedule() does). Its update() charges this step's own time to the latency model, and
        the paused step's time, when it ends, leaves this one's out."""
        empty = ScheduledBatch()
        if not self.config.interject or self._scheduled_at is None or self._paused_at is not None:
            return empty  # nothing in flight, or an interjection already runs
        seqs: list[ScheduledSeq] = []
        budget = self.config.max_num_batched_tokens
        while self.policy.preemptive and (seq := self._interject_one(now, in_flight, budget)) is not None:
            seqs.append(seq)  # the next head, too, while it qualifies (such requests start together)
            budget -= seq.num_tokens
        if not seqs:
            return empty
        self.num_interjections += 1
        self.num_steps += 1
        self._paused_at, self._scheduled_at = self._scheduled_at, now
        return ScheduledBatch(seqs)

    def _interject_one(self, now: float, in_flight: set[str] | frozenset[str], budget: int) -> ScheduledSeq | None:
        """Admit the queue's head for an interjection (see there) within `budget` tokens, or None."""
        fair = self.fair_yield(now)
        if fair is None:
            return None
        head, skip, _ = fair
        may_wait = skip.union(r.request_id for r in self.running  # and its tenant's own decodes
                              if r.tenant == head.tenant and r.deadline_ms is None and r.output_token_ids)
        requests = self.requests
        if any(rid not in may_wait and rid in requests and requests[rid].status is _RUNNING for rid in in_flight):
            return None  # (one preempted or ended since the step began has no result to wait for)
        n = head.num_tokens - head.num_computed_tokens
        if (n > budget or self.awaits_copy(head)
                or self.kv.num_free_blocks < self.kv.num_blocks_needed(head.request_id, head.num_tokens)):
            return None
        if len(self.running) >= self.config.max_num_seqs:  # a seat, as the next step would free it
            victim = self.fair_victim(head, now, frozenset(r.request_id for r in self.running) - skip)
            if victim is None:
                return None
            self.preempt(victim, keep_kv=True, reason="fairness")  # its token in flight is dropped
        return self.admit(head, n, now)

    def update(self, batch: ScheduledBatch, output: StepOutput, now: float) -> list[Request]:
        """Apply a step's results at its end `now`: feed the latency model the step's time
        (from its schedule() call), advance counters, append sampled tokens, finish requests
        that hit EOS / a stop token / their length. Returns every request that changed."""
        if self._scheduled_at is not None:
            took = now - self._scheduled_at
            if self._count_prompts:
                prompts = sum(len(s.token_ids) > 1 for s in batch.seqs)
                self.latency.observe(batch.num_tokens, batch.num_seqs, took, prompts=prompts)
            else:
                self.latency.observe(batch.num_tokens, batch.num_seqs, took)
            self.deadlines.observe_step(took, now)
            self._scheduled_at = None
            if self._paused_at is not None:  # an interjection ended: the paused step goes on, its time less this
                self._scheduled_at, self._paused_at = self._paused_at + took, None
        changed: list[Request] = []
        gaps = self.token_gaps = []  # this step's inter-token latencies (StepRecord.token_gaps)
        requests, sampled = self.requests, output.sampled
        commit = self.kv.commit if self.kv.prefix_caching else None  # a no-op without prefix caching
        after_step = self.deadlines.after_step
        credit = self.waiting.credit if self.waiting.fair else None  # tenants' service, for fairness
        for seq in batch.seqs:
            rid = seq.request_id
            req = requests.get(rid)
            if req is None or req.status is not _RUNNING:
                continue  # aborted or finished while the step ran
            n = len(seq.token_ids)
            req.work_tokens += n
            if credit is not None:
                credit(req, n, now)
            if req.deadline_ms is not None:
                miss = after_step(req, now)
                if miss is not None:  # a result past a hard deadline is a failure
                    self.apply(miss, now)
                    continue
            if seq.prompt_targets:  # a prompt chunk's logprobs, by position (a recompute writes them again)
                req.prompt_logprobs[seq.start_pos + 1:seq.start_pos + 1 + len(seq.prompt_targets)] = \
                    output.prompt_logprobs[rid]
            req.num_computed_tokens += n
            if commit is not None:
                commit(req)
            if not seq.sample:
                continue
            tok = sampled[rid]
            out_ids = req.output_token_ids
            out_ids.append(tok)
            prev = req.last_token_time
            if prev is not None:
                gaps.append(now - prev)
            elif req.first_token_time is None:
                req.first_token_time = now
            req.last_token_time = now
            changed.append(req)
            if req.extras and self._extra_token(req, tok, output, now):
                continue
            p = req.params
            if (((not p.ignore_eos and tok == req.eos_token_id) or tok in p.stop_token_ids)
                    and len(out_ids) > p.min_tokens):  # (the sampler masks them before min_tokens)
                self.finish(req, RequestStatus.FINISHED_STOPPED, now)
            elif len(out_ids) >= req.max_tokens:
                self.finish(req, length_status(req), now)
        self.policy.on_update(self, batch, output, now)
        return changed

    def _extra_token(self, req: Request, tok: int, output: StepOutput, now: float) -> bool:
        """The rarer duties of a new token (`Request.extras`): keep its logprob, feed it to the
        request's grammar. True if that ended the request (its grammar is complete, or refused
        the token, which only a sampler ignoring the grammar's mask could make it do)."""
        if req.output_logprobs is not None:
            req.output_logprobs.append(output.logprobs[req.request_id])
        g = req.grammar
        if g is None:
            return False
        if not g.accept(tok):
            req.error = "the sampled token does not fit the answer's structured-output constraint"
            self.finish(req, RequestStatus.FINISHED_ERROR, now)
            return True
        if g.done:
            self.finish(req, RequestStatus.FINISHED_STOPPED, now)
            return True
        return False

    # --- deadlines (core/deadlines.py) ----------------------------------------------------
    def check_deadlines(self, now: float) -> None:
        """End queued and running hard-deadline requests that missed or cannot make their
        deadline; cut soft-deadline ones to what fits; promote to the urgent lane. Runs at the
        start of every schedule(now); policies may call it again."""
        for decision in self.deadlines.before_step(self.waiting, self.running, now):
            self.apply(decision, now)

    # --- helpers for policies ------------------------------------------------------------
    def builder(self, now: float, budget: int | None = None) -> StepBuilder:
        """A fresh batch for the step at `now`, with `budget` tokens (default: the step's
        max_num_batched_tokens)."""
        return StepBuilder(self, now, self.config.max_num_batched_tokens if budget is None else budget)

    def make_seq(self, req: Request, n: int) -> ScheduledSeq:
        return build_seq(req, n, self.kv.block_table(req.request_id))

    def pick_victim(self, exclude: set[str]) -> Request | None:
        """Preemption victim under memory pressure: lowest priority, then latest arrival."""
        cands = [r for r in self.running if r.request_id not in exclude]
        if not cands:
            return None
        return min(cands, key=lambda r: (r.priority, -r.arrival_time))

    def priority_victim(self, req: Request, exclude: set[str] | frozenset = frozenset()) -> Request | None:
        """The running request `req` may preempt for a seat or blocks: the least important one
        (lowest priority, then latest arrival) at least `preempt_gap` priorities below `req`
        and preempted for priority fewer than `max_preemptions` times. None: no such request
        (or preemption for priority is off)."""
        gap = self.config.preempt_gap
        if not gap:
            return None
        top = req.priority - gap
        order = self.running_order()
        for victim in reversed(order):  # least important first; stops at the first too important
            if victim.priority > top:
                return None
            if victim.num_priority_preemptions < self.config.max_preemptions \
                    and victim.request_id not in exclude and victim is not req and victim.status is _RUNNING:
                return victim
        return None

    def fair_victim(self, req: Request, now: float, exclude: set[str] | frozenset = frozenset()) -> Request | None:
        """The running request `req` may preempt so that the tenant served least goes first,
        for seats as in the queue: one of the same level and no higher priority, whose tenant's
        counter exceeds that of `req`'s tenant by more than the victim's own length (so the
        two cannot trade places back and forth), preempted fewer than `max_preemptions` times;
        of the tenant served most, its latest arrival. None when tenants are not in use."""
        if not self.waiting.fair or not self.config.preempt_gap:
            return None
        served, level, cap = self.waiting.tenant_service(now), req.level, self.config.max_preemptions
        mine = served.get((level, req.tenant), 0.0)
        best, best_key = None, None
        for r in self.running:
            if r.level != level or r.tenant == req.tenant or r.priority > req.priority:
                continue
            theirs = served.get((level, r.tenant), 0.0)
            if theirs - mine <= r.num_prompt_tokens + r.max_tokens or r.num_priority_preemptions >= cap \
                    or r.request_id in exclude or r.status is not _RUNNING:
                continue
            key = (theirs, r.arrival_time)
            if best_key is None or key > best_key:
                best, best_key = r, key
        return best

    def fair_yield(self, now: float) -> tuple[Request, frozenset[str], frozenset[str]] | None:
        """The step a tenant served less starts its request in: (the queue's head, the running
        requests that sit this step out, the tenants whose queued requests it looks past) or
        None. Those tenants are the head's level's whose counters exceed the head tenant's by
        more than the head request's own length; their running requests sit out when they are
        the head's equals with no deadline, in a level without a time-per-token target. Its
        first token then costs what it would alone, not a step shared with the backlog of those
        served more (one step's delay to them, at most once per such arrival); the order alone
        cannot give that, since a running request decodes every step and a queued prompt of
        theirs would start beside it."""
        if not self.waiting.fair:
            return None
        head = self.waiting.peek()
        if head is None or head.tenant is None or self.waiting.levels[head.level].tpot_ms is not None:
            return None
        level, served = head.level, self.waiting.served  # raw counters, all scaled alike
        f = self.waiting.decay(now)
        if f == 0.0:  # every counter has decayed away (none credited for hundreds of memories)
            return None
        length = (head.num_prompt_tokens + head.max_tokens) / f  # in raw units
        bar = served.get((level, head.tenant), 0.0) + length
        near = {r.tenant for r in self.running if r.level == level}  # tenants with work here, not all ever seen
        near.update(t for lv, t in self.waiting.queued_tenants() if lv == level)
        more = frozenset(t for t in near if t is not None and t != head.tenant and served.get((level, t), 0.0) > bar)
        if not more:
            return None
        skip = frozenset(r.request_id for r in self.running
                         if r.level == level and r.tenant in more and r.priority <= head.priority
                         and r.deadline_ms is None)
        return head, skip, more

    def preempt(self, req: Request, keep_kv: bool = False, reason: str = "memory") -> None:
        """Take a running request back to the waiting queue, where it keeps its place.
        `keep_kv`: it keeps its blocks and computed tokens and later resumes where it stopped
        (a seat was short, not memory; `reclaim` frees them if memory runs out meanwhile);
        otherwise its blocks are freed now and it recomputes them when it returns.
        `reason` ("memory" or "priority") is what the metrics count it under."""
        self.running.remove(req)
        recomputed = 0
        if not keep_kv:
            self.kv.free(req.request_id)
            req.decode_seq = None  # its block table is gone: a new one is built when it decodes again
            recomputed, req.num_computed_tokens = req.num_computed_tokens, 0
        req.set_status(RequestStatus.PREEMPTED)
        req.num_preemptions += 1
        if reason != "memory":
            req.num_priority_preemptions += 1
        self.num_preemptions += 1
        self.waiting.metrics.on_preempt(req.level, reason, recomputed)
        req.set_status(RequestStatus.WAITING)
        self.waiting.push(req)
        if keep_kv:
            self.parked[req.request_id] = req

    def reclaim(self, num_blocks: int, below: Request | None = None) -> bool:
        """Free the blocks of preempted requests that kept theirs (they will recompute),
        least important first and never one ranked above `below`, until `num_blocks` are free.
        Whether that many are free at the end."""
        while self.kv.num_free_blocks < num_blocks:
            if not self.reclaim_one(below):
                return False
        return True

    def reclaim_one(self, below: Request | None = None) -> bool:
        """Free the blocks of the least important preempted request that kept its own (not
        one ranked above `below`); False when there is none."""
        cands = [r for r in self.parked.values()
                 if below is None or (r is not below and priority_order(r) > priority_order(below))]
        if not cands:
            return False
        req = max(cands, key=priority_order)
        del self.parked[req.request_id]
        self.kv.free(req.request_id)
        req.decode_seq = None
        self.waiting.metrics.on_recompute(req.level, req.num_computed_tokens)
        req.num_computed_tokens = 0
        return True

    def running_order(self) -> list[Request]:
        """`running` sorted by priority_order (stable: ties keep their running-set order).
        Sorted again only when `running` has changed since the last call; priority and
        arrival_time never change while a request runs. Read-only for the caller."""
        run = self.running
        if run != self._order_of:  # element identity (Request compares by identity): O(n) in C
            self._order = sorted(run, key=priority_order)
            self._order_of = run.copy()
        return self._order

    def admit(self, req: Request, n: int, now: float) -> ScheduledSeq | None:
        """Try to move the head-of-queue request into the running set with `n` tokens this step
        (after any cached prefix). None, with nothing changed, if its blocks don't fit."""
        fresh = not self.kv.has(req.request_id)  # else preempted with its blocks kept: it resumes
        if fresh:
            share = self.shared_prompt(req)
            src = self._fork_source(req, share) if share else None
            if src is not None:  # a copy of a prompt another copy computed: share its blocks
                req.num_computed_tokens = self.kv.fork(src.request_id, req.request_id, share)
            else:  # (a request scoring its prompt computes every position: no cached prefix)
                req.num_computed_tokens = self.kv.match_prefix(req) if req.prompt_logprobs is None else 0
            n = min(n, req.num_tokens - req.num_computed_tokens)
        if not self.kv.allocate(req.request_id, req.num_computed_tokens + n, req.max_num_tokens):
            if fresh:
                self.kv.free(req.request_id)
                req.num_computed_tokens = 0
            return None
        self.parked.pop(req.request_id, None)
        self.waiting.remove(req.request_id)
        req.set_status(RequestStatus.RUNNING)
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
            self.waiting.metrics.on_wait(req.level, now - req.arrival_time)
        self.running.append(req)
        return self.make_seq(req, n)
