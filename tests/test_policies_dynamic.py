"""The `dynamic` policy with the fake executor and a virtual clock: when it launches a batch,
how large, and length bucketing."""
from __future__ import annotations

import math
import random

import pytest

from batchserve.config import SchedulerConfig
from tests.policy_helpers import SizedFakeExecutor, drive, req


def warm(eng, n=12, plen=4, out=10):
    """Bursts of 1 to 4 requests, far apart, until the step-time model is fitted on batches of
    several sizes."""
    for i in range(n):
        t = eng.clock.now() + 1.0
        eng.clock.set(t)
        drive(eng, [(t, req(f"w{i}-{k}", plen, out)) for k in range(1 + i % 4)])
    assert eng.scheduler.latency.ready


def members_of_each_batch(eng) -> list[set[str]]:
    """A list that fills, as the engine runs, with each batch's request ids as it forms."""
    pol, formed = eng.scheduler.policy, []
    form = pol._form

    def recording(sched, now):
        form(sched, now)
        formed.append({r.request_id for r in pol.members})

    pol._form = recording
    return formed


def batch_sizes(eng, arrivals):
    """Drive `arrivals`; the size of each batch the policy formed, in order."""
    formed = members_of_each_batch(eng)
    done = drive(eng, arrivals)
    assert len(done) == len(arrivals)
    return [len(ids) for ids in formed]


def test_dynamic_launches_a_lone_request_at_once_when_arrivals_are_slow(make_fake_engine):
    eng = make_fake_engine(policy="dynamic", window_max_ms=1000.0, num_blocks=512)
    eng.executor = SizedFakeExecutor(512)  # a step of b sequences takes 4 + 2 b ms
    warm(eng)
    t = eng.clock.now() + 5.0
    eng.clock.set(t)
    eng.add_request(now=t, **req("lone", 4, 10))
    assert eng.step(now=t).ran is not None  # no window: a batch of one keeps pace with a trickle
    drive(eng)


def test_dynamic_batches_grow_with_the_arrival_rate(make_fake_engine):
    """B(b) = 10 decodes x (4 + 2 b) ms: the size that keeps pace is about 1 at 10/s, 8 at 40/s."""
    def mean_size(rate: float) -> float:
        eng = make_fake_engine(policy="dynamic", window_max_ms=1000.0, max_batch=32, num_blocks=1024)
        eng.executor = SizedFakeExecutor(1024)
        warm(eng)
        t0 = eng.clock.now() + 1.0
        eng.clock.set(t0)
        sizes = batch_sizes(eng, [(t0 + i / rate, req(f"r{i}", 4, 10)) for i in range(120)])
        return sum(sizes[3:]) / len(sizes[3:])

    slow, fast = mean_size(10.0), mean_size(40.0)
    assert slow < 2.0 and fast > 4 * slow


def test_dynamic_tpot_target_caps_the_batch_and_no_target_does_not(make_fake_engine):
    def sizes(**slo) -> list[int]:
        eng = make_fake_engine(policy="dynamic", max_batch=32, window_max_ms=20.0, num_blocks=1024, **slo)
        eng.executor = SizedFakeExecutor(1024)  # a decode step of 8 takes 20 ms, of 9 22 ms
        warm(eng)
        t = eng.clock.now() + 1.0
        eng.clock.set(t)
        return batch_sizes(eng, [(t, req(f"b{i}", 4, 10)) for i in range(30)])

    assert max(sizes(slo_tpot_ms=21.0)) == 8
    assert sizes() == [30]  # no target: one batch takes everything waiting


def test_dynamic_launches_when_a_deadline_has_no_slack_left(make_fake_engine):
    """Arrivals too fast to keep pace with (one every ms): a batch waits for company until it
    is full (128 here), unless a member with a deadline would miss it by
    waiting for the next arrival."""
    eng = make_fake_engine(policy="dynamic", max_batch=128, max_num_seqs=128, window_max_ms=1000.0,
                           num_blocks=1024)
    eng.executor = SizedFakeExecutor(1024, per_seq=0.0002)  # a batch of 128 takes 10 x 30 ms
    warm(eng)
    pol = eng.scheduler.policy
    formed, form = [], pol._form

    def recording(sched, now):
        form(sched, now)
        formed.append((now, {r.request_id for r in pol.members}))

    pol._form = recording
    t0 = eng.clock.now() + 1.0
    eng.clock.set(t0)
    arrivals = [(t0 + 0.001 * i, req(f"c{i}", 4, 10)) for i in range(500)]
    arrivals.append((t0 + 0.05, dict(deadline_ms=300.0, deadline_kind="soft", **req("dl", 4, 10))))
    done = drive(eng, arrivals, dt=0.001)
    launched = next(t for t, ids in formed if "dl" in ids)
    assert launched < t0 + 0.35 - 0.2  # in time for its deadline, not when the batch filled
    out = done["dl"][0]
    # launched at the last arrival it could wait for: whole, or one token short where the soft
    # deadline's own planning ends it a step early
    assert len(out.token_ids) >= 9 and out.finish_time - out.arrival_time <= 0.3
    assert max(len(ids) for _, ids in formed) == 128  # the others did wait for full batches


def test_dynamic_length_buckets_cut_padding(make_fake_engine):
    def run(bucket: bool) -> float:
        eng = make_fake_engine(policy="dynamic", max_batch=4, window_max_ms=50.0, bucket_by_length=bucket,
                               num_blocks=1024)
        rng = random.Random(1)
        arrivals = []
        for i in range(32):  # two classes, interleaved
            short = i % 2 == 0
            plen, m = (rng.randint(3, 6), rng.randint(2, 4)) if short else (rng.randint(40, 60), rng.randint(20, 30))
            arrivals.append((0.0, req(f"r{i}", plen, m)))
        done = drive(eng, arrivals)
        assert len(done) == 32
        return eng.scheduler.policy.padding_fraction

    plain, bucketed = run(False), run(True)
    assert bucketed < 0.5 * plain


def test_dynamic_a_late_request_that_would_lengthen_the_batch_waits_for_a_later_one(make_fake_engine):
    """SLO 1 s end to end. While a long batch runs, a long and a short request wait past it;
    two short ones come near its end. The next batch takes the two on time and the short late
    one (it ends no later); the long late one goes after, alone."""
    eng = make_fake_engine(policy="dynamic", max_batch=32, window_max_ms=50.0, num_blocks=1024, slo_p99_ms=1000.0)
    eng.executor = SizedFakeExecutor(1024)  # a step of b sequences takes 4 + 2 b ms
    warm(eng)
    formed = members_of_each_batch(eng)
    t = eng.clock.now() + 1.0
    eng.clock.set(t)
    done = drive(eng, [(t, req("first", 4, 200)),  # 200 steps of 6 ms: 1.2 s
                       (t + 0.01, req("late-long", 4, 100)), (t + 0.01, req("late-short", 4, 10)),
                       (t + 1.0, req("on-1", 4, 10)), (t + 1.0, req("on-2", 4, 10))])
    assert formed == [{"first"}, {"on-1", "on-2", "late-short"}, {"late-long"}]
    for rid in ("on-1", "on-2"):
        out = done[rid][0]
        assert out.finish_time - out.arrival_time <= 1.0


def test_dynamic_a_request_that_misses_even_alone_does_not_shrink_the_batch(make_fake_engine):
    """SLO 1 s end to end; six requests at once, the fourth with 200 tokens to write (1.2 s
    alone). In queue order every batch of four or more ends past the SLO, so batches of three
    would go and the long one would hold the two behind it past theirs; counted by its own
    length it is hopeless, goes behind, and the five short ones go together, all in time."""
    eng = make_fake_engine(policy="dynamic", max_batch=32, window_max_ms=50.0, num_blocks=1024, slo_p99_ms=1000.0)
    eng.executor = SizedFakeExecutor(1024)  # a step of b sequences takes 4 + 2 b ms
    warm(eng)
    t = eng.clock.now() + 1.0
    eng.clock.set(t)
    formed = members_of_each_batch(eng)
    names = ["s1", "s2", "s3", "long", "s4", "s5"]
    done = drive(eng, [(t, req(n, 4, 200 if n == "long" else 10)) for n in names])
    assert formed == [{"s1", "s2", "s3", "s4", "s5"}, {"long"}]
    assert all(done[n][0].finish_time - done[n][0].arrival_time <= 1.0 for n in names if n != "long")


def test_dynamic_fit_is_judged_at_the_longest_output_the_batch_had(make_fake_engine):
    """The step-time model is exact here: an output far longer than the recent ones makes its
    batch longer than predicted, but is no error of the model's, and does not scale the
    predictions that follow."""
    eng = make_fake_engine(policy="dynamic", window_max_ms=50.0, num_blocks=1024)
    eng.executor = SizedFakeExecutor(1024)
    warm(eng)  # outputs of 10 tokens
    t = eng.clock.now() + 1.0
    eng.clock.set(t)
    drive(eng, [(t, req("long", 4, 100))])
    assert 0.8 < eng.scheduler.policy.fit < 1.25


def test_dynamic_a_load_beyond_the_slo_batches_gets_batches_that_keep_pace(make_fake_engine):
    """SLO 200 ms end to end: a batch of b (10 steps of 4 + 2 b ms) meets it up to b = 8, which
    serves 40/s. Below that the SLO sizes the batches; at 45/s the batches it allows fall behind,
    and once a request has waited twice the SLO the controller takes the size that keeps pace
    instead of letting the queue grow."""
    def run(rate: float) -> tuple[list[int], float]:
        eng = make_fake_engine(policy="dynamic", max_batch=32, window_max_ms=50.0, num_blocks=2048,
                               slo_p99_ms=200.0)
        eng.executor = SizedFakeExecutor(2048)
        warm(eng)
        t0 = eng.clock.now() + 1.0
        eng.clock.set(t0)
        arrivals = [(t0 + i / rate, req(f"r{i}", 4, 10)) for i in range(int(6 * rate))]
        sizes = batch_sizes(eng, arrivals)
        return sizes, eng.clock.now() - arrivals[-1][0]

    within, _ = run(25.0)
    assert max(within) <= 8
    beyond, drain = run(45.0)
    # batches of 8 fall behind until requests have waited twice the SLO; from then on the batches
    # keep pace (not 8s, then one of 32 when the overdue go first whatever it costs)
    assert sum(b > 8 for b in beyond) >= 5 and max(beyond) < 32
    assert drain < 0.7  # the queue at the end is a batch or two, not the backlog of a lost second


def test_dynamic_through_a_burst_serves_the_on_time_first(make_fake_engine):
    """An engine whose batch time grows with its size (10 steps of 1 + 2 b ms: a CPU past its
    knee), 60 requests in 0.3 s, 450 ms end to end. The SLO's largest batch (22) makes everyone
    behind it wait 450 ms and miss; the controller runs smaller batches of those still on time
    and leaves the late for after the burst, so more answers come within the SLO than under
    either fixed cap."""
    def good(policy: str, **kw) -> int:
        eng = make_fake_engine(policy=policy, num_blocks=2048, slo_p99_ms=450.0, **kw)
        eng.executor = SizedFakeExecutor(2048, base=0.001, per_seq=0.002)
        warm(eng)
        t0 = eng.clock.now() + 1.0
        eng.clock.set(t0)
        done = drive(eng, [(t0 + i / 200.0, req(f"r{i}", 4, 10)) for i in range(60)])
        assert len(done) == 60
        return sum(o.finish_time - o.arrival_time <= 0.45 for o, _ in done.values())

    adaptive = good("dynamic", max_batch=32, window_max_ms=50.0)
    fixed = {c: good("static", max_batch=c, window_ms=0.0) for c in (11, 22)}
    assert adaptive > 1.5 * max(fixed.values()), (adaptive, fixed)


@pytest.mark.parametrize("factor, formed_after", [(2.0, [{"on-1", "on-2", "late-short"}, {"late-long"}]),
                                                  (1.0, [{"late-long", "on-1", "on-2", "late-short"}])])
def test_dynamic_the_overdue_factor_bounds_how_long_a_late_request_is_held_back(make_fake_engine, factor,
                                                                               formed_after):
    """The scene above: the long late request has waited 1.2 s of its 1 s SLO when the first
    batch ends. Held back until twice its target (the default), it goes alone after the others;
    at once its target (`overdue_factor` 1) it is overdue and goes first, with them."""
    eng = make_fake_engine(policy="dynamic", max_batch=32, window_max_ms=50.0, num_blocks=1024, slo_p99_ms=1000.0,
                           overdue_factor=factor)
    eng.executor = SizedFakeExecutor(1024)
    warm(eng)
    formed = members_of_each_batch(eng)
    t = eng.clock.now() + 1.0
    eng.clock.set(t)
    drive(eng, [(t, req("first", 4, 200)), (t + 0.01, req("late-long", 4, 100)), (t + 0.01, req("late-short", 4, 10)),
                (t + 1.0, req("on-1", 4, 10)), (t + 1.0, req("on-2", 4, 10))])
    assert formed == [{"first"}] + formed_after


def test_the_overdue_factor_must_be_positive_and_finite():
    for bad in (0.0, -1.0, math.inf):
        with pytest.raises(ValueError, match="overdue_factor"):
            SchedulerConfig(policy="dynamic", overdue_factor=bad)


def test_dynamic_prices_each_request_by_its_own_prompt():
    """A short request that has waited 1.5 s of its 3 s target, with four 2,000-token prompts
    queued behind it: by itself it ends in 0.27 s, in time, so it is not hopeless and goes
    first; priced at the queue's mean prompt it would be sent behind the long ones."""
    from types import SimpleNamespace as NS

    from batchserve.core.policies.dynamic import DynamicPolicy

    class Linear:  # 10 ms a step + 1 ms a token: prompts dominate
        ready = True

        def predict_step(self, tokens: int, seqs: int) -> float:
            return 0.010 + 0.001 * tokens

    now = 100.0

    def waiting(rid: str, arrived: float, prompt: int) -> NS:
        return NS(request_id=rid, arrival_time=arrived, num_prompt_tokens=prompt, max_tokens=20, deadline_ms=None)

    queue = [waiting("short", now - 1.5, 50)] + [waiting(f"long{i}", now, 2000) for i in range(4)]
    sched = NS(waiting=queue, latency=Linear(), config=NS(max_num_seqs=32, max_num_batched_tokens=8192))
    pol = DynamicPolicy(SchedulerConfig(policy="dynamic", max_batch=32, slo_p99_ms=3000.0))
    pol.mean_gap_s, pol.last_arrival = 0.5, now
    pol.update_controls(sched, now)
    assert [q.request_id for q in (pol.offered or queue)][0] == "short"
    assert pol.plan.launch and pol.plan.size == 1  # it goes now, alone: with a long prompt it would miss


def test_dynamic_a_tpot_target_keeps_short_outputs_out_of_long_batches(make_fake_engine):
    """A member's result is held until its batch ends, so a 4-token output in a batch with a
    40-token one gets 39 steps over its 3 tokens: with a TPOT target each member is priced at
    its own length, the batches are grouped by it, and every member meets the target. Judged at
    the longest member's step time instead, shorts and longs were batched in arrival order."""
    eng = make_fake_engine(policy="dynamic", max_batch=32, window_max_ms=20.0, num_blocks=1024, slo_tpot_ms=30.0)
    eng.executor = SizedFakeExecutor(1024)  # a decode step of b takes 4 + 2 b ms
    warm(eng, out=40)
    formed = members_of_each_batch(eng)
    t = eng.clock.now() + 1.0
    eng.clock.set(t)
    arrivals = [(t + 0.001 * i, req(f"{'sl'[i % 2]}{i}", 4, (4, 40)[i % 2])) for i in range(20)]
    done = drive(eng, arrivals)
    assert len(done) == 20 and len(formed) >= 2
    assert all(len({rid[0] for rid in ids}) == 1 for ids in formed)  # shorts and longs apart
    tpot = {rid: (o.finish_time - o.first_token_time) / (len(o.token_ids) - 1) for rid, (o, _) in done.items()}
    assert max(tpot.values()) <= 0.030


@pytest.mark.parametrize("outputs, size", [([10] * 90 + [100] * 10, 4), ([10] * 100, 20), ([math.inf] * 100, 20)])
def test_dynamic_with_lengths_known_to_no_one_sizes_by_the_chance_of_a_long_output(outputs, size):
    """Twenty requests that each ask for 512 tokens, a 20 ms TPOT target and 10 ms steps. Where a
    tenth of recent outputs ran 100 tokens and the rest 10 (they ended at EOS), a batch of 4
    serves the most in time per second: larger ones more often hold a long output, past which
    every short member misses. With every output 10 tokens, or every one cut at its max_tokens
    (lengths then known), the whole queue goes."""
    from types import SimpleNamespace as NS

    from batchserve.core.policies.dynamic import DynamicPolicy

    class Flat:
        ready = True

        def predict_step(self, tokens: int, seqs: int) -> float:
            return 0.010

    now = 100.0
    queue = [NS(request_id=f"r{i}", arrival_time=now, num_prompt_tokens=4, max_tokens=512, deadline_ms=None)
             for i in range(20)]
    sched = NS(waiting=queue, latency=Flat(), config=NS(max_num_seqs=32, max_num_batched_tokens=8192))
    pol = DynamicPolicy(SchedulerConfig(policy="dynamic", max_batch=32, slo_tpot_ms=20.0))
    for x in outputs:
        pol.outputs.add(x)
    pol.mean_gap_s, pol.last_arrival = 0.001, now
    pol.update_controls(sched, now)
    assert pol.plan.launch and pol.plan.size == size
