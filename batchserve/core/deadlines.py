"""Deadline rules: what to do with a request whose deadline is near or gone. They decide; the
scheduler applies (`Scheduler.apply`), so no rule edits a queue, the running set or the KV pool.

Hard: a request ends with finish reason `deadline` as soon as it has missed its deadline or
the latency model predicts it cannot make it (now + predicted service >= deadline), whether
it is queued or running; its blocks are freed at once, and it is never scheduled after its
deadline. A step that ends past the deadline does not count: the request fails there.
Soft: a running request's effective `max_tokens` is planned each step from its predicted
finish, one step early — a step as slow as the slowest of the last few measured, since a
prompt joining a step makes it several decodes long — so the shortened answer arrives by the
deadline with finish reason
`deadline_truncated`. A soft request whose deadline passes before it has a token ends with
finish reason `deadline` (an error saying so), never with silence; one that has tokens (it was
preempted after its first) ends with them, `deadline_truncated`, when its deadline passes in the
queue. Seats are shared among soft deadlines: when every seat is taken and the queue's head is
a soft-deadline request that would start too late for `soft_share_tokens` tokens by its
deadline (its prompt counted in the chunks the step ceiling of its priority lets in, since a
long prompt behind more important requests takes many steps to its first token; and no seat
frees in time by itself), the running soft-deadline request of no higher
priority with the most tokens (at least `soft_share_tokens`) ends now, shortened, and the head
takes its seat: under overload two shortened answers arrive on time instead of one long answer
and one error. This is the soft deadline's own contract (a shorter answer, on time) applied to
the requests that share the seats.

Predictions come from the latency model; before it is fitted, the recent measured step
(`recent_step`) stands in for every step. A running request with two or more tokens out is
also judged by its own measured time per token, whichever predicts later: under load the
steps it shares carry other requests' prompt tokens, which a decode-only prediction leaves
out, and its own rate says so after a few tokens, not at the end. For a hard deadline that
rate counts only after several tokens, and no faster than the fastest of the latest steps: its
first intervals carry the prompts that joined with it, a burst of prompts that has passed
overstates the rest, and an ended request cannot be taken back. Instead a hard-deadline
request's prediction looks ahead: it adds the queued prompts that will join its steps before it
ends (all of higher priority; of its own, as many as seats turn over meanwhile), so that it is
ended before those slow steps, not after they have shown in its rate.

Step ceilings protect requests that are running from those that join. A running request with
a hard deadline can afford steps of (time left) / (tokens left); of the slack between that and
its own predicted step it lends a quarter to those joining (the rest absorbs misprediction), and
when its prediction with every joiner says it would miss but its own steps and what outranks it
would make it, it lends nothing: it is protected before it is ended. A running request whose
level has a `tpot_ms` target can afford steps of that length. `ceiling[p]` is the least of
these over running requests of priority above p, and admission keeps each step's predicted time
under the ceiling of the joining request's priority, cutting a prompt to what fits rather than
holding it back whole: the important are never slowed by the less important joining them,
nor by the less important already running: a running decode of priority p joins a step only
while its predicted time stays under `decode_ceiling[p]` (the ceiling set by the priorities
above p), and sits the step out otherwise, keeping its seat and blocks. So a hard-deadline
request's service is predicted beside the running requests of its priority and above only:
a full running set of less important decodes does not make it miss.
Equals share the steps (holding back an equal would trade its first token for the other's
last): `equal_ceiling[p]`, what running requests of priority p can afford, cuts an equal's
prompt chunk but never below a minimum chunk. What they can afford an equal is larger than what
they lend the less important: their own step plus a quarter of their whole slack (deadline, less
now, less their predicted service with the queued prompts), not of their slack per token. An
equal's prompt slows one step, once, and its first token counts as much as their last: cut to
the per-token share, a prompt of a few hundred tokens takes many steps to its first token.
One bound holds for equals too: no request joins a step predicted to end past the deadline of a
running request of its priority or above, since that step would carry the other's last token late.

Predictions assume a request runs to its max_tokens, and they are 0.0 until the latency
model has seen enough steps or one step has been measured, so until then only deadlines
actually passed end requests.
All times are passed in.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Iterator, Sequence

from batchserve.config import QueueConfig, SchedulerConfig
from batchserve.core.latency import LatencyModel, most_tokens, service_time, tokens_within
from batchserve.core.queue import AdmissionQueue
from batchserve.request import MAX_PRIORITY, Request, RequestStatus

_EWMA = 0.2  # weight of the newest step in the recent-step averages
_NO_CEILING = [math.inf] * (MAX_PRIORITY + 1)
_RECENT = 8  # measured steps a soft deadline's plan looks back on (it plans for the slowest)
_OWN_MIN = 8  # token intervals before a request's own rate may end it for a hard deadline
_LATEST = 3  # latest measured steps that must be as slow as that rate for it to count in full
_SLACK_SHARE = 0.25  # of a hard deadline's slack per step, what less important joiners may take
_STALE_S = 30.0  # an idle engine's step measurements older than this may not refuse a request


@dataclass(frozen=True)
class Miss:
    """End `req` as a missed hard deadline, with `error` saying why."""

    req: Request
    error: str


@dataclass(frozen=True)
class Truncate:
    """Lower a soft-deadline request's effective max_tokens to `max_tokens` (None: keep it);
    `finish`: it already has them, so it ends now."""

    req: Request
    max_tokens: int | None
    finish: bool


Decision = Miss | Truncate


def at_or_above(running: Sequence[Request]) -> list[int]:
    """By priority p: how many of `running` have priority p or above."""
    counts = [0] * (MAX_PRIORITY + 2)
    for r in running:
        counts[r.priority] += 1
    for p in range(MAX_PRIORITY - 1, -1, -1):
        counts[p] += counts[p + 1]
    return counts


def sharing(req: Request, running: Sequence[Request], above: list[int] | None = None) -> int:
    """How many running requests `req`'s steps are predicted with: all of them, or for a hard
    deadline those of its priority and above, since the less important sit out the steps that
    would be too slow for it (`decode_ceiling`). `above`: `at_or_above(running)`, when the
    caller asks for many requests."""
    if not req.hard_deadline:
        return len(running)
    return (above if above is not None else at_or_above(running))[req.priority]


def _miss(req: Request, now: float, predicted: float) -> Miss:
    assert req.deadline is not None
    if not req.hard_deadline:
        return Miss(req, f"soft deadline of {req.deadline_ms:g} ms passed before a first token "
                         f"({1000 * (now - req.arrival_time):.0f} ms since arrival)")
    if now >= req.deadline:
        return Miss(req, f"hard deadline of {req.deadline_ms:g} ms missed "
                         f"({1000 * (now - req.arrival_time):.0f} ms since arrival)")
    return Miss(req, f"cannot finish within its hard deadline of {req.deadline_ms:g} ms: "
                     f"{1000 * predicted:.0f} ms predicted, {1000 * (req.deadline - now):.0f} ms left")


class DeadlineRules:
    """The deadline decisions of one scheduler, from its latency model and config.

    `prediction_floor` is the lowest step prediction the queue's deadline look-at times rest
    on (see `_watch_predictions`)."""

    def __init__(self, config: SchedulerConfig, latency: LatencyModel, queue: QueueConfig | None = None) -> None:
        self.config = config
        self.latency = latency
        self.prediction_floor = 0.0
        self.recent_step = 0.0  # seconds, an exponential average of the measured steps
        self.recent_steps: deque[float] = deque(maxlen=_RECENT)  # the last measured steps
        self.last_step_at: float | None = None  # when the newest measured step ended
        self._steps = _WithFallback(latency, self)
        self._tpot = {lv.name: lv.tpot_ms / 1000 for lv in (queue or QueueConfig()).levels if lv.tpot_ms}
        self.ceiling: list[float] = _NO_CEILING  # by priority: the longest step a joining request may make
        # by priority: the longest step a running request's decode may make (what those above can afford)
        self.decode_ceiling: list[float] = _NO_CEILING
        # by priority: the step the running requests of that priority can afford; a joining
        # equal's prompt is cut to it, down to a minimum chunk (it is never held back)
        self.equal_ceiling: list[float] = _NO_CEILING

    def observe_step(self, seconds: float, now: float | None = None) -> None:
        """A step of the running batch took `seconds`, ending at `now`."""
        r = self.recent_step
        self.recent_step = seconds if r == 0.0 else r + _EWMA * (seconds - r)
        self.recent_steps.append(seconds)
        if now is not None:
            self.last_step_at = now

    def forget_steps(self) -> None:
        """Drop the recent-step average (the steps seen were not representative)."""
        self.recent_step = 0.0
        self.recent_steps.clear()

    @staticmethod
    def own_step(req: Request, now: float, min_intervals: int = 1) -> float:
        """The request's measured seconds per output token so far; 0.0 until it has
        `min_intervals` intervals between tokens (one: its second token)."""
        n, t = req.num_output_tokens, req.first_token_time
        return (now - t) / (n - 1) if n > min_intervals and t is not None else 0.0

    def service(self, req: Request, num_running: int, joining: bool = False, now: float | None = None,
                ahead: float = 0.0) -> float:
        """Seconds `req` still needs if it ran from now beside `num_running` others (plus
        itself, when `joining` from the queue), to its max_tokens, plus `ahead` seconds that
        others' prompts will add; with `now`, no less than its own time per token so far
        predicts — for a hard deadline only once that rate rests on `_OWN_MIN` intervals and
        no faster than the latest steps, since ending a request is final."""
        cfg = self.config
        batch = min(cfg.max_num_seqs, num_running + (1 if joining else 0))
        left = req.max_tokens - req.num_output_tokens
        s = service_time(self._steps, req.num_tokens - req.num_computed_tokens, left, batch,
                         cfg.max_num_batched_tokens) + ahead
        if now is None:
            return s
        if not req.hard_deadline:
            return max(s, left * self.own_step(req, now))
        # ending is final: the past rate counts only as far as the latest steps are as slow,
        # so that a burst of prompts that has passed does not end a request now running fast
        return max(s, left * min(self.own_step(req, now, _OWN_MIN), self._latest_fastest()))

    def _latest_fastest(self) -> float:
        """The fastest of the last `_LATEST` measured steps (inf before any)."""
        steps = self.recent_steps
        k = min(_LATEST, len(steps))
        return min(steps[i] for i in range(-k, 0)) if k else math.inf

    def _joining(self, req: Request, waiting: AdmissionQueue, batch: int) -> tuple[float, float]:
        """Seconds that queued prompts add to running `req`'s steps as they join before it ends:
        (those of a higher priority: every one, since it takes a seat at once, preempting if it
        must; those of its own priority: as many as seats turn over meanwhile, about
        `left / max_tokens` of a running set for answers as long as its own), in chunks of the
        step's token budget."""
        cfg = self.config
        up_tokens, up_n = waiting.prompt_work_from(req.priority + 1) if req.priority < MAX_PRIORITY else (0, 0)
        eq_tokens, eq_n = waiting.prompt_work_from(req.priority)
        eq_tokens, eq_n = eq_tokens - up_tokens, eq_n - up_n
        turnover = max(1, cfg.max_num_seqs * (req.max_tokens - req.num_output_tokens) // max(1, req.max_tokens))
        if eq_n > turnover:
            eq_tokens = eq_tokens * turnover // eq_n
        if up_tokens + eq_tokens <= 0:
            return 0.0, 0.0
        chunk = min(up_tokens + eq_tokens, cfg.max_num_batched_tokens)
        m = self._steps
        per_token = max(0.0, m.predict_step(batch + chunk, batch) - m.predict_step(batch, batch)) / chunk
        return up_tokens * per_token, eq_tokens * per_token

    def at_admission(self, req: Request, num_running: int, now: float, idle: bool = False) -> Miss | None:
        """A new hard-deadline request that cannot make it. On an `idle` engine whose newest
        measured step is older than `_STALE_S`, a refusal is not trusted: the measurements are
        forgotten and the request is judged again, so admitted, and its steps measure anew.
        Without this a server whose steps were slow once (a busy machine at warm-up) would
        refuse every hard deadline for good, since a refused request runs no step to correct it."""
        if not req.hard_deadline:
            return None
        s = self.service(req, num_running, joining=True)
        if now + s < req.deadline:
            return None
        if idle and self.last_step_at is not None and now - self.last_step_at > _STALE_S \
                and hasattr(self.latency, "clear"):
            self.latency.clear()
            self.forget_steps()
            self.last_step_at = None
            return self.at_admission(req, num_running, now)
        return _miss(req, now, s)

    def before_step(self, waiting: AdmissionQueue, running: list[Request], now: float) -> Iterator[Decision]:
        """Queued and running hard-deadline requests that cannot make it; soft-deadline running
        requests cut to what fits. A generator: each decision is applied before the next is
        made, so later predictions see the running set the earlier ones left."""
        self._watch_predictions(waiting, len(running))
        # at_or_above(running), counted when a hard deadline first asks, and again after the
        # decisions applied meanwhile have taken requests out of `running` (they only take out)
        above: list[int] = []
        counted = -1

        def share(r: Request) -> int:
            nonlocal above, counted
            if r.hard_deadline and counted != len(running):
                above, counted = at_or_above(running), len(running)
            return sharing(r, running, above)

        for req in waiting.refresh(now, lambda r: self.service(r, share(r), joining=True)):
            if not req.hard_deadline and req.num_output_tokens:  # preempted after its first token
                yield Truncate(req, req.num_output_tokens, True)
            else:
                yield _miss(req, now, self.service(req, len(running), joining=True))
        limits: list[float] | None = None  # by priority: the step those running can afford
        equals: list[float] | None = None  # by priority: the step an equal joining them may make
        last: list[float] | None = None  # by priority: time left to the nearest running deadline
        tpot = self._tpot
        for req in [r for r in running if r.deadline_ms is not None or r.level in tpot] if tpot else \
                [r for r in running if r.deadline_ms is not None]:
            lim = tpot.get(req.level, math.inf)  # type: ignore[arg-type]
            eq_lim = lim
            if req.deadline_ms is not None:
                hard = req.hard_deadline
                n = share(req)
                up, eq = self._joining(req, waiting, n) if hard else (0.0, 0.0)
                s = self.service(req, n, now=now, ahead=up + eq)
                if hard:
                    own = self._steps.predict_step(n, n)
                    if now + s < req.deadline:
                        afford = (req.deadline - now) / (req.max_tokens - req.num_output_tokens + 1)
                        lim = min(lim, own + _SLACK_SHARE * max(0.0, afford - own))
                        eq_lim = min(eq_lim, own + _SLACK_SHARE * (req.deadline - now - s))
                    elif now + self.service(req, n, ahead=up) < req.deadline:
                        # the model's own steps plus what outranks it make it (its measured
                        # rate left out): protected, nothing less important joins and equals
                        # join in minimum chunks
                        lim = eq_lim = min(lim, own)
                    else:
                        yield _miss(req, now, s)
                        continue
                elif now + s + self._step(req, len(running), now) > req.deadline:
                    decision = self._truncate(req, len(running), now)
                    yield decision
                    if isinstance(decision, Miss) or decision.finish:
                        continue
                if last is None:
                    last = [math.inf] * (MAX_PRIORITY + 1)
                last[req.priority] = min(last[req.priority], req.deadline - now)  # type: ignore[operator]
            if lim < math.inf:
                if limits is None:
                    limits = [math.inf] * (MAX_PRIORITY + 1)
                limits[req.priority] = min(limits[req.priority], lim)
            if eq_lim < math.inf:
                if equals is None:
                    equals = [math.inf] * (MAX_PRIORITY + 1)
                equals[req.priority] = min(equals[req.priority], eq_lim)
        yield from self._share_seat(waiting, running, now)
        self.equal_ceiling = equals or _NO_CEILING
        if limits is None and last is None:
            self.ceiling = self.decode_ceiling = _NO_CEILING
        else:
            limits = limits or _NO_CEILING
            last = last or _NO_CEILING
            ceiling = [math.inf] * (MAX_PRIORITY + 1)
            below = [math.inf] * (MAX_PRIORITY + 1)
            ceiling[MAX_PRIORITY] = last[MAX_PRIORITY]
            for p in range(MAX_PRIORITY - 1, -1, -1):  # joining at p: the limits of priorities above p
                below[p] = min(ceiling[p + 1], limits[p + 1])
                ceiling[p] = min(below[p], last[p])
            self.ceiling, self.decode_ceiling = ceiling, below

    def _share_seat(self, waiting: AdmissionQueue, running: list[Request], now: float) -> Iterator[Decision]:
        """At most one running soft-deadline answer ended, shortened, for the seat of the
        queue's head (the module docstring): only when every seat is taken, the head is a
        soft-deadline request with no token yet whose latest useful start (its deadline, less
        its first token and `soft_share_tokens` decode steps) is within two steps, it can
        still have a token in time, and no running request ends before that start anyway."""
        cfg = self.config
        keep, n = cfg.soft_share_tokens, len(running)
        if not keep or n < cfg.max_num_seqs:
            return
        head = waiting.peek()
        if head is None or head.deadline is None or head.hard_deadline or head.num_output_tokens:
            return
        step = self._steps.predict_step(n, n)
        if step <= 0:
            return
        first = self._first_token(head, n)
        latest = head.deadline - first - keep * step
        if now + 2 * step < latest or now + first + step >= head.deadline:
            return  # not yet (another look next step), or too late for even one token
        if now + step * min(r.max_tokens - r.num_output_tokens for r in running) <= latest:
            return  # a seat frees in time by itself
        victims = [r for r in running if r.deadline is not None and not r.hard_deadline
                   and r.priority <= head.priority and r.num_output_tokens >= keep]
        if victims:
            v = max(victims, key=lambda r: (r.num_output_tokens, -r.arrival_time))
            yield Truncate(v, v.num_output_tokens, True)

    def _first_token(self, req: Request, num_running: int) -> float:
        """Predicted seconds to the first token of queued `req` if it started now: its prompt
        in one step, or, when the step ceiling its priority meets (set by the last look at the
        running requests) cuts it, in as many steps as it takes chunks of what one step within
        the ceiling holds beside the running decodes (inf: not one token of it fits)."""
        left = req.num_tokens - req.num_computed_tokens
        plain = service_time(self._steps, left, 1, num_running, self.config.max_num_batched_tokens)
        limit = self.ceiling[req.priority]
        if limit == math.inf or left <= 1:
            return plain
        seqs = num_running + 1
        chunk = most_tokens(self._steps, left, num_running, seqs, limit)
        if chunk == 0:
            return math.inf
        if chunk >= left:
            return plain
        return max(plain, math.ceil(left / chunk) * self._steps.predict_step(num_running + chunk, seqs))

    def after_step(self, req: Request, end: float) -> Miss | None:
        """A hard-deadline request whose step ended after its deadline: its result is too late."""
        if req.hard_deadline and end > req.deadline:  # type: ignore[operator]
            return _miss(req, end, 0.0)
        return None

    def _watch_predictions(self, waiting: AdmissionQueue, num_running: int) -> None:
        """The queue looks at each deadline again at a time computed from the prediction of
        then; when predictions have grown by a quarter since the lowest one in use (the model
        became ready, or steps got slower), those times may be late, so look at all again.
        With no deadline in the queue there is nothing to look at again: no prediction is made
        (it would refit the latency model every step for nothing). The floor kept from before only
        makes the first look after new deadlines arrive a full one, which is safe."""
        if not waiting.has_deadline_checks:
            return
        b = min(self.config.max_num_seqs, num_running + 1)
        probe = self.latency.predict_step(b, b)
        low = self.prediction_floor
        if probe > 1.25 * low:
            waiting.recheck_all()
            self.prediction_floor = probe
        else:
            self.prediction_floor = min(low, probe)

    def _step(self, req: Request, num_running: int, now: float) -> float:
        """The seconds of one of the running request's next steps, planned for the slowest
        that is likely: the model's decode step, its own rate so far, or the slowest of the
        last measured steps (a prompt joining a step makes it several decodes long)."""
        recent = max(self.recent_steps) if self.recent_steps else 0.0
        return max(self._steps.predict_step(num_running, num_running), self.own_step(req, now), recent)

    def _truncate(self, req: Request, num_running: int, now: float) -> Decision:
        """The tokens that fit before the deadline, planned to end a step early (at least one
        in all); a request whose deadline has passed with no token yet is a miss."""
        assert req.deadline is not None
        if now >= req.deadline and req.num_output_tokens == 0:
            return _miss(req, now, 0.0)
        step = self._step(req, num_running, now)
        if req.num_output_tokens:
            fit = int((req.deadline - now - step) // step) if step > 0 else None
        else:
            fit = tokens_within(self._steps, req.deadline - now - step, req.num_tokens - req.num_computed_tokens,
                                num_running, self.config.max_num_batched_tokens)
        if fit is None:
            return Truncate(req, None, False)
        fit = max(0, fit)
        cap = max(1, req.num_output_tokens + fit)
        new = cap if cap < req.max_tokens else None
        return Truncate(req, new, req.num_output_tokens >= (req.max_tokens if new is None else new))


class _WithFallback:
    """The latency model as the deadline rules see it: its predictions, or the recent measured
    step while it predicts nothing (not fitted yet)."""

    def __init__(self, model: LatencyModel, rules: DeadlineRules) -> None:
        self.model, self.rules = model, rules

    def predict_step(self, num_tokens: int, num_seqs: int) -> float:
        p = self.model.predict_step(num_tokens, num_seqs)
        return p if p > 0 else self.rules.recent_step

    def observe(self, num_tokens: int, num_seqs: int, seconds: float) -> None:
        self.model.observe(num_tokens, num_seqs, seconds)


def length_status(req: Request) -> RequestStatus:
    """The finish status of a request that reached its effective max_tokens."""
    return RequestStatus.FINISHED_TRUNCATED if req.max_tokens < req.params.max_tokens \
        else RequestStatus.FINISHED_LENGTH
