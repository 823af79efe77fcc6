"""Building one step's batch: the admission surface every policy is written against.

A policy decides who is considered and in what order; a `StepBuilder` decides what fits. It
holds the step's token budget and its list of `ScheduledSeq`s, and offers three moves:

    b = sched.builder(now)
    b.running(select=is_decoding)     # decodes: one token per running request whose prompt is done
    b.running(chunk=256)              # continue unfinished prompts, a chunk each
    b.admit(chunk=256, cover_prompts=True)   # then start waiting requests, in queue order
    return b.batch()

Each move spends the budget; `admit` also respects the seat cap (`max_num_seqs`) and the free
KV blocks, and `running` preempts the least important request when blocks run out. A stage
(`stage(budget)`) starts a fresh budget and seat count for policies that batch stages apart.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Iterable

from batchserve.core.batch import PadRow, ScheduledBatch, ScheduledSeq
from batchserve.core.latency import most_tokens
from batchserve.request import MAX_PRIORITY, Request, RequestStatus

if TYPE_CHECKING:
    from batchserve.core.scheduler import Scheduler

_RUNNING = RequestStatus.RUNNING
_MAX_HELD = 16  # queued requests admission may look past in one step (each costs a queue remove + push)
_MIN_CHUNK = 32  # prompt tokens a request may always add beside running equals that are short of time


def build_seq(req: Request, n: int, block_table: list[int]) -> ScheduledSeq:
    """The request's next `n` tokens, from its computed count on."""
    start = req.num_computed_tokens
    seq = ScheduledSeq(req.request_id, req.tokens_slice(start, start + n), start, block_table,
                       start + n == req.num_tokens, req.params, req.num_output_tokens, history(req))
    if req.prompt_logprobs is not None and start + 1 < len(req.prompt_token_ids):
        seq.prompt_targets = req.prompt_token_ids[start + 1:start + n + 1]
    return seq


def history(req: Request) -> tuple[list[int], list[int]] | None:
    """What a ScheduledSeq of `req` carries for the sampler's penalties (see ScheduledSeq)."""
    return (req.prompt_token_ids, req.output_token_ids) if req.params.penalized else None


def is_decoding(req: Request) -> bool:
    """The request's KV is complete but for its newest token: its next step is a decode."""
    c = req.num_computed_tokens  # (num_tokens spelled out: policies call this per request per step)
    return c > 0 and len(req.prompt_token_ids) + len(req.output_token_ids) - c == 1


class StepBuilder:
    """One step's batch under construction (see the module docstring). `seqs` is the batch so
    far, `budget` the tokens left in the current stage, `stage_seqs` the seqs added in it."""

    def __init__(self, sched: "Scheduler", now: float, budget: int) -> None:
        self.sched = sched
        self.now = now
        self.seqs: list[ScheduledSeq] = []
        self.budget = budget
        self.spent = 0
        self._stage_start = 0
        self._admitted: set[str] = set()  # admitted from the queue this step: never preempted in it
        # a tenant served less starts a request: who sits this step out (Scheduler.fair_yield)
        fair = sched.fair_yield(now) if sched.policy.preemptive else None
        self._favoured, self._skip, self._yielding = fair if fair is not None else (None, frozenset(), frozenset())
        self._chunk: int | None = None  # the prompt chunk the policy gave running requests
        # by priority: what hard deadlines admitted in this step afford (None: none admitted)
        self._joined: list[float] | None = None

    @property
    def stage_seqs(self) -> int:
        return len(self.seqs) - self._stage_start

    def stage(self, budget: int) -> None:
        """Start a new stage: `budget` tokens, its own count of seqs."""
        self.budget = budget
        self._stage_start = len(self.seqs)

    def batch(self, num_padding_tokens: int = 0, padding: list[PadRow] | None = None) -> ScheduledBatch:
        return ScheduledBatch(self.seqs, num_padding_tokens=num_padding_tokens, total_tokens=self.spent,
                              padding=padding or [])

    # --- running requests ------------------------------------------------------------------
    def running(self, chunk: int | None = None, select: Callable[[Request], bool] | None = None,
                max_seqs: int | None = None) -> None:
        """Give each running request its next tokens (1 for a decode, up to `chunk` for an
        unfinished prompt), most important first, preempting the least important when blocks
        run out. `select` limits which requests are considered (checked as each comes up);
        `max_seqs` caps this stage's seqs. Requests already in the batch are skipped and never
        chosen as victims, so a policy may call this more than once (decodes, then prompts)."""
        sched = self.sched
        out = self.seqs
        budget = self.budget
        earlier = {s.request_id for s in out} if out else ()  # given tokens by an earlier call this step
        if self._skip:  # and those sitting this step out for a tenant served less
            earlier = self._skip.union(earlier)
        if chunk is not None:
            self._chunk = chunk
        cap = None if max_seqs is None else self._stage_start + max_seqs
        grow = sched.kv.grow
        bs = sched.kv.block_size
        ceiling = sched.deadlines.decode_ceiling
        slowed = min(ceiling) < math.inf  # someone more important can afford only so long a step
        for req in sched.running_order():
            if req.status is not _RUNNING:
                continue  # preempted earlier in this loop
            rid = req.request_id
            if rid in earlier:
                continue  # already given tokens, or sits this step out
            if cap is not None and len(out) >= cap:
                continue
            if select is not None and not select(req):
                continue
            if budget <= 0:
                break
            start = req.num_computed_tokens
            prompt, out_ids = req.prompt_token_ids, req.output_token_ids
            total = len(prompt) + len(out_ids)
            seq = req.decode_seq
            if slowed and total - start == 1 and ceiling[req.priority] < math.inf and most_tokens(
                    sched.latency, 1, self.spent + self.budget - budget, len(out) + 1, ceiling[req.priority]) < 1:
                continue  # a decode that would make the step too slow for the more important: it sits out
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
                if n > 1:  # a prompt chunk: never slows the more important, nor a deadline due
                    later = max(0, len(sched.running) - len(out) - 1)  # running requests still to come, a token each
                    n = self._fit(req.priority, n, self.spent + self.budget - budget, later)
                if n <= 0:
                    continue
                table = grow(rid, start + n)
                if table is None and sched.reclaim(sched.kv.num_blocks_needed(rid, start + n), below=req):
                    table = grow(rid, start + n)  # preempted requests' kept blocks went first
                while table is None:  # never preempt a request already in `out`
                    victim = sched.pick_victim({s.request_id for s in out} | {rid}) or req
                    sched.preempt(victim)
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
                                                        len(out_ids), history(req))
                else:
                    seq.token_ids, seq.start_pos, seq.block_table = toks, start, table
                    seq.sample, seq.output_index = end == total, len(out_ids)
                out.append(seq)
            else:
                seq = ScheduledSeq(rid, req.tokens_slice(start, end), start, table, end == total, req.params,
                                   len(out_ids), history(req))
                if req.prompt_logprobs is not None and start + 1 < p:
                    seq.prompt_targets = prompt[start + 1:end + 1]
                out.append(seq)
            budget -= n
        self.spent += self.budget - budget
        self.budget = budget

    # --- admission from the queue ----------------------------------------------------------
    def admit(self, candidates: Iterable[Request] | None = None, *, chunk: int | None = None,
              whole_prompts: bool = False, max_seqs: int | None = None, cover_prompts: bool = False) -> None:
        """Start waiting requests — the queue's head first, or `candidates` in their order —
        while the budget, the seat cap (`max_num_seqs` running) and the KV blocks allow. A
        request that does not fit holds back every later one of its priority or below, so the
        order among them is kept, but not the more important behind it: one that outranks it (an
        aged low request at the head, a higher priority in a lower level, a step ceiling that
        only the important pass) is still tried. Each gets the rest of its prompt (after any
        cached prefix), cut to `chunk` and to the budget left. `whole_prompts`: a prompt that
        would fit a fresh step but not what is left waits for the next step rather than be
        cut (a step ceiling still cuts it). `max_seqs` caps this stage's seqs. `cover_prompts`:
        start a prompt only when the free blocks cover all of it beside what the prompts under
        way still owe (starting on the first chunk alone lets many long prompts start and then
        preempt each other). A copy of a prompt that another copy is computing waits for it
        (`Scheduler.awaits_copy`) and is looked past, like one of lower priority.
        Candidates must be waiting requests."""
        sched = self.sched
        kv = sched.kv
        cap = None if max_seqs is None else self._stage_start + max_seqs
        owed = [sum([kv.num_blocks_needed(r.request_id, r.num_tokens) for r in sched.running])
                if cover_prompts else 0]
        it = iter(candidates) if candidates is not None else None
        held: list[Request] = []  # taken out of the queue to look past them; put back below
        favoured, yielding = self._favoured, self._yielding
        floor = -1  # a request of this priority or below did not fit: only higher ones may pass
        try:
            while self.budget > 0 and (cap is None or len(self.seqs) < cap):
                req = sched.waiting.peek() if it is None else next(it, None)
                if req is None:
                    break
                if req.group is not None and sched.awaits_copy(req):
                    pass  # another copy is computing its prompt: look past it, holding back no one
                elif (yielding and req.tenant in yielding and req.level == favoured.level
                      and req.priority <= favoured.priority):
                    pass  # its tenant sits this step out: look past it, holding back no one
                elif req.priority > floor:
                    fit = self._admit_one(req, chunk, whole_prompts, cover_prompts, owed)
                    if fit is None:
                        break  # the budget is spent for everyone
                    if fit:
                        continue
                    floor = req.priority
                    if floor >= MAX_PRIORITY:
                        break
                if it is None:  # look past it: out of the queue until this admission is done
                    if len(held) >= _MAX_HELD:
                        break
                    held.append(req)
                    sched.waiting.remove(req.request_id)
        finally:
            for req in held:
                sched.waiting.push(req)
        skip = self._skip
        if favoured is not None and favoured.request_id not in self._admitted:  # it could not start: no one sits out
            self._skip = self._yielding = frozenset()
            if skip:
                self.running(chunk=self._chunk, select=lambda r: r.request_id in skip)

    def _admit_one(self, req: Request, chunk: int | None, whole_prompts: bool, cover_prompts: bool,
                   owed: list[int]) -> bool | None:
        """Start `req` if it fits (True); False when it does not, None when no request would
        (what is left of the budget is too small for the whole prompt `whole_prompts` asks)."""
        sched = self.sched
        cfg = sched.config
        kv = sched.kv
        forked = sched.forkable(req) if req.group is not None else 0  # a copy's prompt already computed
        n = req.num_tokens - req.num_computed_tokens - forked
        if whole_prompts and self.budget < n <= cfg.max_num_batched_tokens:
            return None
        n = min(n, self.budget) if chunk is None else min(chunk, self.budget, n)
        fit = self._fit(req.priority, n)
        if fit == 0:
            return False  # the step would outlast what a running request can afford
        n = fit
        if len(sched.running) >= cfg.max_num_seqs and not self._make_room(req, seat=True):
            return False
        if cover_prompts:
            need = owed[0] + kv.num_blocks_needed(req.request_id, req.num_tokens) - forked // kv.block_size
            while kv.num_free_blocks < need and not sched.reclaim(need, below=req):
                if not self._make_room(req):
                    break
            if kv.num_free_blocks < need:
                return False
        seq = sched.admit(req, n, self.now)
        # its blocks don't fit: kept blocks of preempted requests go first, then a victim's
        while seq is None and (sched.reclaim_one(below=req) or self._make_room(req)):
            seq = sched.admit(req, n, self.now)
        if seq is None:
            return False
        self._admitted.add(req.request_id)
        if req.hard_deadline:
            self._protect(req)
        self.seqs.append(seq)
        self.budget -= seq.num_tokens
        self.spent += seq.num_tokens
        if cover_prompts:
            owed[0] += kv.num_blocks_needed(req.request_id, req.num_tokens)
        return True

    def _fit(self, priority: int, n: int, spent: int | None = None, later: int = 0) -> int:
        """How many of `n` prompt tokens a request of `priority` may add to this step as one more
        seq: the most that keep the step's predicted time under the ceiling the running requests
        of higher priority set (core/deadlines.py), and under what running requests of its own
        priority can afford — but that second cut never below `_MIN_CHUNK` tokens, since equals
        share the steps; `n` when no ceiling applies, 0 when not even one token fits. `spent`:
        the step's tokens so far, if not yet in `self.spent`; `later`: seqs of a token each that
        will still join the step after this one."""
        dl = self.sched.deadlines
        hard, equal = dl.ceiling[priority], dl.equal_ceiling[priority]
        if self._joined is not None:
            hard = min(hard, self._joined[priority])
        if hard == math.inf and equal == math.inf:
            return n
        seqs = len(self.seqs) + 1 + later
        base = (self.spent if spent is None else spent) + later
        fit = self._most(n, base, seqs, min(hard, equal))
        if fit < n and equal < hard:
            fit = max(fit, self._most(min(n, _MIN_CHUNK), base, seqs, hard))
        return fit

    def _protect(self, req: Request) -> None:
        """`req`, with a hard deadline, starts in this step: the step ceilings (set before the
        step, from the running requests) do not know it yet, so the less important prompts that
        join after it are held to the step its deadline affords per token left."""
        left = req.max_tokens - req.num_output_tokens + 1
        afford = (req.deadline - self.now) / left  # type: ignore[operator]
        joined = self._joined or [math.inf] * (MAX_PRIORITY + 1)
        for p in range(req.priority):
            joined[p] = min(joined[p], afford)
        self._joined = joined

    def _most(self, n: int, base: int, seqs: int, limit: float) -> int:
        """The most of `n` tokens on top of `base` in a step of `seqs` predicted within `limit`."""
        return most_tokens(self.sched.latency, n, base, seqs, limit)

    def _make_room(self, req: Request, seat: bool = False) -> bool:
        """Preempt the running request that `req` outranks by the priority gap (see
        `Scheduler.priority_victim`), or else one whose tenant holds more than its share of the
        level's seats (`Scheduler.fair_victim`), taking it out of this step's batch if it was in it.
        `seat`: only a seat is short, so the victim keeps its KV blocks; otherwise blocks are
        short and it gives them up. False when there is no such request."""
        sched = self.sched
        if not sched.policy.preemptive:
            return False
        victim, reason = sched.priority_victim(req, self._admitted), "priority"
        if victim is None:
            victim, reason = sched.fair_victim(req, self.now, self._admitted), "fairness"
        if victim is None:
            return False
        rid = victim.request_id
        for i, s in enumerate(self.seqs):
            if s.request_id == rid:  # it had tokens this step: give them back
                del self.seqs[i]
                self.spent -= s.num_tokens
                if i >= self._stage_start:
                    self.budget += s.num_tokens
                else:
                    self._stage_start -= 1
                break
        sched.preempt(victim, keep_kv=seat, reason=reason)
        return True
