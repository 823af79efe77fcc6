"""Priority preemption, model-free (fake executor, virtual clock): a waiting request that outranks
a running one by the priority gap takes its seat (the victim keeps its KV blocks and resumes
where it stopped) or its blocks (the victim recomputes); the gap keeps equals from thrashing,
a bound caps how often one request is preempted, and every request still ends exactly once
with every block back."""
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchserve.config import LevelConfig, QueueConfig
from batchserve.request import SamplingParams


def run_to_end(eng, t=0.0, limit=10_000):
    outs = {}
    while eng.has_unfinished:
        for o in eng.step(now=t).outputs:
            if o.finished:
                outs[o.request_id] = o
        t += 0.01
        limit -= 1
        assert limit > 0, "did not drain"
    return outs, t


def long_low(eng, n, t=0.0, max_tokens=40):
    for i in range(n):
        eng.add_request([1, 2, 3], SamplingParams(max_tokens=max_tokens, ignore_eos=True), now=t,
                        request_id=f"low{i}", priority=1)


def test_full_running_set_gives_its_seat_to_the_urgent_request(make_fake_engine):
    eng = make_fake_engine(num_blocks=256, max_num_seqs=4)
    long_low(eng, 4)
    for k in range(3):
        eng.step(now=0.01 * k)
    eng.add_request([5, 6, 7, 8], SamplingParams(max_tokens=2, ignore_eos=True), now=0.03, request_id="hi", priority=9)
    eng.step(now=0.03)
    batch = eng.executor.batches[-1]
    assert "hi" in {s.request_id for s in batch.seqs} and len(batch.seqs) == 4  # joined at the next step
    st = eng.scheduler.waiting.stats(0.03)
    assert st.preemptions == {"priority": 1, "fairness": 0, "memory": 0} and st.recomputed_tokens == 0
    (victim,) = eng.scheduler.parked.values()
    assert victim.request_id == "low3" and victim.num_computed_tokens > 0  # the latest-arrived low one
    outs, _ = run_to_end(eng, 0.04)
    assert outs["hi"].finish_reason == "length"
    # the victim resumed where it stopped: no recomputation, and the same tokens as never preempted
    lows = [outs[f"low{i}"] for i in range(4)]
    assert all(o.finish_reason == "length" for o in lows)
    assert lows[3].token_ids == lows[0].token_ids
    assert eng.scheduler.waiting.stats(1.0).recomputed_tokens == 0


@pytest.mark.parametrize("gap,prio,preempts", [(1, 1, False), (1, 2, True), (3, 3, False), (3, 4, True), (0, 10, False)])
def test_the_priority_gap(make_fake_engine, gap, prio, preempts):
    eng = make_fake_engine(num_blocks=256, max_num_seqs=2, preempt_gap=gap)
    long_low(eng, 2)
    eng.step(now=0.0)
    eng.add_request([9, 9], SamplingParams(max_tokens=2, ignore_eos=True), now=0.01, request_id="new", priority=prio)
    eng.step(now=0.01)
    assert ("new" in {s.request_id for s in eng.executor.batches[-1].seqs}) == preempts
    assert eng.scheduler.num_preemptions == int(preempts)
    run_to_end(eng, 0.02)


def test_a_request_is_preempted_for_priority_at_most_max_preemptions_times(make_fake_engine):
    eng = make_fake_engine(num_blocks=256, max_num_seqs=1, max_preemptions=1)
    eng.add_request([1, 2], SamplingParams(max_tokens=50, ignore_eos=True), now=0.0, request_id="low", priority=0)
    eng.step(now=0.0)
    eng.add_request([3], SamplingParams(max_tokens=3, ignore_eos=True), now=0.01, request_id="a", priority=5)
    eng.step(now=0.01)
    assert eng.scheduler.running[0].request_id == "a"
    for k in range(2, 6):  # "a" finishes, "low" resumes
        eng.step(now=0.01 * k)
    assert eng.scheduler.running[0].request_id == "low"
    eng.add_request([4], SamplingParams(max_tokens=3, ignore_eos=True), now=0.06, request_id="b", priority=9)
    eng.step(now=0.06)
    assert eng.scheduler.running[0].request_id == "low"  # preempted once already: keeps its seat
    assert eng.scheduler.requests["low"].num_priority_preemptions == 1
    run_to_end(eng, 0.07)


def test_under_memory_pressure_the_victim_gives_up_its_blocks_and_recomputes(make_fake_engine):
    eng = make_fake_engine(num_blocks=8, block_size=4, max_num_seqs=8)
    for i in range(2):  # two low requests that will hold 3-4 blocks each
        eng.add_request([1] * 8, SamplingParams(max_tokens=8, ignore_eos=True), now=0.0, request_id=f"low{i}",
                        priority=0)
    for k in range(3):
        eng.step(now=0.01 * k)
    assert eng.kv.num_free_blocks <= 2
    eng.add_request([2] * 12, SamplingParams(max_tokens=2, ignore_eos=True), now=0.03, request_id="hi", priority=10)
    eng.step(now=0.03)
    assert "hi" in {s.request_id for s in eng.executor.batches[-1].seqs}
    st = eng.scheduler.waiting.stats(0.03)
    assert st.preemptions["priority"] >= 1 and st.recomputed_tokens > 0
    assert st.levels["default"].recomputed_tokens == st.recomputed_tokens
    outs, _ = run_to_end(eng, 0.04)
    assert sorted(outs) == ["hi", "low0", "low1"] and all(o.finish_reason == "length" for o in outs.values())
    assert outs["low0"].token_ids == outs["low1"].token_ids  # recomputed, same answer


def test_a_preempted_request_keeps_its_place(make_fake_engine):
    eng = make_fake_engine(num_blocks=256, max_num_seqs=1)
    eng.add_request([1], SamplingParams(max_tokens=5, ignore_eos=True), now=0.0, request_id="first", priority=2)
    eng.step(now=0.0)
    eng.add_request([1], SamplingParams(max_tokens=5, ignore_eos=True), now=0.01, request_id="second", priority=2)
    eng.add_request([1], SamplingParams(max_tokens=2, ignore_eos=True), now=0.01, request_id="hi", priority=8)
    order = []
    t = 0.01
    while eng.has_unfinished:
        eng.step(now=t)
        order.append(eng.scheduler.running[0].request_id if eng.scheduler.running else None)
        t += 0.01
    assert [x for i, x in enumerate(order) if x and (i == 0 or order[i - 1] != x)] == ["hi", "first", "second"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), seats=st.integers(1, 6), levels=st.booleans(), tight=st.booleans())
def test_no_request_waits_behind_a_lower_one_and_all_end_once(make_fake_engine, seed, seats, levels, tight):
    """Under random arrivals, after every step no waiting request has a request it outranks by the
    gap in the batch (unless memory is what is short, or that one has been preempted its most
    times); every request ends exactly once and every block comes back."""
    rng = random.Random(seed)
    queue = QueueConfig(levels=(LevelConfig("high", tuple(range(7, 11))), LevelConfig("mid", (4, 5, 6)),
                                LevelConfig("low", (0, 1, 2, 3))) if levels else (LevelConfig("one"),),
                        urgent_slack_ms=None)
    eng = make_fake_engine(num_blocks=12 if tight else 512, block_size=4, max_num_seqs=seats, queue=queue,
                           max_num_batched_tokens=64)
    sched = eng.scheduler
    ended, t, n = set(), 0.0, 0
    while n < 120 or eng.has_unfinished:
        for _ in range(rng.choice([0, 0, 1, 2]) if n < 120 else 0):
            eng.add_request([rng.randint(1, 99) for _ in range(rng.randint(1, 12))],
                            SamplingParams(max_tokens=rng.randint(1, 20), ignore_eos=True), now=t,
                            request_id=f"r{n}", priority=rng.randint(0, 10))
            n += 1
        for o in eng.step(now=t).outputs:
            if o.finished:
                assert o.request_id not in ended and o.finish_reason == "length"
                ended.add(o.request_id)
        batch = {s.request_id for s in eng.executor.batches[-1].seqs} if eng.executor.batches else set()
        if not tight:
            for w in sched.waiting:
                for rid in batch:
                    low = sched.requests.get(rid)
                    if low is not None and low.status.name == "RUNNING":
                        assert low.priority > w.priority - 1 or low.num_priority_preemptions >= 2, (w, low)
        t += 0.01
        assert t < 1000
    assert len(ended) == n
    eng.kv.check_all_free()
    assert not sched.parked
