"""The dynamic policy's control law and its helpers as pure functions."""
from __future__ import annotations

import math

import pytest

from batchserve.core.controllers import (BatchTimes, LengthLaw, SortedWindow, Targets, batch_cap, batch_times,
                                         bucket_distance, decode_time, ewma, expected_lengths, floor_size,
                                         hopeless_last, law_size, length_bucket, offer_order, percentile,
                                         pace_size, plan_batch, rate_size, slo_size)

def linear(base: float, per: float):
    """times(b) for a batch whose whole time is base + per * b s (prefill a tenth of it)."""
    return lambda b: BatchTimes(0.1 * (base + per * b), per, base + per * b)


def plan(waits, times, cap=32, rate=1.0, targets=Targets(), window_max=1.0, e2e=None, since=0.0):
    e2e = [targets.e2e] * len(waits) if e2e is None else e2e
    return plan_batch(waits, e2e, times, cap, 1.0 / rate, since, targets, window_max)


def test_a_trickle_launches_a_lone_request_at_once():
    p = plan([0.0], linear(1.0, 0.01), rate=0.5)  # 0.5/s x 1.01 s < 1: the batch of one keeps pace
    assert p.launch and p.size == 1 and p.wait_s == 0.0


def test_near_saturation_the_batch_fills_to_the_size_that_keeps_pace():
    times = linear(1.0, 0.01)  # b* = 20 * (1 + 0.01 b*)  ->  b* = 25
    waiting = [plan([0.0] * d, times, rate=20.0) for d in range(1, 25)]
    assert not any(p.launch for p in waiting)
    assert all(0 < p.wait_s <= 1.0 for p in waiting)  # until the next arrival, at most window_max
    p = plan([0.0] * 25, times, rate=20.0)
    assert p.launch and p.size == 25
    assert plan([0.2] * 30, times, rate=100.0, cap=32).size == 30  # past saturation: what waits, to the cap


def test_a_full_queue_launches_the_cap_and_window_max_bounds_the_wait():
    p = plan([0.0] * 40, linear(1.0, 0.01), rate=1000.0, cap=32)
    assert p.launch and p.size == 32
    assert plan([1.0, 0.0], linear(1.0, 0.01), rate=100.0, window_max=1.0).launch
    assert not plan([0.5, 0.0], linear(1.0, 0.01), rate=100.0, window_max=1.0).launch


def test_a_member_short_of_slack_launches_the_batch():
    times, t = linear(1.0, 0.01), Targets(e2e=2.0)
    # 2 waiting at 20/s (needs 25): the oldest, 0.95 s in, has 2 - 0.95 - 1.02 = 0.03 s < 1/20 s
    p = plan([0.95, 0.1], times, rate=20.0, targets=t)
    assert p.launch
    # 2 - 0.5 - 1.03 - 0.05 = 0.42 s of margin: it closes at 1/s for 0.05 s (the mean gap),
    # then at 2/s as the silence grows the gap too: late after 0.05 + 0.37 / 2 s
    p = plan([0.5, 0.1], times, rate=20.0, targets=t)
    assert not p.launch and p.wait_s == pytest.approx(0.235)
    # a request that misses anyway does not force a launch: its slack is not counted
    assert not plan([5.0, 0.1], times, rate=20.0, targets=t, window_max=10.0).launch
    # its own deadline counts the same way
    assert plan([0.95, 0.1], times, rate=20.0, e2e=[2.0, None]).launch


def test_a_newcomer_as_long_as_the_longest_recent_output_holds_a_trickle_batch():
    t = Targets(e2e=2.0)
    times = lambda b: BatchTimes(0.06, 0.01, 0.6)  # noqa: E731
    # at 1/s a newcomer as long as this member would meet the target behind its batch (0.6 + 0.6
    # <= 2 s): waiting for it gains nothing, the batch goes at once
    assert plan([0.0], times, rate=1.0, targets=t).launch
    # one as long as the longest recent output (1.5 s) would not (0.6 + 1.5 > 2 s), so the batch
    # waits for company while its member has slack: 2 - 0.6 - 1 s (the gap) = 0.4 s
    longest = lambda b: BatchTimes(0.15, 0.01, 1.5)  # noqa: E731
    p = plan_batch([0.0], [2.0], times, 32, 1.0, 0.0, t, 1.0, newcomer=longest)
    assert not p.launch and p.wait_s == pytest.approx(0.4)
    # not at a trickle (the next arrival due before the batch ends), nor with company: it goes
    assert plan_batch([0.0], [2.0], times, 32, 0.5, 0.0, t, 1.0, newcomer=longest).launch
    assert plan_batch([0.0, 0.0], [2.0, 2.0], times, 32, 1.0, 0.0, t, 1.0, newcomer=longest).launch


@pytest.mark.parametrize("targets", [Targets(), Targets(e2e=2.0), Targets(ttft=0.6, e2e=3.0)])
@pytest.mark.parametrize("waits", [[0.0], [0.3, 0.2, 0.0], [0.6] * 5, [0.05] * 12])
def test_the_wait_is_exact_when_nothing_arrives(targets, waits):
    """With no arrival, the plan says launch at wait_s and not a moment before."""
    times = linear(1.0, 0.01)
    p = plan(waits, times, rate=20.0, targets=targets, window_max=0.5)
    if p.launch:
        return
    later = lambda dt: plan([w + dt for w in waits], times, rate=20.0, targets=targets,  # noqa: E731
                            window_max=0.5, since=dt)
    assert not later(0.999 * p.wait_s).launch and later(p.wait_s + 1e-9).launch


def test_targets_cap_the_batch_where_a_fresh_request_would_miss():
    times = linear(1.0, 0.1)  # B(b) = 1 + 0.1 b, D(b) = 0.1 s
    assert slo_size(times, 32, Targets()) == 32
    assert slo_size(times, 32, Targets(e2e=2.0)) == 10  # 1 + 0.1 * 10 = 2.0
    assert slo_size(times, 32, Targets(ttft=0.151)) == 5  # F = 0.1 + 0.01 b
    assert slo_size(times, 32, Targets(e2e=0.5)) == 1  # none fits: one at a time
    assert slo_size(lambda b: BatchTimes(0.0, 0.001 * b, 0.1 * b), 64, Targets(tpot=0.016)) == 16
    p = plan([0.0] * 12, times, rate=1.0, targets=Targets(e2e=2.0))
    assert p.launch and p.size == 10  # the queue fills the SLO's batch


def test_a_load_the_targets_cannot_keep_pace_with_takes_the_pace_size():
    times, t = linear(1.0, 0.1), Targets(e2e=2.0)  # the SLO allows 10 a batch: 5/s at most
    assert pace_size(times, 32, 1 / 3.0, 0) == 5  # 3/s: 5 >= 3 x 1.5
    assert pace_size(times, 32, 1 / 6.0, 0) == 15  # 6/s: b >= 6 (1 + 0.1 b)
    assert pace_size(times, 32, 1 / 6.0, 20) == 19  # and 20 waiting: b >= 20 - b + 6 (1 + 0.1 b)
    assert pace_size(times, 32, 1 / 10.0, 0) == 32  # 10/s: none keeps pace, the cap
    assert batch_cap(times, 32, t, 1 / 3.0, 6, True) == (10, False)  # within reach: the SLO's size
    assert batch_cap(times, 32, t, 1 / 6.0, 20, True) == (19, True)
    assert batch_cap(times, 32, t, 1 / 6.0, 20, False) == (10, False)  # nobody overdue yet: a burst the SLO absorbs
    assert batch_cap(times, 32, Targets(tpot=0.2), 1 / 6.0, 20, True) == (32, False)
    # overdue: waited twice its target; out of reach, the batch keeps pace with the queue
    p = plan([4.0] + [0.5] * 19, times, rate=6.0, targets=t)
    assert p.launch and p.size == 19
    # nobody overdue: the rate size, 5 of those who waited 0.5 s meet 2 s in a batch of 5
    assert plan([3.9] + [0.5] * 19, times, rate=6.0, targets=t).size == 5
    # and launches by the rule without targets: 12 wait, 12 < 6 x B(12) = 13.2
    p = plan([4.0] + [0.0] * 11, times, rate=6.0, targets=t, window_max=5.0)
    assert not p.launch and p.size == 12


def test_the_rate_size_serves_the_most_in_time_per_second():
    times, t = linear(1.0, 0.1), Targets(e2e=2.0)  # B(b) = 1 + 0.1 b; the SLO allows 10
    fresh = [0.0] * 12
    # nobody has waited: the batch the SLO allows, the most a second (10 / 2.0 s)
    assert rate_size(times, 10, t, fresh, [2.0] * 12) == 10
    # 12 have waited 0.7 s: they meet 2 s in a batch of 3 at most (0.7 + 1.3), so 3 go
    assert rate_size(times, 10, t, [0.7] * 12, [2.0] * 12) == 3
    # 2 of them and a fresh one: a batch of 10 counts its 7 empty seats as newcomers, 8 in time
    # in 2 s against the 3 in 1.3 s of a batch that keeps the two
    assert rate_size(times, 10, t, [0.7] * 2 + [0.0], [2.0] * 3) == 10
    # nobody can make it: the most requests a second; no target: the cap
    assert rate_size(times, 10, t, [5.0] * 12, [2.0] * 12) == 10
    assert rate_size(times, 10, Targets(), [0.7] * 12, [None] * 12) == 10
    # no floor: 3 of the 12 who waited 0.7 s go, as above
    assert batch_cap(times, 32, t, math.inf, 12, False, [0.7] * 12, [2.0] * 12) == (3, False)
    # the floor: a long-run 4/s needs b >= 4 (1 + 0.1 b) / 0.85, b >= 9; those who waited 0.1 s
    # meet 2 s in a batch of 9, so it holds
    assert batch_cap(times, 32, t, math.inf, 12, False, [0.1] * 12, [2.0] * 12, long_gap=0.25) == (9, False)
    # but where the 12 have waited 0.7 s every size from 9 up makes all of them miss, and 3 of
    # them meet 2 s in a batch of 3: the floor gives way (it took 10, the most a second, before)
    assert batch_cap(times, 32, t, math.inf, 12, False, [0.7] * 12, [2.0] * 12, long_gap=0.25) == (3, False)
    # it gives way only to a batch that serves one of its own members in time: here the first
    # eight offered have waited 1.2 s and miss in any batch, and only the four behind them could
    # meet 2 s (in a batch of 7 or fewer), so the floor stands and the most a second goes
    late_first = [1.2] * 8 + [0.3] * 4
    assert batch_cap(times, 32, t, math.inf, 12, False, late_first, [2.0] * 12, long_gap=0.25) == (10, False)
    assert batch_cap(times, 32, t, 1.0, 12, False, [0.7] * 12, [2.0] * 12, long_gap=1.0) == (3, False)  # 1/s: f = 2


def test_a_floor_no_size_keeps_pace_with_serves_within_headroom_of_the_most():
    times, t = linear(1.0, 0.1), Targets(e2e=2.0)  # B(b) = 1 + 0.1 b; the SLO allows 10, 5/s at most
    assert floor_size(times, 10, 0.25 * 0.85) == 9  # 4/s kept at 85 %: b >= 4 (1 + 0.1 b) / 0.85
    # 10/s: none keeps pace; b / B(b) >= 0.85 x 5/s from b = 8 on, not the SLO's 10, where
    # B(10) = 2 s leaves no room for anyone who has waited
    assert floor_size(times, 10, 0.1 * 0.85) == 8
    # 12 have waited 0.1 s: they meet in batches up to 9 (0.1 + 1.9), so 9 go, not 10 that all miss
    assert batch_cap(times, 32, t, math.inf, 12, False, [0.1] * 12, [2.0] * 12, long_gap=0.1) == (9, False)
    # where batches are nearly free past a size (a GPU below its knee), the floor is near the top
    assert floor_size(lambda b: BatchTimes(0.0, 0.0, 1.0 + 0.001 * b), 64, 0.001) == 54


def test_late_requests_give_way_unless_they_ride_or_are_overdue():
    now_t, t = BatchTimes(0.1, 0.01, 1.0), Targets(e2e=2.0)  # late: waited more than 1 s
    waits = [4.5, 1.5, 1.2, 0.5, 0.1]
    longest = [99, 50, 10, 20, 30]
    # 0: late and overdue (4.5 s >= 2 x 2 s), first; 3, 4: on time; 2: late, no longer than
    # them, rides; 1: late, would lengthen the batch, left for a later one
    assert offer_order(waits, [2.0] * 5, longest, now_t, t) == [0, 3, 4, 2]
    assert offer_order(waits, [2.0, 2.0, 2.0, 2.0, 2.0], [99, 50, 10, 20, 60], now_t, t) == [0, 3, 4, 1, 2]
    # k, the overdue factor: at 3 the request that has waited 4.5 s is not overdue yet and waits;
    # at 0.75 both late ones that would lengthen the batch are (4.5 and 1.5 s >= 1.5 s), first
    assert offer_order(waits, [2.0] * 5, longest, now_t, Targets(e2e=2.0, overdue=3.0)) == [3, 4, 2]
    assert offer_order(waits, [2.0] * 5, longest, now_t, Targets(e2e=2.0, overdue=0.75)) == [0, 1, 3, 4, 2]
    # nobody on time, nobody late, or no target: the queue's order
    assert offer_order([1.5, 1.2], [2.0, 2.0], [50, 10], now_t, t) == [0, 1]
    assert offer_order([0.5, 0.1], [2.0, 2.0], [50, 10], now_t, t) == [0, 1]
    assert offer_order(waits, [None] * 5, longest, now_t, Targets()) == [0, 1, 2, 3, 4]
    # a request's own deadline makes it late; with a TTFT target alone, overdue at twice it
    assert offer_order([1.5, 0.5], [None, 1.2], [10, 50], now_t, t) == [0]  # no target of its own: on time
    ttft = Targets(ttft=0.5)  # late: waited more than 0.4 s
    assert offer_order([1.0, 0.6, 0.1], [None] * 3, [99, 99, 10], now_t, ttft) == [0, 2]


def test_a_request_that_misses_even_alone_is_late_and_goes_behind_the_others():
    now_t, t = BatchTimes(0.1, 0.01, 1.0), Targets(e2e=2.0)
    waits, e2e = [0.5, 0.2, 0.1], [2.0] * 3
    # the batch now (1 s) serves all three in time, but 1 alone takes 2.5 s: late, not overdue,
    # longer than those on time, so it neither rides nor sets the bound the others ride under
    assert offer_order(waits, e2e, [10, 400, 20], now_t, t, alone=[0.2, 2.5, 0.3]) == [0, 2]
    assert offer_order(waits, e2e, [10, 400, 20], now_t, t) == [0, 1, 2]  # its own length not counted
    # hopeless: misses its target even alone; behind the others, in queue order; overdue or
    # without a target it keeps its place
    assert hopeless_last([0.5, 0.2, 0.1, 1.7], e2e + [2.0], [0.2, 2.5, 0.3, 0.2], t) == [0, 2, 3, 1]
    assert hopeless_last([0.5, 4.2, 0.1], e2e, [2.5, 2.5, 2.5], t) == [1, 0, 2]  # 1 is overdue
    assert hopeless_last([0.5, 0.2], [None, None], [9.0, 9.0], Targets()) == [0, 1]


def test_an_empty_model_launches_everything_at_once():
    zero = lambda b: BatchTimes(0.0, 0.0, 0.0)  # noqa: E731 - the latency model before it is fitted
    p = plan([0.0] * 7, zero, rate=100.0, targets=Targets(e2e=1.0))
    assert p.launch and p.size == 7
    assert plan([], zero).size == 0 and not plan([], zero).launch


def test_batch_times_prefill_in_budget_steps_then_decodes():
    step = lambda tokens, seqs: 0.001 * tokens + 0.01  # noqa: E731
    t = batch_times(step, 4, 100.0, [10] * 4, token_budget=256)  # 400 tokens: 2 steps of 200
    assert t.first == pytest.approx(2 * (0.2 + 0.01))
    assert t.decode == pytest.approx(0.014)
    assert t.total == pytest.approx(t.first + 9 * 0.014)


def test_batch_times_run_fewer_rows_as_members_finish():
    step = lambda tokens, seqs: 0.01 * seqs  # noqa: E731 - a step costs its rows (a CPU past its knee)
    t = batch_times(step, 3, 10.0, [2, 5, 11], token_budget=1000)
    # 1 step of 3 rows (tokens 1 -> 2), 3 of 2 (-> 5), 6 of 1 (-> 11): the last result at token 11
    assert t.total - t.first == pytest.approx(0.03 + 3 * 0.02 + 6 * 0.01)
    assert t.decode == pytest.approx(0.03)  # the first decode step, all rows in
    assert decode_time(step, [1, 1, 1]) == 0.0 and decode_time(step, [4]) == pytest.approx(0.03)


def test_expected_lengths_from_max_tokens_and_recent_outputs():
    # outputs cut at their max_tokens (inf): members run to theirs, exactly
    assert expected_lengths([30, 5, 12], [math.inf] * 10) == [5, 12, 30]
    assert expected_lengths([30, 5, 12], []) == [5, 12, 30]
    # outputs ending well before max_tokens: the expected order statistics of b draws
    outs = list(range(1, 101))
    assert expected_lengths([1000] * 3, outs) == [26, 51, 76]
    assert expected_lengths([1000] * 9, outs)[-1] == 91 and expected_lengths([1000], outs) == [51]
    # a member's own max_tokens bounds it; a mix of cut and ended outputs lifts the top quantiles
    assert expected_lengths([1000, 1000, 20], outs) == [20, 51, 76]
    assert expected_lengths([1000] * 3, sorted(list(range(1, 51)) + [math.inf] * 50)) == [26, 1000, 1000]


def test_the_sorted_window():
    w = SortedWindow(size=3)
    for x in (5, 1, 9, 3):
        w.add(x)
    assert w.values == [1, 3, 9]  # the 5 left first


def test_ewma():
    assert ewma(None, 4.0, 0.5) == 4.0 and ewma(4.0, 2.0, 0.5) == 3.0
    with pytest.raises(ValueError):
        ewma(1.0, 1.0, 0.0)


def test_percentile_and_buckets():
    assert percentile([], 99) == 0.0
    assert percentile([5.0], 99) == 5.0
    xs = list(range(1, 101))
    assert percentile(xs, 50) == pytest.approx(50.5) and percentile(xs, 99) == pytest.approx(99.01)
    assert length_bucket(100, 20) == length_bucket(127, 31) != length_bucket(128, 20)
    assert bucket_distance(length_bucket(10, 10), length_bucket(2000, 10)) > bucket_distance(
        length_bucket(10, 10), length_bucket(30, 10))


def test_each_member_s_time_per_token_is_the_batch_s_decode_span_over_its_own_tokens():
    now_t, t = BatchTimes(0.1, 0.01, 1.1), Targets(tpot=0.02)  # B - F = 1 s: 0.02 s a token from 51 tokens
    # judged at one step's time everyone is on time; at their own lengths the 40-token one is late,
    # and misses its time per token here, so it does not ride: a batch of its length would meet it
    assert offer_order([0.0] * 3, [None] * 3, [101, 40, 300], now_t, t) == [0, 1, 2]
    assert offer_order([0.0] * 3, [None] * 3, [101, 40, 300], now_t, t, lengths=[101, 40, 300]) == [0, 2]
    # a one-token output has no time per token; its token is its result, held to the end (1.1 s)
    ttft = Targets(ttft=0.5)
    assert offer_order([0.0, 0.0], [None] * 2, [1, 5], now_t, ttft, lengths=[1, 5]) == [1, 0]  # late; rides
    assert offer_order([0.0, 0.0], [None] * 2, [1, 5], now_t, ttft) == [0, 1]


def test_a_tpot_target_groups_the_queue_by_output_length():
    t = Targets(tpot=0.05)
    lengths = [40, 4, 50, 5, 600, 33]
    # the head first, then the others by the ratio of their length to its: 33, 50, 5, 4, 600
    assert hopeless_last([0.0] * 6, [None] * 6, [0.1] * 6, t, lengths) == [0, 5, 2, 3, 1, 4]
    assert hopeless_last([0.0] * 6, [None] * 6, [0.1] * 6, Targets(e2e=9.0), lengths) == [0, 1, 2, 3, 4, 5]
    # the hopeless (0 and 3 miss 2 s even alone) stay behind, grouped by the length of the first
    # one offered (1, 4 tokens): 3, of 5 tokens, before 0, of 40
    both = Targets(tpot=0.05, e2e=2.0)
    assert hopeless_last([1.5, 0.0, 0.0, 0.0], [2.0] * 4, [1.0, 0.1, 0.1, 3.0], both, [40, 4, 50, 5]) == [1, 2, 3, 0]


def test_with_lengths_no_batch_is_larger_than_its_shortest_member_s_time_per_token_allows():
    lengths = [20, 22, 40, 200]  # in the order offered; a decode step takes 10 ms

    def times(b: int) -> BatchTimes:
        return BatchTimes(0.1, 0.01, 0.1 + 0.01 * (max(lengths[:b]) - 1))

    t = Targets(tpot=0.015)
    # with the 40-token one, the 20-token one gets 39 steps over 19 tokens (20.5 ms): the batch stops before it
    assert slo_size(times, 4, t, lengths) == 2
    assert slo_size(times, 4, t) == 4  # judged at one step's time, everything fits
    assert slo_size(times, 4, Targets(tpot=0.025), lengths) == 3
    # one-token members have no time per token, but the others still do: with the 40-token one
    # the 20-token one misses, whatever follows
    lengths[1:] = [40, 1, 1]
    assert slo_size(times, 4, t, lengths) == 1


def test_batch_times_can_price_each_prefill_step_as_whole_prompts():
    calls = []

    def whole(tokens: int, rows: int) -> float:
        calls.append((tokens, rows))
        return 0.5

    # 64 prompts of 512 tokens in steps of 8,192: four steps of 16 whole prompts each
    t = batch_times(lambda tokens, seqs: 0.01, 64, 512, [4] * 64, 8192, prompts=whole)
    assert calls == [(8192, 16)] and t.first == 4 * 0.5 and t.decode == 0.01
    assert batch_times(lambda tokens, seqs: 0.01, 64, 512, [4] * 64, 8192).first == 4 * 0.01


SHORT_LONG = [10.0] * 9 + [100.0]  # recent outputs that ended at EOS: a tenth long


def test_a_length_law_prices_a_batch_by_its_longest_member():
    law = LengthLaw(SHORT_LONG, 512)
    assert (law.xs, law.ps) == ([10.0, 100.0], pytest.approx([0.9, 0.1]))
    assert (law.cdf(9), law.cdf(50), law.cdf(100)) == (0.0, pytest.approx(0.9), pytest.approx(1.0))
    step = lambda tokens, seqs: 0.01  # noqa: E731
    # b = 2: both run to 10; past it one row runs while either is long, P = 1 - 0.9^2 = 0.19
    span, tokens = law.span(step, 2)
    assert span == pytest.approx(9 * 0.01 + 90 * 0.19 * 0.01)
    assert tokens == pytest.approx(0.81 * 10 + 0.19 * 100 - 1)  # E[M - 1]
    # a short member meets a 20 ms target only beside another short (19 >= M'), a long one always
    assert law.tpot_share(2, 0.01, 0.020) == pytest.approx(0.9 * 0.9 + 0.1)
    assert law.tpot_share(2, 0.03, 0.020) == 0.0  # one decode step already misses
    assert LengthLaw([math.inf] * 4, 64).xs == [64.0]  # cut at the bound: as long as it
    assert LengthLaw([1.0, 5.0], 64).tpot_share(8, 0.03, 0.020) == pytest.approx(0.5)  # one token: always


def test_lengths_known_to_no_one_size_the_batch_by_its_chance_of_a_long_member():
    """Constant 10 ms steps, no prefill: g(b) E[b / B(b)] peaks at b = 4 (6.43 requests in time a
    second against 6.33 at 3 and 6.40 at 5): a larger batch runs faster but more often holds a
    long output, past which every short member misses."""
    step = lambda tokens, seqs: 0.01  # noqa: E731
    times = lambda b: BatchTimes(0.0, 0.01, 0.01)  # noqa: E731
    law = LengthLaw(SHORT_LONG, 512)
    assert law_size(times, 32, 0.020, law, step) == 4
    assert law_size(times, 32, 0.020, LengthLaw([10.0] * 10, 512), step) == 32  # no long one: the largest
    assert law_size(times, 32, 0.020, law, step, long_gap=1 / 6.0) == 2  # 6/s: 2 keeps pace, 91 % in time
    # batch_cap takes it for a TPOT target alone, and not where a request has its own deadline
    t = Targets(tpot=0.020)
    assert batch_cap(times, 32, t, math.inf, 12, False, [0.0] * 12, [None] * 12, law=(law, step)) == (4, False)
    own = batch_cap(times, 32, t, math.inf, 12, False, [0.0] * 12, [5.0] * 12)
    assert own != (4, False) and batch_cap(times, 32, t, math.inf, 12, False, [0.0] * 12, [5.0] * 12,
                                           law=(law, step)) == own
    # no size meets the target (one step is 10 ms): the size that serves the most, the largest here
    assert law_size(times, 32, 0.005, law, step) == 32
    assert LengthLaw([100.0, 10.0, 10.0], 512).xs == [10.0, 100.0]  # in any order
