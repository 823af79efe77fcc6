"""The request-level batch controller and its helpers: pure functions of what the policy measured.

The dynamic policy keeps the measurements (arrival rate, recent output lengths, the engine's
step-time model) and asks `plan_batch`, at each step while no batch runs, whether to launch
one now and how many requests it takes. Nothing here keeps state or reads a clock.

The control law. A batch of b requests with mean prompt p, launched now, is predicted to take

    F(b) = k * step(b*p / k, b),  k = ceil(b*p / T)     its prefill: the members' first tokens
    D(b) = step(b, b)                                   one decode step: their time per token
    B(b) = F(b) + sum_j (l_j - l_j-1) * step(n_j, n_j),  n_j = b - j + 1    to its last result

with T the step's token budget, step() the engine's latency model, and l_1 <= ... <= l_b the
members' expected output lengths (l_0 = 1): the j-th smallest of their max_tokens, capped at the
j/(b+1) quantile of recent output lengths, where an output cut at its max_tokens counts as
longer than any. A member leaves the steps when its output ends, so from l_j-1 to l_j the batch
runs n_j rows, and its last result comes at l_b. Where outputs run to their max_tokens the
lengths are exact; where they end well before it, they are the expected order statistics of b
draws. The members are the first b offered (below). A request that has waited w, whose own
expected output is l (its max_tokens capped at the median recent output), meets its targets
in that batch when every target that is set holds:

    w + F(b) <= ttft,   B(b) - F(b) <= tpot * (l - 1),   w + B(b) <= e2e

(e2e: the tighter of the SLO and its own deadline). A member's result is held until the batch
ends, so its time per token is the batch's decode span over its own tokens, not one step's
time: a short output in a batch with a long one misses a TPOT target the long one meets. A
one-token output has no time per token, and its one token reaches its caller at B(b), which
the TTFT target then judges. A request of unknown length (a newcomer) is judged as the longest
member: D(b) <= tpot.

Who. A waiting request is hopeless when it misses its end-to-end target even alone, w + B_i(1) >
e2e with B_i(1) the time of a batch of it by itself (its own prompt and expected output), and is
not overdue (below). Every rule that follows reads the queue with the hopeless moved behind the
others, in queue order: at the head, one long output would price every batch at its length, so
the sizes would shrink to 1 and each batch would end too late for all its members. With a TPOT
target, each of the two parts is also grouped by output length: stable-sorted by |log l - log
l_1|, l_1 the first one offered's (the oldest not hopeless), so the batch is of its length and
the others wait for one of theirs (the head is the oldest, so every length gets its turn). A
request is late when it misses its targets even in the batch that would go now (of min(n, c)
requests, n waiting; c below), that batch lasting at least its own B_i(1). The batch is offered
to, in this order (queue order within each group):

    overdue     late, and w >= k * its target (e2e, else ttft); k the overdue factor, 2 by default
    on time     not late
    riders      late, max_tokens <= the largest max_tokens of those on time, and its time per
                token within the target in this batch

and d below counts them. The rest, late requests with a longer max_tokens, wait for a batch they
do not lengthen: they would miss anyway, and with them the on-time members would wait for their
last token, and everyone queued behind for the batch's end; so do the late whose time per token
misses here, which a batch of their own length would meet. A rider ends within the on-time
members' bound, so it costs them one more row a step; a request that has waited k times its
target goes whatever it costs, so none waits without bound. A larger k holds the late back
longer for the on-time ones: more requests in time, a longer tail; below 1 a late request goes
first before its target has passed, and the controller can fall below a fixed setting. With no
request on time, none late, no target set, or the targets out of the load's reach (below), this
is the queue's order (the hopeless behind).

Size. The batch takes the first min(d, c) of them, where c is the size that serves the most
requests within their targets per second of engine time, among the sizes the targets allow (up
to s) and the long-run load needs (from f), over the first b offered: c is found once over the
queue (hopeless behind) to tell who is late, and again over the order offered, which the batch
takes (where the second finds the load out of reach, below, the first stands):

    c = argmax{ good(b) / busy(b) : f <= b <= s }     the smallest on a tie; with none good, of b / B(b)
    c = argmax{ good(b) / busy(b) : b < f, m(b) > 0 } where none from f up is good, and one below has m(b) > 0
    s = max{ b <= cap : F(b) <= ttft, D(b) <= tpot, B(b) <= e2e }              (1 if none; with
        lengths: every one of the first b offered meets its targets at its own l, without waiting)
    f = min{ b <= s : b >= B(b) / (h * G) }                                    keeps pace, or where none does
    f = min{ b <= s : b / B(b) >= h * max{ b' / B(b') : b' <= s } }            serves within h of the most

counted over this batch and, when it leaves some of the d waiting, the batch of the rest right
after it (b2 = min(d - b, b) of them, each having waited B(b) longer):

    good(b) = g1 + min(b2, max(0, m2 - g1)),  g1 = min(b, m1 + max(0, b - d)),  busy(b) = B(b) + B(b2)

with m1 and m2 the waiting who meet their targets in the first batch and in the second, G the
mean arrival gap over the last 30 s and h = 0.85. B(b2) prices the second batch as one of the
first b2 offered, not of the b2 it would hold, who are often the longer: a price that favours
the split, and in simulation serves more requests in time through bursts than the exact one,
which sends the long with the short. Past s every member misses, even one that has not waited
(with a TPOT target, at least the shortest misses its time per token: no batch mixes lengths so
far apart that one of them misses before it has waited). Below it, a larger batch takes more of
the queue but runs longer: those who have waited may miss in it, and past the throughput knee
its time grows as fast as its size. A smaller one serves the on-time first and leaves the rest
for the next, which costs them a batch's wait: where batches cost about their size (a CPU past
its knee) that split wins through a burst, where a larger batch is nearly free (a GPU below its
knee) the one batch does. Seats past the waiting count as newcomers that meet their targets. The
two batches look no further: under a sustained load, batches that only just keep up let the
queue grow, so no batch is smaller than f, the size that keeps pace with the long-run arrival
rate while busy at most h of the time (the 30 s average a burst out). Where no size the targets
allow keeps that pace (a load past them, or a burst that began within those 30 s), the floor is
the smallest size that serves within h of the most requests per second they allow, not s itself:
B(s) is at the target, so in a batch of s everyone who has waited misses. The floor gives way
where every size it allows would serve nobody in time and a smaller batch would serve some of
its own members in time (m(b) > 0: of the first b offered, that many meet their targets in it):
keeping pace there serves later arrivals at the price of every request now waiting, some of whom
the smaller batch serves. Its own members, not the queue's or the next batch's, since a smaller
batch of none in time only gives up pace. With no target set, c = s = cap.

Unless the load puts the targets out of reach. With q requests waiting in all, the pace size

    p = min{ b <= cap : b >= max(0, q - b) + B(b) / gap }     (cap if none)

is the smallest batch that leaves no more waiting than it takes (those it leaves, plus those
arriving while it runs). When p > s, batches the targets allow fall behind. Through a burst that
is the right trade: holding late requests back keeps the on-time ones within target, and the
queue drains when the burst ends. Once a request has waited k times its target (overdue), the
load has outlasted that: the queue grows for as long as it lasts, and every request in it misses
by more. So when p > s, someone is overdue, and a TTFT or end-to-end target is set (one that
waiting breaks), c = p, the queue is offered in its own order (the hopeless behind; by length
with a TPOT target), and the batch launches by the rules without targets: the fixed point that
serves the most, until the backlog is gone. A TPOT target alone is not broken by waiting, so a
backlog never outgrows it.

Lengths known to no one, a TPOT target alone. Where the waiting requests share one max_tokens
and recent outputs ended before it (at their EOS), the lengths above are one guess for every
request, and the b/(b+1) quantile prices a batch as if it held no long output, though most
batches of that size hold one. Then each member's output is taken as L = min(max_tokens, X),
X drawn independently from the recent outputs (their values, or where more than 64 differ the
midpoints of 64 equal shares; one cut at its max_tokens at the bound), and a member of output
l meets the target when the longest M' of the other b - 1 is short enough:

    g(b) = P(L < 2) + sum_{l >= 2} P(L = l) 1[D'(b) <= tpot] P(L <= 1 + tpot (l - 1) / D'(b))^(b - 1)
    E[B(b)] = F(b) + sum_k (x_k - x_k-1) P(M >= x_k) step(r_k, r_k),  r_k = b P(L >= x_k) / P(M >= x_k)
    D'(b) = (E[B(b)] - F(b)) / E[M - 1]

with x_k the points of L (x_0 = 1), M the longest of b (P(M >= x) = 1 - P(L < x)^b), r_k the
rows still running past x_k-1 while one does, and D'(b) the decode span per token of the
longest (a one-token output has no time per token, and adds no decode step). The size is

    c = argmax{ min(1 / G, h b / E[B(b)]) g(b) : b <= cap }     the smallest on a tie; with g
                                                               zero everywhere, of min(1 / G, h b / E[B(b)])

the requests within the target per second in the long run: a size that keeps pace with the
arrivals (with headroom h) serves each arrival once, one that does not serves only as fast as it
runs. Waiting does not break a TPOT target, so no floor, s or m applies. Where outputs run to
their max_tokens (every recent one cut, inf) the lengths are exact and this is off.

Launch now, with those b, when any of

    d >= c                         the queue alone fills a batch
    it keeps pace                  without targets (or out of their reach): d >= B(b) / gap, fewer
                                   arrive while it runs than it serves; with targets: one arriving now would
                                   still meet them in the next batch (of about B(b) / gap), so
                                   waiting for it gains nothing. For a lone request (d = 1) whose
                                   batch ends before the next arrival is due (B(1) < mean gap),
                                   the newcomer's output is taken as long as the longest recent
                                   one: the engine would idle after the batch, and a newcomer
                                   behind it that misses is a long one, which waiting can seat
    a member would be late         one that meets its targets now would miss them by waiting
                                   for the next arrival: one gap longer, in a batch of b + 1
    w_1 >= window_max              the first offered (the oldest of its group) waits no longer for
                                   company; one held back behind the others waits for its turn

where gap = max(mean arrival gap, time since the last arrival), so that a silence counts as
the slowing it is. Otherwise wait for the next arrival, or until one of the rules would fire
without it: the gap grows with the silence, the waits grow, and both times are exact. At a
trickle a lone request goes at once; near saturation the batch fills to the size that keeps up,
the fixed point b* = B(b*) / gap; past saturation every batch is full. While the latency model
knows nothing it predicts 0 s, and every batch goes at once with all that waits.
No target is assumed: one the machine cannot meet would only steer the batch away from the
sizes that serve the most.
"""
from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass
from typing import Callable, Sequence

HEADROOM = 0.85  # h of the control law: the busiest the floor may be at the long-run rate, else its share of the most
StepTime = Callable[[int, int], float]  # (tokens in the step, sequences in it) -> seconds


def ewma(prev: float | None, x: float, alpha: float) -> float:
    """Exponentially weighted moving average; the first sample is taken as is."""
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    return x if prev is None else alpha * x + (1.0 - alpha) * prev


@dataclass(frozen=True)
class Targets:
    """Latency targets in seconds (None: not set), and k of the control law: a request held
    back is overdue once it has waited `overdue` times its target."""

    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None
    overdue: float = 2.0

    @property
    def any(self) -> bool:
        return self.ttft is not None or self.tpot is not None or self.e2e is not None


@dataclass(frozen=True)
class BatchTimes:
    """F(b), D(b) and B(b) of the control law, in seconds."""

    first: float
    decode: float
    total: float


def expected_lengths(max_tokens: Sequence[int], outputs: Sequence[float]) -> list[int]:
    """The l_1 <= ... <= l_b of the control law: the expected output lengths of members with
    these max_tokens. The j-th smallest of b is m_(j) capped at the j/(b+1) quantile of
    `outputs` (the sorted recent lengths, where one cut at its max_tokens counts as inf: it
    would have gone on); with no outputs seen, each member's max_tokens."""
    ms, n = sorted(max_tokens), len(outputs)
    if not n:
        return ms
    b = len(ms)
    return [int(min(m, outputs[min(n - 1, n * j // (b + 1))])) for j, m in enumerate(ms, 1)]


def batch_times(step: StepTime, b: int, prompt_len: float, lengths: Sequence[int], token_budget: int,
                prompts: StepTime | None = None) -> BatchTimes:
    """F(b), D(b) and B(b) for b members with mean prompt `prompt_len` and output `lengths`
    (ascending, b of them; fewer are padded with the last). `prompts`: the time of a step of
    whole prompts (tokens, how many), for a model that tells it from a chunk and decodes; each
    of the k prefill steps then holds ceil(b / k) of them (None: step(tokens / k, b))."""
    tokens = max(1, round(b * prompt_len))
    k = -(-tokens // max(1, token_budget))
    first = k * (step(-(-tokens // k), b) if prompts is None else prompts(-(-tokens // k), -(-b // k)))
    ls = list(lengths[:b]) + [lengths[-1] if lengths else 1] * max(0, b - len(lengths))
    return BatchTimes(first, step(b, b), first + decode_time(step, ls))


def decode_time(step: StepTime, lengths: Sequence[int]) -> float:
    """Σ_t step(n_t, n_t) over the decode steps of members with these output `lengths`
    (ascending): n_t of them run at step t, those with more than t tokens."""
    total, prev, b = 0.0, 1, len(lengths)
    for k, ln in enumerate(lengths):
        if ln > prev:
            total += (ln - prev) * step(b - k, b - k)
            prev = ln
    return total


@dataclass(frozen=True)
class Plan:
    """`plan_batch`'s answer: launch now with `size` members, or wait at most `wait_s`."""

    launch: bool
    size: int
    wait_s: float


def plan_batch(waits: Sequence[float], e2e: Sequence[float | None], times: Callable[[int], BatchTimes],
               cap: int, mean_gap_s: float | None, since_s: float, targets: Targets, window_max_s: float,
               sized: tuple[int, bool] | None = None, newcomer: Callable[[int], BatchTimes] | None = None,
               lengths: Sequence[int] = ()) -> Plan:
    """The control law in the module docstring. `waits` (seconds) and `e2e` (each request's
    end-to-end target, None for none) are the requests offered, in `offer_order`'s order, at
    least the first cap of them; `times(b)` gives F, D, B for a batch of b; the arrival gap is the
    larger of `mean_gap_s` (None: no arrivals seen) and `since_s`, the time since the last;
    `sized`: `batch_cap`'s answer when the caller has it (None: asked here, the offered
    requests taken as all that wait); `newcomer(k)`: F, D, B of a batch of k requests yet to
    arrive, each as long as the longest recent output (None: none seen); `lengths`: the offered
    requests' expected output lengths (the l of the targets; none: each judged as the longest).

    When it waits, `wait_s` is exact: with no arrival the plan first says launch then (the gap
    grows with the silence, so the batch comes to keep pace, or a member to be late)."""
    d = len(waits)
    if d == 0:
        return Plan(False, 0, math.inf)
    g = math.inf if mean_gap_s is None else mean_gap_s
    gap = arrival_gap(mean_gap_s, since_s)
    c, paced = sized if sized is not None else batch_cap(
        times, cap, targets, gap, d, any(is_overdue(w, e, targets) for w, e in zip(waits, e2e)), waits, e2e,
        lengths=lengths)
    size = min(d, c)
    now_t, next_t = times(size), times(min(size + 1, c))
    # the batch keeps pace once the gap reaches need: d >= B / gap; with targets, once a newcomer
    # would still meet them in the next batch, of about B / gap requests
    if targets.any and not paced:
        # a lone request at a trickle: the engine idles after its batch, so a long newcomer is what waits
        later = newcomer if newcomer is not None and d == 1 and now_t.total < g else times
        n = _largest(lambda k: _meets(now_t.total, targets.e2e, later(k), targets), c)
        need = 0.0 if n >= c else math.inf if n == 0 else now_t.total / n
    else:
        need = now_t.total / d
    members = [(w, e, ln) for w, e, ln in zip(waits[:size], e2e[:size], _lens(lengths, size))
               if _meets(w, e, now_t, targets, ln)]
    margins = [_margin(w, e, next_t, targets, ln) - gap for w, e, ln in members]  # < 0: late
    launch = d >= c or gap >= need or any(m < 0 for m in margins) or waits[0] >= window_max_s
    if launch:
        return Plan(True, size, 0.0)
    wait = min(window_max_s - waits[0], need - since_s)
    grow_at = max(0.0, g - since_s)  # the gap grows with the silence from then on
    for m in margins:  # the margin closes at 1/s while the gap holds, at 2/s once it grows
        wait = min(wait, m if m <= grow_at else grow_at + (m - grow_at) / 2)
    return Plan(False, size, max(0.0, wait))


def arrival_gap(mean_gap_s: float | None, since_s: float) -> float:
    """The arrival gap of the control law: the mean gap (None: no arrivals seen), or the time
    since the last arrival when that is longer."""
    return max(math.inf if mean_gap_s is None else mean_gap_s, since_s)


def batch_cap(times: Callable[[int], BatchTimes], top: int, targets: Targets, gap: float, queued: int,
              overdue: bool, waits: Sequence[float] = (), e2e: Sequence[float | None] = (),
              long_gap: float = math.inf, lengths: Sequence[int] = (),
              law: tuple[LengthLaw, StepTime] | None = None) -> tuple[int, bool]:
    """c of the control law, and whether the load puts the targets out of reach (c is then the
    pace size, larger than the targets allow). `queued`: how many wait in all; `overdue`: whether
    one of them is overdue; `waits`, `e2e` and `lengths`: the waiting, as `plan_batch`
    takes them (none: the rate counts newcomers only); `long_gap`: G, the long-run arrival gap
    (inf: no floor); `law`: L and the decode step's time where lengths are known to no one, used
    with a TPOT target alone and no request's own deadline (None: the lengths as given)."""
    if law is not None and targets.tpot is not None and targets.ttft is None and targets.e2e is None \
            and all(e is None for e in e2e):
        return law_size(times, top, targets.tpot, law[0], law[1], long_gap), False
    s = slo_size(times, top, targets, lengths)
    if overdue and (targets.ttft is not None or targets.e2e is not None):
        p = pace_size(times, top, gap, queued)
        if p > s:
            return p, True
    return rate_size(times, s, targets, waits, e2e, floor_size(times, s, HEADROOM * long_gap), lengths), False


class LengthLaw:
    """The L of the control law for lengths known to no one: members that share one max_tokens
    `bound`, each output min(bound, X) with X drawn independently from `outputs` (the sorted
    recent lengths; inf, one cut at its max_tokens, counts as `bound`): its values `xs` with
    their shares `ps`, or where more than `bins` differ, the midpoints of `bins` equal shares."""

    def __init__(self, outputs: Sequence[float], bound: int, bins: int = 64) -> None:
        v = sorted(min(float(x), float(bound)) for x in outputs)
        n = len(v)
        if len(set(v)) > bins:  # the midpoints of `bins` equal shares; else each value at its own share
            n, v = bins, [v[int((i + 0.5) * n / bins)] for i in range(bins)]
        self.xs: list[float] = []
        self.ps: list[float] = []
        for x in v:
            if self.xs and self.xs[-1] == x:
                self.ps[-1] += 1.0 / n
            else:
                self.xs.append(x)
                self.ps.append(1.0 / n)
        self.cum = list(itertools.accumulate(self.ps))
        if self.cum:
            self.cum[-1] = 1.0  # not a rounding short of it
        # what span and tpot_share read for every b, computed once: each run from the point
        # before to x (its width, P(L >= x), P(L < x)), and P(L < 2) with the points past it
        self._runs: list[tuple[float, float, float]] = []
        prev, below = 1.0, 0.0
        for x, c in zip(self.xs, self.cum):
            if x > prev:
                q = 1.0 - below
                self._runs.append((x - prev, q, 1.0 - q))
                prev = x
            below = c
        self._one = 0.0
        self._long: list[tuple[float, float]] = []
        for x, q in zip(self.xs, self.ps):
            if x < 2:
                self._one += q
            else:
                self._long.append((x, q))

    def cdf(self, x: float) -> float:
        """P(L <= x)."""
        i = bisect.bisect_right(self.xs, x)
        return self.cum[i - 1] if i else 0.0

    def span(self, step: StepTime, b: int) -> tuple[float, float]:
        """E[B(b) - F(b)], the decode span of b members (a row leaves the steps as its output
        ends), with `step` the time of a step of n rows; and E[M - 1], M the longest member."""
        span = tokens = 0.0
        for width, q, below in self._runs:  # q = P(L >= x): a member still runs up to x
            busy = 1.0 - below ** b
            if busy > 0:
                rows = max(1, round(b * q / busy))
                span += width * busy * step(rows, rows)
                tokens += width * busy
        return span, tokens

    def tpot_share(self, b: int, dbar: float, tpot: float) -> float:
        """g(b): the chance that a member of a batch of b meets the target `tpot`, with `dbar`
        its D'(b); a one-token output has no time per token and always does."""
        p = self._one
        if dbar > tpot:
            return p
        i, n = 0, len(self.xs)
        for x, q in self._long:  # the bound grows with x: one walk finds every P(L <= bound)
            bound = 1.0 + tpot * (x - 1.0) / dbar if dbar > 0 else math.inf
            while i < n and self.xs[i] <= bound:
                i += 1
            p += q * (self.cum[i - 1] if i else 0.0) ** (b - 1)
        return p


def law_size(times: Callable[[int], BatchTimes], top: int, tpot: float, law: LengthLaw, step: StepTime,
             long_gap: float = math.inf) -> int:
    """c of the control law for lengths known to no one and a TPOT target alone: the b <= top
    of the most requests within `tpot` per second in the long run, with output lengths drawn
    from `law`, F(b) from `times` and the decode steps from `step`; G = `long_gap` (inf: no
    arrival rate yet, every size counted at the rate it runs)."""
    best, key = [top, top], [-1.0, -1.0]  # by requests in time, and by requests (none in time)
    rate = 1.0 / long_gap if 0.0 < long_gap < math.inf else math.inf
    table = [0.0] + [step(n, n) for n in range(1, top + 1)]  # a decode step of n rows, n <= b <= top
    for b in range(1, top + 1):
        span, tok = law.span(lambda n, _: table[n], b)
        busy = times(b).first + span
        if busy <= 0:
            return top
        served = min(rate, HEADROOM * b / busy)
        for i, k in enumerate((served * law.tpot_share(b, span / tok if tok > 0 else 0.0, tpot), served)):
            if k > key[i]:
                best[i], key[i] = b, k
    return best[0] if key[0] > 0 else best[1]


def rate_size(times: Callable[[int], BatchTimes], top: int, targets: Targets, waits: Sequence[float],
              e2e: Sequence[float | None], floor: int = 1, lengths: Sequence[int] = ()) -> int:
    """The control law's c: the argmax of good(b) / busy(b) over floor <= b <= top, the smallest
    on a tie and, where no size serves anyone in time, the one of most requests per second; top
    when no target is set or the model knows nothing. Where no size from the floor up serves
    anyone in time, the argmax over the smaller sizes whose batch serves one of its own members
    in time, if any."""
    if not targets.any:
        return top
    floor = max(1, min(floor, top))
    d, best, key = len(waits), [top, top], [(-1.0, -1.0), (-1.0, -1.0)]  # below the floor, from it
    ls = _lens(lengths, d)
    for b in range(1, top + 1):
        t = times(b)
        if t.total <= 0:
            return top
        m = sum(1 for w, e, ln in zip(waits, e2e, ls) if _meets(w, e, t, targets, ln))
        good, busy = min(b, m + max(0, b - d)), t.total
        if d > b:  # those it leaves go in the batch right after
            b2 = min(d - b, b)
            t2 = times(b2)
            m2 = sum(1 for w, e, ln in zip(waits, e2e, ls) if _meets(w + t.total, e, t2, targets, ln))
            good, busy = good + min(b2, max(0, m2 - good)), busy + t2.total
        k, i = (good / busy, b / t.total), int(b >= floor)
        if k > key[i] and (i or any(_meets(w, e, t, targets, ln) for w, e, ln in zip(waits[:b], e2e[:b], ls))):
            best[i], key[i] = b, k
    return best[0] if key[1][0] <= 0 < key[0][0] else best[1]


def pace_size(times: Callable[[int], BatchTimes], top: int, gap: float, queued: int) -> int:
    """The smallest b <= top whose batch leaves no more waiting than it takes: those it leaves of
    the `queued` plus those arriving, one per `gap`, while it runs (top when none does)."""
    return next((b for b in range(1, top + 1) if _keeps_pace(times, b, gap, queued)), top)


def floor_size(times: Callable[[int], BatchTimes], top: int, gap: float) -> int:
    """f of the control law: the smallest b <= top that keeps pace with one arrival per `gap`;
    where none does, the smallest whose requests per second are within HEADROOM of the most
    any b <= top serves."""
    paced = pace_size(times, top, gap, 0)
    if _keeps_pace(times, paced, gap, 0):
        return paced
    rates = [b / t.total if (t := times(b)).total > 0 else math.inf for b in range(1, top + 1)]
    most = max(rates)
    return next(b for b, r in enumerate(rates, 1) if r >= HEADROOM * most)


def _keeps_pace(times: Callable[[int], BatchTimes], b: int, gap: float, queued: int) -> bool:
    """A batch of b leaves no more of the `queued` waiting than it takes, counting one arrival
    per `gap` while it runs."""
    t = times(b).total
    return b >= max(0, queued - b) + (t / gap if gap > 0 else math.inf if t > 0 else 0.0)


def hopeless_last(waits: Sequence[float], e2e: Sequence[float | None], alone: Sequence[float],
                  targets: Targets, lengths: Sequence[int] = ()) -> list[int]:
    """The waiting requests' indices in queue order with the hopeless (the module docstring's
    rule; `alone`: each one's B(1)) moved behind the others. With a TPOT target and their
    expected output `lengths`, each of the two is grouped by length: stable-sorted by the
    ratio of each one's length to the first one offered's (its log's distance)."""
    hopeless = [e is not None and w + a > e and not is_overdue(w, e, targets) for w, e, a in zip(waits, e2e, alone)]
    order = [i for i, h in enumerate(hopeless) if not h] + [i for i, h in enumerate(hopeless) if h]
    if targets.tpot is None or len(lengths) < len(order) or not order:
        return order
    ref = math.log(max(1, lengths[order[0]]))
    return sorted(order, key=lambda i: (hopeless[i], abs(math.log(max(1, lengths[i])) - ref)))


def offer_order(waits: Sequence[float], e2e: Sequence[float | None], max_tokens: Sequence[int], now_t: BatchTimes,
                targets: Targets, alone: Sequence[float] = (), lengths: Sequence[int] = ()) -> list[int]:
    """Who is offered a place in the batch, as indices into the waiting requests (queue order),
    by the module docstring's rule: the overdue, the on-time, then the riders. `now_t`: the
    times of the batch that would go now; `alone`: each request's B(1), its batch's time by
    itself (none: not counted); `lengths`: their expected output lengths (none: the longest)."""
    on: list[int] = []
    late: list[int] = []
    paced: set[int] = set()  # the late whose time per token meets the target in this batch
    for i, (w, e, ln) in enumerate(zip(waits, e2e, _lens(lengths, len(waits)))):
        t = now_t if i >= len(alone) else BatchTimes(now_t.first, now_t.decode, max(now_t.total, alone[i]))
        if _meets(w, e, t, targets, ln):
            on.append(i)
        else:
            late.append(i)
            if _tpot_ok(t, targets, ln):
                paced.add(i)
    if not on or not late:
        return list(range(len(waits)))
    bound = max(max_tokens[i] for i in on)

    def rides(i: int) -> bool:
        return not is_overdue(waits[i], e2e[i], targets) and max_tokens[i] <= bound and i in paced

    return [i for i in late if is_overdue(waits[i], e2e[i], targets)] + on + [i for i in late if rides(i)]


def is_overdue(w: float, e2e: float | None, targets: Targets) -> bool:
    """Has waited w >= `targets.overdue` times its target (its end-to-end one, else the TTFT target)."""
    target = e2e if e2e is not None else targets.ttft
    return target is not None and w >= targets.overdue * target


def _largest(ok: Callable[[int], bool], top: int) -> int:
    """The largest k in [1, top] with ok(k), for ok true up to some k and false past it; 0 if none."""
    if not ok(1):
        return 0
    lo, hi = 1, top
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def _margin(w: float, e2e: float | None, t: BatchTimes, targets: Targets, length: int | None = None) -> float:
    """How much longer a request that has waited w, of expected output `length` (None: the
    longest member), could wait and still meet its targets in a batch of times t (-inf where
    its time per token already misses)."""
    if not _tpot_ok(t, targets, length):
        return -math.inf
    m = math.inf
    if targets.ttft is not None:
        m = min(m, targets.ttft - w - _first(t, length))
    if e2e is not None:
        m = min(m, e2e - w - t.total)
    return m


def _meets(w: float, e2e: float | None, t: BatchTimes, targets: Targets, length: int | None = None) -> bool:
    """Does a request that has waited w, of expected output `length` (None: the longest
    member), meet its targets in a batch of times t?"""
    return ((targets.ttft is None or w + _first(t, length) <= targets.ttft) and _tpot_ok(t, targets, length)
            and (e2e is None or w + t.total <= e2e))


def _first(t: BatchTimes, length: int | None) -> float:
    """When a member's first token reaches its caller: F, or B for a one-token output (its one
    token is its result, held to the batch's end)."""
    return t.total if length is not None and length < 2 else t.first


def _tpot_ok(t: BatchTimes, targets: Targets, length: int | None) -> bool:
    """A member's time per token, (B - F) / (l - 1) (its last token is held to the batch's end),
    within the target; D(b) for the longest member (None)."""
    if targets.tpot is None:
        return True
    if length is None:
        return t.decode <= targets.tpot
    return length < 2 or t.total - t.first <= targets.tpot * (length - 1)


def _lens(lengths: Sequence[int], n: int) -> list[int | None]:
    """`lengths` padded with None (judged as the longest member) to n."""
    return [*lengths[:n], *[None] * (n - len(lengths))]


def slo_size(times: Callable[[int], BatchTimes], top: int, targets: Targets, lengths: Sequence[int] = ()) -> int:
    """The largest b <= top whose batch meets the targets for a request that has not waited
    (1 when none does): a larger batch would make every member miss. With the members'
    expected output `lengths` (in the order offered), for every one of the first b at its own
    length: a larger batch would make one of them miss (the shortest, its time per token)."""
    if not targets.any:
        return top

    def ok(b: int) -> bool:
        t = times(b)
        return all(_meets(0.0, targets.e2e, t, targets, ln) for ln in (set(lengths[:b]) if lengths else (None,)))
    return max(1, _largest(ok, top))


class SortedWindow:
    """The last `size` values of a stream, kept sorted (for `expected_lengths`)."""

    def __init__(self, size: int = 256) -> None:
        self.size = size
        self._order: list[float] = []
        self.values: list[float] = []

    def add(self, x: float) -> None:
        self._order.append(x)
        bisect.insort(self.values, x)
        if len(self._order) > self.size:
            old = self._order.pop(0)
            del self.values[bisect.bisect_left(self.values, old)]


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation; 0.0 for no values."""
    if not values:
        return 0.0
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100.0
    f = math.floor(k)
    c = min(f + 1, len(xs) - 1)
    return xs[f] + (xs[c] - xs[f]) * (k - f)


def length_bucket(num_prompt_tokens: int, max_tokens: int) -> tuple[int, int]:
    """Power-of-two buckets of prompt and output length: requests in one bucket pad each
    other by less than 2x (sequence-level batching)."""
    return (max(1, num_prompt_tokens).bit_length(), max(1, max_tokens).bit_length())


def bucket_distance(a: tuple[int, int], b: tuple[int, int]) -> int:
    return abs(a[0] - b[0]) + abs(a[1] - b[1])
