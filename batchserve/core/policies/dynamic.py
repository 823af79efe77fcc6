"""`dynamic`: request-level batches like `static`, launched and sized by a controller.

While no batch runs, every step asks `controllers.offer_order` and `controllers.plan_batch`
(the module's docstring states the control law) which of the waiting requests are offered a
place, whether to launch now, and with how many of them (`controllers.batch_cap`), from:
- the arrival gap (an EWMA of gaps; a silence longer than it counts as the gap), and the
  long-run one (the mean over the last LONG_S seconds);
- predicted batch times, from the scheduler's step-time model (fitted on measured steps, or a
  `batchserve profile`), the waiting prompts, and the output lengths expected of b members
  (their max_tokens and recent output lengths; a newcomer's, the longest recent one), scaled
  by how measured batches compared with their prediction at the outputs each had (how long
  outputs run is the lengths' part, not the model's);
- the targets the user set (`slo_ttft_ms`, `slo_tpot_ms`, `slo_p99_ms` end to end) and each
  request's own deadline. None is assumed when unset;
- each waiting request's max_tokens, the bound on its output, and its expected output length
  (with recent outputs), at which its own time per token and first token are judged; where
  the waiting share one max_tokens and recent outputs ended before it (at EOS), so that no
  length is known ahead, a TPOT target alone sizes the batch over the recent outputs as a
  distribution (`controllers.LengthLaw`): the chance that it holds a long one.
The cap is `max_batch`, and the profile's throughput knee when one is given. `window_max_ms`
bounds how long a request waits for company.

`bucket_by_length`: the batch is filled with the requests closest in (prompt, output) length
bucket to the first one offered, which cuts padding (sequence-level batching).
"""
from __future__ import annotations

import math
from collections import deque
from itertools import accumulate, islice
from typing import TYPE_CHECKING, Callable, Iterable

from batchserve.config import SchedulerConfig
from batchserve.core.controllers import (BatchTimes, LengthLaw, Plan, SortedWindow, Targets, arrival_gap, batch_cap,
                                         batch_times, bucket_distance, decode_time, ewma, expected_lengths,
                                         hopeless_last, is_overdue, length_bucket, offer_order, plan_batch)
from batchserve.core.latency import LatencyModel, ProfiledLatencyModel
from batchserve.core.policies.request_level import RequestLevelPolicy
from batchserve.request import Request, RequestStatus

if TYPE_CHECKING:
    from batchserve.core.scheduler import Scheduler

GAP_ALPHA = 0.2  # weight of the newest arrival gap
FIT_ALPHA = 0.3  # weight of the newest batch's measured / predicted time
LONG_S = 30.0  # the window of the long-run arrival rate


def _ms(x: float | None) -> float | None:
    return None if x is None else x / 1000.0


class DynamicPolicy(RequestLevelPolicy):
    name = "dynamic"

    def __init__(self, config: SchedulerConfig | None = None, latency: LatencyModel | None = None) -> None:
        """`latency`: the engine's step-time model; a profiled one (`batchserve profile`) also
        caps the batch at its throughput knee."""
        super().__init__(config)
        cfg = self.config
        self.cap_max = cfg.max_batch
        if isinstance(latency, ProfiledLatencyModel) and latency.knee_batch:
            self.cap_max = max(1, min(self.cap_max, latency.knee_batch))
        self.max_batch = self.cap_max
        self.window_ms = 0.0
        self.targets = Targets(_ms(cfg.slo_ttft_ms), _ms(cfg.slo_tpot_ms), _ms(cfg.slo_p99_ms), cfg.overdue_factor)
        self.mean_gap_s: float | None = None
        self.last_arrival: float | None = None
        self.first_arrival: float | None = None
        self.recent: deque[float] = deque()  # arrival times of the last LONG_S seconds
        self.outputs = SortedWindow()  # output lengths of recent finished members (cut at max_tokens: inf)
        self.longest = SortedWindow()  # output lengths of recent finished members as they ran (for their longest)
        self.fit = 1.0  # measured / predicted batch time, smoothed
        self.plan: Plan | None = None
        self.offered: list[Request] | None = None  # the plan's order of the waiting, where not the queue's
        self._first: float | None = None  # the running batch's predicted F, before `fit`
        self._step: Callable[[int, int], float] = lambda tokens, seqs: 0.0  # its step times, before `fit`

    def on_add(self, sched: "Scheduler", req: Request, now: float) -> None:
        if self.last_arrival is not None:
            self.mean_gap_s = ewma(self.mean_gap_s, max(0.0, now - self.last_arrival), GAP_ALPHA)
        self.last_arrival = now
        if self.first_arrival is None:
            self.first_arrival = now
        self.recent.append(now)

    def _long_gap(self, now: float) -> float:
        """Seconds per arrival over the last LONG_S seconds (since the first arrival, if sooner)."""
        while self.recent and self.recent[0] < now - LONG_S:
            self.recent.popleft()
        if len(self.recent) < 2:  # first_arrival is set once anything arrived
            return math.inf
        return min(LONG_S, now - self.first_arrival) / len(self.recent)

    def update_controls(self, sched: "Scheduler", now: float) -> None:
        self.plan, self.offered = None, None
        if self.members or not len(sched.waiting):
            return
        cap = min(self.cap_max, sched.config.max_num_seqs)
        head = list(islice(iter(sched.waiting), cap))
        waits = [now - r.arrival_time for r in head]
        e2e = [_e2e(r, self.targets.e2e) for r in head]
        prompt = sum(r.num_prompt_tokens for r in head) / len(head)
        budget, fit, outs = sched.config.max_num_batched_tokens, self.fit, self.outputs.values
        steps: dict[tuple[int, int], float] = {}
        latency = sched.latency
        profiled = isinstance(latency, ProfiledLatencyModel)

        def step(tokens: int, seqs: int) -> float:
            if (tokens, seqs) not in steps:
                steps[tokens, seqs] = latency.predict_step(tokens, seqs)
            return steps[tokens, seqs]

        def whole(tokens: int, rows: int) -> float:
            """A step of `rows` whole prompts, as a profile reads it (not one chunk and decodes)."""
            return latency.predict_step(tokens, rows, prompts=rows)

        def fitted(b: int, lengths: list[int], prompt_len: float = prompt) -> BatchTimes:
            """F, D, B of b members with these output lengths and mean prompt, scaled by the fit."""
            t = batch_times(step, b, prompt_len, lengths, budget, whole if profiled else None)
            return BatchTimes(fit * t.first, fit * t.decode, fit * t.total)

        def times_of(members: list[Request]) -> Callable[[int], BatchTimes]:
            """F, D, B of a batch of the first b of `members` (their prompts, their max_tokens),
            scaled by the fit."""
            memo: dict[int, BatchTimes] = {}
            sums = list(accumulate(r.num_prompt_tokens for r in members))

            def times(b: int) -> BatchTimes:
                if b not in memo:
                    p = sums[min(b, len(sums)) - 1] / min(b, len(sums))
                    memo[b] = fitted(b, expected_lengths([r.max_tokens for r in members[:b]], outs), p)
                return memo[b]
            return times

        queue = head
        own = [expected_lengths([r.max_tokens], outs)[0] for r in head]  # each one's expected output length
        alone = [fitted(1, [n], r.num_prompt_tokens).total for n, r in zip(own, head)]
        back = hopeless_last(waits, e2e, alone, self.targets, own)
        head, waits, e2e, alone, own = ([xs[i] for i in back] for xs in (head, waits, e2e, alone, own))
        times = times_of(head)

        since = 0.0 if self.last_arrival is None else now - self.last_arrival
        overdue = any(is_overdue(w, e, self.targets) for w, e in zip(waits, e2e))
        gap, long_gap = arrival_gap(self.mean_gap_s, since), self._long_gap(now)

        bounds, tg = {r.max_tokens for r in head}, self.targets
        law = None  # where no length is known ahead (outputs end at EOS below a shared max_tokens)
        if tg.tpot is not None and tg.ttft is None and tg.e2e is None and outs and outs[0] < math.inf \
                and len(bounds) == 1:
            law = (LengthLaw(outs, bounds.pop()), lambda tokens, seqs: fit * step(tokens, seqs))

        def size(times: Callable[[int], BatchTimes], waits: list[float], e2e: list[float | None],
                 own: list[int]) -> tuple[int, bool]:
            return batch_cap(times, cap, self.targets, gap, len(sched.waiting), overdue, waits, e2e, long_gap, own,
                             law)

        sized = size(times, waits, e2e, own)
        c, paced = sized
        order = list(range(len(head))) if paced else offer_order(waits, e2e, [r.max_tokens for r in head],
                                                                   times(min(len(head), c)), self.targets, alone, own)
        offered = [head[i] for i in order]
        self.offered = None if offered == queue else offered
        waits, e2e, own = [waits[i] for i in order], [e2e[i] for i in order], [own[i] for i in order]
        if order != list(range(len(head))):
            times = times_of(offered)
            if law is None:  # the law's size reads no one's wait or length
                again = size(times, waits, e2e, own)
                sized = sized if again[1] else again
        newcomer = None
        if self.longest.values:  # a batch of requests yet to arrive, each as long as the longest recent output
            longest = int(self.longest.values[-1])

            def newcomer(b: int) -> BatchTimes:
                return fitted(b, [longest] * b)
        self.plan = plan_batch(waits, e2e, times, cap, self.mean_gap_s, since, self.targets,
                               self.config.window_max_ms / 1000.0, sized, newcomer, own)
        self.max_batch = max(1, self.plan.size)
        self.window_ms = 1000.0 * (waits[0] + self.plan.wait_s) if math.isfinite(self.plan.wait_s) else \
            self.config.window_max_ms
        if self.plan.launch:
            t = times(self.plan.size)
            self._first, self._step = t.first / fit, step

    def should_launch(self, sched: "Scheduler", now: float) -> bool:
        return self.plan is not None and self.plan.launch

    def next_step_due(self, sched: "Scheduler", now: float) -> float | None:
        """The least slack running out, or the longest wait for company; an arrival sooner
        wakes the loop anyway."""
        if self.members or self.plan is None:
            return super().next_step_due(sched, now)
        return now + self.plan.wait_s if math.isfinite(self.plan.wait_s) else None

    def candidates(self, sched: "Scheduler") -> Iterable[Request]:
        order = list(sched.waiting) if self.offered is None else self.offered
        if not self.config.bucket_by_length or len(order) < 2:
            return order
        head = length_bucket(order[0].num_prompt_tokens, order[0].max_tokens)
        rank = {r.request_id: i for i, r in enumerate(order)}
        rest = sorted(order[1:], key=lambda r: (bucket_distance(head, length_bucket(r.num_prompt_tokens,
                                                                                     r.max_tokens)),
                                                rank[r.request_id]))
        return [order[0]] + rest

    def on_batch_end(self, sched: "Scheduler", members: list[Request], now: float) -> None:
        for r in members:
            self.longest.add(r.num_output_tokens)
            if r.status == RequestStatus.FINISHED_STOPPED:
                self.outputs.add(r.num_output_tokens)
            elif r.status == RequestStatus.FINISHED_LENGTH:
                self.outputs.add(math.inf)
        if self._first is not None and members:
            # judged at the outputs the batch had: how long they were is `outputs`' part, and
            # counting it here too would scale every later batch by one draw
            raw = self._first + decode_time(self._step, sorted(r.num_output_tokens for r in members))
            if raw > 0:
                self.fit = min(4.0, max(0.25, ewma(self.fit, (now - self.batch_start) / raw, FIT_ALPHA)))
        self._first = None


def _e2e(req: Request, slo_s: float | None) -> float | None:
    """A request's end-to-end target in seconds: the tighter of the SLO and its own deadline."""
    own = None if req.deadline_ms is None else req.deadline_ms / 1000.0
    if own is None or slo_s is None:
        return own if slo_s is None else slo_s
    return min(own, slo_s)
