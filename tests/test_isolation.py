"""Isolation of the important, model-free (fake executor whose step time grows with its tokens,
virtual clock): step ceilings keep the steps a running request shares within its level's
TPOT target or what its hard deadline can afford, whatever joins; soft deadlines are planned
so the answer arrives by the deadline; a warmed-up engine refuses an impossible hard deadline
before running anything."""
import random

import pytest

from batchserve.config import LevelConfig, QueueConfig
from batchserve.core.batch import ScheduledBatch, StepOutput
from batchserve.request import RequestStatus, SamplingParams
from tests.conftest import FakeExecutor

LEVELS = (LevelConfig("high", tuple(range(7, 11)), tpot_ms=6.0), LevelConfig("low", tuple(range(0, 7))))


class TokenCostExecutor(FakeExecutor):
    """A step costs 2 ms + 0.05 ms per token; with `clock`, execute advances it (wall-clock use)."""

    def __init__(self, num_blocks=512, clock=None):
        super().__init__(num_blocks)
        self.clock = clock

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        self.step_time = 0.002 + 0.00005 * batch.num_tokens
        if self.clock is not None:
            self.clock.set(self.clock.now() + self.step_time)
        return super().execute(batch)


def drive(eng, t=0.0, arrivals=(), limit=100_000):
    """Step on virtual time, adding (time, kwargs) arrivals when due; outputs by id, and the
    (step time, ids) of every step."""
    pending, done, steps = sorted(arrivals, key=lambda a: a[0]), {}, []
    while pending or eng.has_unfinished:
        while pending and pending[0][0] <= t:
            at, kw = pending.pop(0)
            eng.add_request(now=at, **kw)
        n = len(eng.executor.batches)
        for o in eng.step(now=t).outputs:
            if o.finished:
                done[o.request_id] = o
        if len(eng.executor.batches) > n:
            steps.append((eng.executor.step_time, {s.request_id for s in eng.executor.batches[-1].seqs}))
            t += eng.executor.step_time
        else:
            t += 0.001
        limit -= 1
        assert limit > 0
    return done, steps


def warm(eng, t=0.0):
    for i in range(3):
        eng.add_request([1] * (4 + 20 * i), SamplingParams(max_tokens=8 + 2 * i, ignore_eos=True), now=t, request_id=f"w{i}")
    _, steps = drive(eng, t)
    assert eng.scheduler.latency.ready
    return t + sum(s for s, _ in steps)


def flood(t0, n=12):
    """Long low-priority prompts arriving while the high request decodes."""
    return [(t0 + 0.002 * i, dict(prompt=[2] * 200, params=SamplingParams(max_tokens=3, ignore_eos=True),
                                  request_id=f"low{i}", priority=1)) for i in range(n)]


def high(t0):
    return [(t0, dict(prompt=[3] * 4, params=SamplingParams(max_tokens=40, ignore_eos=True), request_id="hi",
                      priority=9))]


def run(make_fake_engine, levels, policy):
    eng = make_fake_engine(num_blocks=512, executor=TokenCostExecutor(), queue=QueueConfig(levels=levels),
                           policy=policy, max_num_batched_tokens=512, chunk_size=128)
    t0 = warm(eng)
    done, steps = drive(eng, t0, high(t0) + flood(t0 + 0.01))
    hi_steps = [s for s, ids in steps if "hi" in ids][1:]  # after its own prompt
    return done, hi_steps


def test_a_tpot_target_keeps_long_prompts_out_of_the_important_requests_steps(make_fake_engine):
    for policy in ("continuous", "chunked"):
        done, hi_steps = run(make_fake_engine, LEVELS, policy)
        assert max(hi_steps) <= 0.006 + 1e-9, policy
        assert all(done[f"low{i}"].finish_reason == "length" for i in range(12))  # they still all run
        free, hi_free = run(make_fake_engine, (LevelConfig("high", tuple(range(7, 11))), LEVELS[1]), policy)
        assert max(hi_free) > 0.006  # without the target the flood's prompts share its steps
        assert done["hi"].finish_time <= free["hi"].finish_time + 1e-9
    # chunked keeps the flood moving in chunks that fit the target: the first low one is done early
    done, _ = run(make_fake_engine, LEVELS, "chunked")
    assert done["low0"].finish_time < done["hi"].finish_time


def test_a_running_hard_deadline_is_protected_from_what_joins(make_fake_engine):
    """Alone it needs 40 steps of 2.05 ms; its deadline affords steps of about 3 ms. Without
    the ceiling, less important 200-token prompts (12 ms steps) would make it miss."""
    eng = make_fake_engine(num_blocks=512, executor=TokenCostExecutor(), max_num_batched_tokens=512)
    t0 = warm(eng)
    target = [(t0, dict(prompt=[3] * 4, params=SamplingParams(max_tokens=40, ignore_eos=True), request_id="hi",
                        priority=5, deadline_ms=125, deadline_kind="hard"))]
    low = [(a, {**kw, "priority": 4}) for a, kw in flood(t0 + 0.01)]
    done, steps = drive(eng, t0, target + low)
    assert done["hi"].finish_reason == "length" and done["hi"].finish_time <= t0 + 0.125
    assert all(done[f"low{i}"].finish_reason == "length" for i in range(12))
    assert eng.queue_stats().deadline_wasted_tokens == 0


def test_soft_deadlines_are_planned_to_arrive_on_time(make_fake_engine):
    """Every request asks for more than its soft deadline allows, under a stream of others:
    the planned cut delivers them all by the deadline, each with a non-empty answer."""
    eng = make_fake_engine(num_blocks=1024, executor=TokenCostExecutor(1024), max_num_batched_tokens=512)
    t0 = warm(eng)
    arrivals = [(t0 + 0.004 * i, dict(prompt=[4] * (8 + 30 * (i % 4)), request_id=f"s{i}",
                                      params=SamplingParams(max_tokens=200, ignore_eos=True),
                                      deadline_ms=80, deadline_kind="soft")) for i in range(40)]
    done, _ = drive(eng, t0, arrivals)
    late = [o for o in done.values() if o.request_id.startswith("s") and o.finish_time > o.arrival_time + 0.080]
    assert not late
    assert all(done[f"s{i}"].finish_reason == "deadline_truncated" and done[f"s{i}"].token_ids for i in range(40))


def test_a_warmed_up_engine_refuses_an_impossible_hard_deadline_before_any_step(make_fake_engine):
    from batchserve.engine.clock import SimClock

    clock = SimClock()
    eng = make_fake_engine(executor=TokenCostExecutor(64, clock))
    eng.clock = clock
    eng.warm_up()
    assert eng.scheduler.latency.ready and not eng.has_unfinished
    assert eng.queue_stats().finished == 0 and eng.scheduler.num_steps == 0  # nothing of it stays
    ran = len(eng.executor.batches)
    eng.add_request([1] * 8, SamplingParams(max_tokens=50), now=clock.now(), request_id="x", deadline_ms=20,
                    deadline_kind="hard")
    (o,) = eng.step(now=clock.now()).outputs
    assert o.finish_reason == "deadline" and "cannot finish" in o.error
    assert len(eng.executor.batches) == ran  # refused without running a step
    eng.kv.check_all_free()


def test_a_request_that_cannot_start_does_not_hold_back_a_more_important_one(make_fake_engine):
    """Both seats hold long low requests; an aged low request heads the queue but cannot take a
    seat (it outranks no one). A high request behind it preempts a low one at once instead of
    waiting for the seats to free."""
    levels = (LevelConfig("high", tuple(range(7, 11))), LevelConfig("low", tuple(range(0, 7))))
    eng = make_fake_engine(num_blocks=512, executor=TokenCostExecutor(), max_num_seqs=2,
                           queue=QueueConfig(levels=levels, urgent_after_ms=20))
    long = SamplingParams(max_tokens=200, ignore_eos=True)
    arrivals = [(0.0, dict(prompt=[1] * 4, params=long, request_id=f"run{i}", priority=1)) for i in range(2)]
    arrivals += [(0.001, dict(prompt=[2] * 4, params=long, request_id="old", priority=1)),
                 (0.1, dict(prompt=[3] * 4, params=SamplingParams(max_tokens=5, ignore_eos=True),
                            request_id="hi", priority=9))]
    done, _ = drive(eng, 0.0, arrivals)
    assert done["hi"].first_token_time - done["hi"].arrival_time < 0.01
    assert all(done[r].finish_reason == "length" for r in ("run0", "run1", "old", "hi"))


def test_slow_first_tokens_do_not_end_a_hard_deadline_request_that_can_make_it(make_fake_engine):
    """More important 200-token prompts join the first steps of a hard-deadline request (12 ms
    steps against 2 ms alone). Its own early rate would predict a miss; the request ends well
    inside its deadline once they are gone, so it must not be ended."""
    eng = make_fake_engine(num_blocks=512, executor=TokenCostExecutor(), max_num_batched_tokens=512)
    t0 = warm(eng)
    arrivals = [(t0, dict(prompt=[3] * 4, params=SamplingParams(max_tokens=40, ignore_eos=True), request_id="hd",
                          priority=5, deadline_ms=250, deadline_kind="hard"))]
    arrivals += [(t0 + 0.0025 + 0.012 * i, dict(prompt=[2] * 200, params=SamplingParams(max_tokens=1), priority=8,
                                                request_id=f"big{i}")) for i in range(2)]
    done, _ = drive(eng, t0, arrivals)
    assert done["hd"].finish_reason == "length", done["hd"].error
    assert done["hd"].finish_time <= t0 + 0.25


def test_a_soft_deadline_answer_is_not_made_late_by_what_joins_its_last_step(make_fake_engine):
    """Less important 200-token prompts (12 ms steps against 2 ms) now and then beside
    soft-deadline requests whose answers are cut to their deadline: none may land on a cut
    answer's last step and make it late."""
    eng = make_fake_engine(num_blocks=2048, executor=TokenCostExecutor(2048), max_num_batched_tokens=512)
    t0 = warm(eng)
    arrivals = [(t0 + 0.043 * i, dict(prompt=[2] * 200, params=SamplingParams(max_tokens=2, ignore_eos=True),
                                      request_id=f"low{i}", priority=2)) for i in range(7)]
    arrivals += [(t0 + 0.003 + 0.023 * i, dict(prompt=[4] * 8, params=SamplingParams(max_tokens=200, ignore_eos=True),
                                               request_id=f"s{i}", priority=5, deadline_ms=40,
                                               deadline_kind="soft")) for i in range(10)]
    done, _ = drive(eng, t0, arrivals)
    for i in range(10):
        o = done[f"s{i}"]
        assert o.token_ids and o.finish_time <= o.arrival_time + 0.040 + 1e-9, (i, o.finish_time - o.arrival_time)


def test_refusals_resting_on_stale_slow_steps_are_retried_on_an_idle_engine(make_fake_engine):
    """Warm-up ran on a machine 50x slower than now. Soon after, a hard deadline the engine
    could now meet is refused on those steps; once they are old and the engine idle, the next
    is admitted, runs, and its steps put the latency model right for the one after."""
    from batchserve.engine.clock import SimClock

    class SlowAtFirst(TokenCostExecutor):
        slow = 50.0

        def execute(self, batch):
            out = super().execute(batch)
            self.step_time *= self.slow
            self.clock.set(self.clock.now() + self.step_time - self.step_time / self.slow)
            return out

    clock = SimClock()
    eng = make_fake_engine(executor=SlowAtFirst(64, clock))
    eng.clock = clock
    eng.warm_up()
    eng.executor.slow = 1.0
    hard = dict(params=SamplingParams(max_tokens=20, ignore_eos=True), deadline_ms=200, deadline_kind="hard")

    def run(rid, at):
        clock.set(at)
        eng.add_request([1] * 8, now=at, request_id=rid, **hard)
        while eng.has_unfinished:
            for o in eng.step(now=clock.now()).outputs:
                if o.finished:
                    return o

    t = clock.now()
    assert run("soon", t + 1).finish_reason == "deadline"  # steps 1 s old: trusted, refused
    later = run("later", t + 60)  # steps a minute old on an idle engine: not trusted
    assert later.finish_reason == "length" and later.finish_time <= later.arrival_time + 0.2
    assert run("next", clock.now() + 0.01).finish_reason == "length"  # judged on the new steps
    eng.kv.check_all_free()


def test_a_burst_of_prompts_that_has_passed_does_not_end_a_hard_deadline_request(make_fake_engine):
    """Four more important 400-token prompts join a hard-deadline request's steps after its
    third token (22 ms steps against 2 ms alone), then leave. At its ninth token its own rate
    so far predicts a miss, but the steps are fast again and it ends well inside its deadline:
    it must not be ended."""
    eng = make_fake_engine(num_blocks=512, executor=TokenCostExecutor(), max_num_batched_tokens=512)
    t0 = warm(eng)
    arrivals = [(t0, dict(prompt=[3] * 4, params=SamplingParams(max_tokens=60, ignore_eos=True), request_id="hd",
                          priority=5, deadline_ms=250, deadline_kind="hard"))]
    arrivals += [(t0 + 0.007, dict(prompt=[2] * 400, params=SamplingParams(max_tokens=1), priority=8,
                                   request_id=f"big{i}")) for i in range(4)]
    done, steps = drive(eng, t0, arrivals)
    assert sum(1 for s, ids in steps if "hd" in ids and s > 0.01) >= 4  # the burst did slow it
    assert done["hd"].finish_reason == "length", done["hd"].error
    assert done["hd"].finish_time <= t0 + 0.25


def test_queued_prompts_that_will_join_end_a_doomed_hard_deadline_request_at_once(make_fake_engine):
    """Ten more important 400-token prompts queue (one joins per step, 22 ms each) just after a
    hard-deadline request starts; its deadline cannot survive them. It is ended before their
    slow steps, not after they have shown in its own rate."""
    eng = make_fake_engine(num_blocks=1024, executor=TokenCostExecutor(1024), max_num_batched_tokens=512)
    t0 = warm(eng)
    arrivals = [(t0, dict(prompt=[3] * 4, params=SamplingParams(max_tokens=60, ignore_eos=True), request_id="hd",
                          priority=5, deadline_ms=150, deadline_kind="hard"))]
    arrivals += [(t0 + 0.003, dict(prompt=[2] * 400, params=SamplingParams(max_tokens=1), priority=8,
                                   request_id=f"big{i}")) for i in range(10)]
    done, steps = drive(eng, t0, arrivals)
    assert done["hd"].finish_reason == "deadline"
    assert sum(1 for s, ids in steps if "hd" in ids and s > 0.01) <= 1, "it paid for the prompts it could not survive"
    assert all(done[f"big{i}"].finish_reason == "length" for i in range(10))


def test_a_step_ceiling_cuts_less_important_prompts_instead_of_idling_their_seats(make_fake_engine):
    """A hard-deadline request can afford steps a little longer than its own, not the 12 ms of a
    whole 200-token prompt. The less important prompts queued behind it start anyway, cut to
    what its steps can take, so their first tokens come while it runs; and it still makes its
    deadline."""
    eng = make_fake_engine(num_blocks=1024, executor=TokenCostExecutor(1024), max_num_batched_tokens=512)
    t0 = warm(eng)
    arrivals = [(t0, dict(prompt=[3] * 4, params=SamplingParams(max_tokens=100, ignore_eos=True), request_id="hd",
                          priority=9, deadline_ms=400, deadline_kind="hard"))]
    arrivals += [(t0 + 0.004, dict(prompt=[2] * 200, params=SamplingParams(max_tokens=4, ignore_eos=True), priority=1,
                                   request_id=f"low{i}")) for i in range(4)]
    done, steps = drive(eng, t0, arrivals)
    assert done["hd"].finish_reason == "length", done["hd"].error
    assert done["hd"].finish_time <= t0 + 0.4
    half = t0 + (done["hd"].finish_time - t0) / 2
    started = sum(done[f"low{i}"].first_token_time < half for i in range(4))
    assert started >= 2, "the less important prompts waited for the hard-deadline request to end"


@pytest.mark.parametrize("deadline_ms, whole", [(1000, True), (100, False)])
def test_an_equal_prompt_joins_whole_when_the_running_deadline_has_slack(make_fake_engine, deadline_ms, whole):
    """A running hard-deadline request needs 40 steps of about 2 ms. An equal arrives with a
    300-token prompt (a 17 ms step). With a second of deadline its slack covers that step many
    times over: the equal's prompt runs in one step, so its first token is not spread over
    many (a per-token share of the slack would cut it to chunks of about 100). With 100 ms
    the slack is a few steps: the prompt is cut to chunks, and the running request keeps its
    deadline either way."""
    eng = make_fake_engine(num_blocks=512, executor=TokenCostExecutor(), max_num_batched_tokens=512)
    t0 = warm(eng)
    arrivals = [(t0, dict(prompt=[3] * 4, params=SamplingParams(max_tokens=40, ignore_eos=True), request_id="hd",
                          priority=9, deadline_ms=deadline_ms, deadline_kind="hard")),
                (t0 + 0.01, dict(prompt=[2] * 300, params=SamplingParams(max_tokens=4, ignore_eos=True),
                                 request_id="eq", priority=9))]
    done, steps = drive(eng, t0, arrivals)
    assert done["hd"].finish_reason == "length" and done["hd"].finish_time <= t0 + deadline_ms / 1000
    eq_steps = [s for s, ids in steps if "eq" in ids]
    prompt_steps = len(eq_steps) - (len(done["eq"].token_ids) - 1)  # the steps before its first token
    assert (prompt_steps == 1) == whole, prompt_steps


def test_a_long_soft_prompt_behind_a_step_ceiling_gets_its_seat_in_time(make_fake_engine):
    """Three seats: a high request with a hard deadline (its slack lets less important prompts
    add about 14 tokens a step) and two long soft-deadline answers. A soft request with a
    300-token prompt and a 100 ms deadline queues: its prompt needs some 20 steps in chunks
    under the ceiling, not the one step it would take alone, so a seat must be shared early
    enough for that. It gets an answer by its deadline; the shortened answers too."""
    eng = make_fake_engine(num_blocks=1024, executor=TokenCostExecutor(1024), max_num_seqs=3,
                           max_num_batched_tokens=512)
    t0 = warm(eng)
    soft = dict(deadline_kind="soft", priority=5)
    arrivals = [(t0, dict(prompt=[3] * 4, params=SamplingParams(max_tokens=200, ignore_eos=True), request_id="hd",
                          priority=9, deadline_ms=1000, deadline_kind="hard")),
                (t0, dict(prompt=[4] * 4, params=SamplingParams(max_tokens=500, ignore_eos=True), request_id="m0",
                          deadline_ms=300, **soft)),
                (t0, dict(prompt=[5] * 4, params=SamplingParams(max_tokens=500, ignore_eos=True), request_id="m1",
                          deadline_ms=300, **soft)),
                (t0 + 0.03, dict(prompt=[6] * 300, params=SamplingParams(max_tokens=50, ignore_eos=True),
                                 request_id="late", deadline_ms=100, **soft))]
    done, _ = drive(eng, t0, arrivals)
    late = done["late"]
    assert late.finish_reason == "deadline_truncated" and late.token_ids, late.error
    assert late.finish_time <= late.arrival_time + 0.100 + 1e-9
    assert done["hd"].finish_reason == "length" and done["hd"].finish_time <= t0 + 1.0
    for m in ("m0", "m1"):
        assert done[m].token_ids and done[m].finish_time <= t0 + 0.300 + 1e-9


@pytest.mark.parametrize("seed", range(12))
def test_random_floods_never_keep_a_high_request_waiting_past_a_step(make_fake_engine, seed):
    """Random arrivals: a flood of long low-priority answers at about five times what four
    seats serve, and short high-priority ones that alone fit the seats. No high request waits
    more than one step for its first scheduling (it preempts, the victim keeps its blocks), and
    every request ends exactly once with its blocks back (the KV-leak fixture)."""
    rng = random.Random(seed)
    eng = make_fake_engine(max_num_seqs=4, num_blocks=400)
    arrivals, t, th = [], 0.0, 0.0
    for i in range(60):
        t += rng.expovariate(20)
        arrivals.append((t, f"lo{i}", 1, rng.randint(20, 80)))
    for i in range(10):
        th += rng.uniform(0.1, 0.3)
        arrivals.append((th, f"hi{i}", 9, rng.randint(2, 6)))
    arrivals.sort()
    reqs, ended, k = {}, [], 0
    while k < len(arrivals) or eng.has_unfinished:
        now = eng.clock.now()
        while k < len(arrivals) and arrivals[k][0] <= now:
            _, rid, prio, n = arrivals[k]
            k += 1
            reqs[rid] = eng.add_request([1, 2, 3], SamplingParams(max_tokens=n, ignore_eos=True), now=now,
                                        request_id=rid, priority=prio)
        if eng.has_unfinished:
            ended += [o.request_id for o in eng.step(now=now).outputs if o.finished]
            eng.clock.set(now + eng.executor.step_time)
        else:
            eng.clock.set(arrivals[k][0])
    assert sorted(ended) == sorted(reqs)
    assert all(reqs[r].status == RequestStatus.FINISHED_LENGTH for r in reqs)
    waits = [r.first_scheduled_time - r.arrival_time for rid, r in reqs.items() if rid.startswith("hi")]
    assert max(waits) <= eng.executor.step_time + 1e-9
    assert any(r.num_preemptions for r in reqs.values())  # the seats were full: it preempted


class SeqCostExecutor(FakeExecutor):
    """A step costs 2 ms + 1 ms per sequence in it: decode-bound, as a CPU's big batches are."""

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        self.step_time = 0.002 + 0.001 * batch.num_seqs
        return super().execute(batch)


def test_less_important_decodes_sit_out_for_a_hard_deadline(make_fake_engine):
    """40 low-priority answers are decoding (42 ms steps) when a high-priority request with a
    hard deadline arrives: 20 tokens in 150 ms need steps of 7 ms. The low decodes sit out the
    steps its deadline cannot afford (keeping their seats and blocks), so it is admitted and
    answered in time; then every low answer ends in full."""
    eng = make_fake_engine(num_blocks=2048, executor=SeqCostExecutor(2048), max_num_seqs=64)
    t = 0.0
    for n in (1, 4, 16):  # the latency model sees steps of several sizes
        arr = [(t, dict(prompt=[1] * 4, params=SamplingParams(max_tokens=6, ignore_eos=True), request_id=f"w{n}-{i}"))
               for i in range(n)]
        _, steps = drive(eng, t, arr)
        t += sum(s for s, _ in steps) + 0.01
    assert eng.scheduler.latency.ready
    lows = [(t, dict(prompt=[2] * 4, params=SamplingParams(max_tokens=60, ignore_eos=True), request_id=f"low{i}",
                     priority=1)) for i in range(40)]
    hi = [(t + 0.2, dict(prompt=[3] * 4, params=SamplingParams(max_tokens=20, ignore_eos=True), request_id="hi",
                         priority=9, deadline_ms=150, deadline_kind="hard"))]
    done, steps = drive(eng, t, lows + hi)
    assert done["hi"].finish_reason == "length" and len(done["hi"].token_ids) == 20
    assert done["hi"].finish_time <= t + 0.2 + 0.150
    assert all(done[f"low{i}"].finish_reason == "length" and len(done[f"low{i}"].token_ids) == 60 for i in range(40))
    with_hi = [ids for _, ids in steps if "hi" in ids]
    assert min(len(ids) for ids in with_hi) < 10  # its decodes ran without the 40 low ones


def test_a_hard_deadline_starting_now_is_not_slowed_by_prompts_starting_beside_it(make_fake_engine):
    """Nothing runs; long low-priority prompts and a high-priority request with a hard deadline
    arrive together. Its 10 tokens in 40 ms afford steps of about 3.6 ms: the low prompts that
    start in its first step are cut to fit (alone they would make a 27 ms step), and every low
    answer still ends in full."""
    eng = make_fake_engine(num_blocks=1024, executor=TokenCostExecutor(1024), max_num_batched_tokens=512)
    t0 = warm(eng)
    lows = [(t0, dict(prompt=[2] * 200, params=SamplingParams(max_tokens=3, ignore_eos=True), request_id=f"low{i}",
                      priority=1)) for i in range(12)]
    hi = [(t0, dict(prompt=[3] * 4, params=SamplingParams(max_tokens=10, ignore_eos=True), request_id="hi",
                    priority=9, deadline_ms=40, deadline_kind="hard"))]
    done, steps = drive(eng, t0, lows + hi)
    assert done["hi"].finish_reason == "length" and done["hi"].finish_time <= t0 + 0.040
    assert max(s for s, ids in steps if "hi" in ids) <= 0.0037
    assert all(done[f"low{i}"].finish_reason == "length" for i in range(12))
