"""Hard and soft deadlines and the online latency model, with a fake executor
and a virtual clock: a hard miss ends the request at admission, in the queue or while
running, and frees its blocks at once; a soft miss truncates instead."""
import pytest

from batchserve.core.batch import ScheduledBatch, StepOutput
from batchserve.core.latency import OnlineLinearModel, service_time, tokens_within
from batchserve.request import RequestStatus, SamplingParams
from tests.conftest import FakeExecutor


class LoadedExecutor(FakeExecutor):
    """Step time grows with the batch: 5 ms + 5 ms per sequence."""

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        self.step_time = 0.005 + 0.005 * batch.num_seqs
        return super().execute(batch)


def drive(eng, until=None, log=None):
    """Step on the engine's virtual clock; returns finished outputs by id. `log` collects
    (start time, ids in the batch) for every step."""
    done = {}
    while eng.has_unfinished and (until is None or eng.clock.now() < until):
        t = eng.clock.now()
        n = len(eng.executor.batches)
        for o in eng.step(now=t).outputs:
            if o.finished:
                assert o.request_id not in done
                done[o.request_id] = o
        ran = eng.executor.batches[n:]
        if log is not None and ran:
            log.append((t, [s.request_id for s in ran[0].seqs]))
        eng.clock.set(t + (eng.executor.step_time if ran else 0.001))
    return done


def warm_up(eng, n=3):
    """Run a few requests of different lengths so the latency model has seen real steps of
    several batch sizes."""
    for i in range(n):
        eng.add_request([1, 2, 3], SamplingParams(max_tokens=5 + 2 * i), now=eng.clock.now(),
                        request_id=f"warm{i}")
    drive(eng)
    assert eng.scheduler.latency.ready


def test_latency_model_fits_steps_and_predicts_service():
    m = OnlineLinearModel()
    assert m.predict_step(100, 4) == 0.0  # knows nothing yet: never a reason to kill
    for tokens, seqs in [(1, 1), (4, 4), (100, 2), (300, 8), (8, 8), (50, 1), (2, 2), (700, 16), (16, 16)]:
        m.observe(tokens, seqs, 0.002 + 1e-5 * tokens + 5e-4 * seqs)
    c, a, b = m.coefficients()
    assert (c, a, b) == pytest.approx((0.002, 1e-5, 5e-4), rel=1e-3)
    assert m.predict_step(1000, 10) == pytest.approx(0.002 + 0.01 + 0.005, rel=1e-3)
    # 20-token prompt then 9 more decodes, in a batch of 4
    step = m.predict_step(4, 4)
    assert service_time(m, 20, 10, 4, 2048) == pytest.approx(m.predict_step(23, 4) + 9 * step)
    assert tokens_within(m, m.predict_step(23, 4) + 2.5 * step, 20, 4, 2048) == 3
    assert tokens_within(m, -1.0, 20, 4, 2048) == 0


def test_latency_model_decode_only_steps_and_noise():
    m = OnlineLinearModel()
    for n in range(1, 30):  # tokens == seqs: slopes not separable, predictions still exact
        m.observe(n, n, 0.01 + 0.001 * n)
    assert m.predict_step(12, 12) == pytest.approx(0.022, rel=1e-6)
    m = OnlineLinearModel()
    for n in range(20):  # step time that does not depend on size: no negative slopes
        m.observe(n * 50, 1 + n % 3, 0.01 + (0.001 if n % 2 else -0.001))
    _, a, b = m.coefficients()
    assert a >= 0 and b >= 0 and m.predict_step(10_000, 64) < 0.02


def test_hard_deadline_ends_at_admission_when_it_cannot_make_it(make_fake_engine):
    eng = make_fake_engine()
    warm_up(eng)
    t = eng.clock.now()
    # 10 ms per step: 50 tokens need ~500 ms; 200 ms is hopeless, 2 s is fine
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=50), now=t, request_id="doomed", deadline_ms=200)
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=50), now=t, request_id="ok", deadline_ms=2000)
    assert eng.scheduler.requests.keys() == {"ok"}
    outs = {o.request_id: o for o in eng.step(now=t).outputs if o.finished}
    assert outs["doomed"].finish_reason == "deadline" and "cannot finish" in outs["doomed"].error
    assert outs["doomed"].token_ids == [] and outs["doomed"].first_scheduled_time is None
    done = drive(eng)
    assert done["ok"].finish_reason == "length" and done["ok"].finish_time <= t + 2.0
    assert eng.scheduler.waiting.stats(eng.clock.now()).deadline_misses == {"hard": 1, "soft": 0}


def test_hard_deadline_in_queue_never_scheduled(make_fake_engine):
    eng = make_fake_engine(max_num_seqs=1)  # one seat: the second request must wait
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=30), now=0.0, request_id="hog", priority=9)
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=2), now=0.0, request_id="waiter", priority=1,
                    deadline_ms=95)
    log = []
    done = drive(eng, log=log)
    w = done["waiter"]
    assert w.finish_reason == "deadline" and w.first_scheduled_time is None and w.token_ids == []
    # the model is ready after 8 steps (t = 80 ms) and sees that 2 more steps overshoot 95 ms
    assert w.finish_time == pytest.approx(0.08) and "cannot finish" in w.error
    assert all("waiter" not in ids for _, ids in log)
    assert done["hog"].finish_reason == "length"


def test_hard_deadline_while_running_frees_blocks_at_once(make_fake_engine):
    """Before the latency model is fitted, the one measured step already says that 39 more
    10 ms steps cannot fit in 45 ms: it ends after that step, not at its deadline, and its
    blocks come back in the same step."""
    eng = make_fake_engine(num_blocks=32)
    eng.add_request(list(range(1, 9)), SamplingParams(max_tokens=40), now=0.0, request_id="late", deadline_ms=55)
    log = []
    done = drive(eng, log=log)
    o = done["late"]
    assert o.finish_reason == "deadline" and "cannot finish" in o.error
    assert len(o.token_ids) == 1 and o.finish_time == pytest.approx(0.01)
    assert [t for t, ids in log if "late" in ids] == [0.0]
    assert eng.kv.num_free_blocks == eng.kv.num_blocks
    assert eng.queue_stats().deadline_wasted_tokens == 8  # its prompt: all it cost


def test_hard_deadline_passed_ends_it_even_with_no_prediction(make_fake_engine):
    """A step slower than any before it: the deadline itself ends the request, which is never
    scheduled at or after it."""
    eng = make_fake_engine(num_blocks=32)
    eng.add_request(list(range(1, 9)), SamplingParams(max_tokens=3), now=0.0, request_id="late", deadline_ms=15)
    eng.step(now=0.0)
    outs = eng.step(now=0.02).outputs  # the first step ended at 20 ms
    (o,) = [o for o in outs if o.finished]
    assert o.finish_reason == "deadline" and "missed" in o.error and o.finish_time == 0.02
    assert len(eng.executor.batches) == 1
    assert eng.kv.num_free_blocks == eng.kv.num_blocks


def test_hard_deadline_while_running_by_prediction(make_fake_engine):
    """More important requests join after it, so steps slow down (a step ceiling only holds
    back the less important and equals): the model sees it and ends the request before its
    deadline, freeing its blocks while the others run on."""
    eng = make_fake_engine(num_blocks=256, executor=LoadedExecutor(256))
    warm_up(eng, n=4)
    t0 = eng.clock.now()
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=30), now=t0, request_id="target", deadline_ms=400)
    eng.step(now=t0)  # alone: ~10 ms per step, 30 tokens fit in 400 ms
    eng.clock.set(t0 + eng.executor.step_time)
    assert "target" in eng.scheduler.requests
    for i in range(10):
        eng.add_request([1, 2, 3], SamplingParams(max_tokens=40), now=eng.clock.now(), request_id=f"crowd{i}",
                        priority=7)
    done = {}
    while "target" not in done:
        held = len(eng.kv.block_table("target"))
        t = eng.clock.now()
        done.update({o.request_id: o for o in eng.step(now=t).outputs if o.finished})
        eng.clock.set(t + eng.executor.step_time)
    o = done["target"]
    assert o.finish_reason == "deadline" and "cannot finish" in o.error
    assert o.finish_time < t0 + 0.4 and 0 < len(o.token_ids) < 30
    assert held > 0 and not eng.kv.has("target")  # its blocks went back in the step it ended
    assert len(eng.scheduler.running) == 10  # the others run on
    drive(eng)


def test_step_ending_past_hard_deadline_fails(make_fake_engine):
    eng = make_fake_engine()
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=1), now=0.0, request_id="r", deadline_ms=5)
    outs = {o.request_id: o for o in eng.step(now=0.0).outputs}  # the step takes 10 ms
    assert outs["r"].finish_reason == "deadline" and outs["r"].token_ids == []
    assert eng.kv.num_free_blocks == eng.kv.num_blocks


def test_soft_deadline_truncates_near_the_deadline(make_fake_engine):
    eng = make_fake_engine()
    warm_up(eng)
    t0 = eng.clock.now()
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=50), now=t0, request_id="soft",
                    deadline_ms=150, deadline_kind="soft")
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=50), now=t0, request_id="free")
    done = drive(eng)
    s = done["soft"]
    assert s.finish_reason == "deadline_truncated" and s.error is None
    assert 5 <= len(s.token_ids) < 50  # the text so far, not a failure
    assert s.token_ids == list(range(6, 6 + len(s.token_ids)))
    assert abs(s.finish_time - (t0 + 0.15)) <= 0.02  # ends near its deadline
    assert done["free"].finish_reason == "length" and len(done["free"].token_ids) == 50
    st = eng.scheduler.waiting.stats(eng.clock.now())
    assert st.truncated == 1 and st.deadline_misses["soft"] == 1 and st.deadline_misses["hard"] == 0


def test_soft_deadline_without_model_and_after_queueing(make_fake_engine):
    """No fitted model: the measured step plans the cut, a step early, so the answer arrives
    by the deadline. Queued past its deadline with no token: an explicit `deadline` end."""
    eng = make_fake_engine(max_num_seqs=1)
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=30), now=0.0, request_id="a",
                    deadline_ms=45, deadline_kind="soft")
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=30), now=0.0, request_id="b", priority=0,
                    deadline_ms=20, deadline_kind="soft")
    done = drive(eng)
    a, b = done["a"], done["b"]
    assert a.finish_reason == "deadline_truncated" and len(a.token_ids) >= 3 and a.finish_time <= 0.045
    assert b.finish_reason == "deadline" and "before a first token" in b.error and not b.token_ids
    assert b.first_scheduled_time is None and b.finish_time <= 0.03
    assert eng.scheduler.requests == {}
    assert eng.queue_stats().deadline_misses == {"hard": 0, "soft": 2}  # a cut short, b ended


def test_level_default_deadline_applies(make_fake_engine):
    from batchserve.config import LevelConfig, QueueConfig

    q = QueueConfig(levels=(LevelConfig("hi", tuple(range(6, 11)), deadline_ms=30),
                            LevelConfig("lo", tuple(range(6)), deadline_ms=30, deadline_kind="soft")))
    eng = make_fake_engine(queue=q)
    hi = eng.add_request([1, 2], SamplingParams(max_tokens=20), now=0.0, priority=9)
    lo = eng.add_request([1, 2], SamplingParams(max_tokens=20), now=0.0, priority=2)
    own = eng.add_request([1, 2], SamplingParams(max_tokens=20), now=0.0, priority=2, deadline_ms=1000,
                          deadline_kind="hard")
    assert (hi.deadline_ms, hi.deadline_kind, lo.deadline_kind, own.deadline_ms) == (30, "hard", "soft", 1000)
    done = drive(eng)
    assert [done[r.request_id].finish_reason for r in (hi, lo, own)] == ["deadline", "deadline_truncated",
                                                                       "length"]
    assert hi.status == RequestStatus.FINISHED_DEADLINE


def test_no_step_prediction_without_a_queued_deadline(make_fake_engine):
    """The deadline watch predicts a step (and so refits the latency model) only while some
    queued request has a deadline to look at again."""
    eng = make_fake_engine(max_num_seqs=1)
    model = eng.scheduler.latency
    calls = []
    predict = model.predict_step
    model.predict_step = lambda t, s: calls.append((t, s)) or predict(t, s)
    warm_up(eng, n=4)
    assert calls == []  # twenty-odd steps, no deadline anywhere
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=20), now=eng.clock.now(), request_id="hog")
    eng.step(now=eng.clock.now())  # the hog takes the one seat
    eng.clock.set(eng.clock.now() + eng.executor.step_time)
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=2), now=eng.clock.now(), request_id="waiter",
                    deadline_ms=10_000)
    assert eng.scheduler.waiting.has_deadline_checks
    done = drive(eng)
    assert calls  # the queued deadline was watched
    assert done["waiter"].finish_reason == "length" and done["hog"].finish_reason == "length"


@pytest.mark.parametrize("share", [8, 0])
def test_soft_deadlines_share_the_seats(make_fake_engine, share):
    """Two seats, four soft-deadline answers of 200 tokens due in 0.5 s (10 ms a step): the two
    that start first would hold the seats until just before their deadlines, and the other two
    would get a single token. Sharing ends the running ones shortened in time for the queued
    ones to keep `soft_share_tokens` each; soft_share_tokens=0 never does."""
    eng = make_fake_engine(max_num_seqs=2, soft_share_tokens=share)
    warm_up(eng)
    t0 = eng.clock.now()
    for i in range(4):
        eng.add_request([1, 2, 3], SamplingParams(max_tokens=200), now=t0, request_id=f"s{i}",
                        deadline_ms=500, deadline_kind="soft")
    done = drive(eng)
    outs = [done[f"s{i}"] for i in range(4)]
    assert all(o.finish_time <= t0 + 0.5 + 1e-9 and o.error is None for o in outs)
    assert all(o.finish_reason == "deadline_truncated" for o in outs)
    late = sorted(len(o.token_ids) for o in outs)[:2]
    if share:
        assert late[0] >= share  # every answer keeps at least the minimum
    else:
        assert late == [1, 1]
    assert eng.queue_stats().deadline_misses == {"hard": 0, "soft": 4}
    assert eng.scheduler.requests == {}


def test_soft_deadline_never_takes_a_more_important_seat(make_fake_engine):
    """Seat sharing gives a queued soft request only the seats of soft requests of no higher
    priority: a priority-9 soft answer runs to its own deadline beside a waiting priority-5 one."""
    eng = make_fake_engine(max_num_seqs=1)
    warm_up(eng)
    t0 = eng.clock.now()
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=200), now=t0, request_id="hi", priority=9,
                    deadline_ms=400, deadline_kind="soft")
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=200), now=t0, request_id="mid", priority=5,
                    deadline_ms=300, deadline_kind="soft")
    done = drive(eng)
    assert done["hi"].finish_reason == "deadline_truncated" and len(done["hi"].token_ids) >= 30
    assert done["mid"].finish_reason == "deadline" and not done["mid"].token_ids


def test_preempted_soft_request_ends_with_its_tokens(make_fake_engine):
    """A soft-deadline answer preempted for a more important request, whose deadline passes
    while it waits to resume, ends with the tokens it has (deadline_truncated, no error):
    its first tokens went out, so 'no token before the deadline' would be untrue."""
    eng = make_fake_engine(max_num_seqs=1)
    warm_up(eng)
    t0 = eng.clock.now()
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=50), now=t0, request_id="soft", priority=1,
                    deadline_ms=150, deadline_kind="soft")
    done = drive(eng, until=t0 + 0.05)
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=40), now=eng.clock.now(), request_id="vip", priority=9)
    done.update(drive(eng))
    s = done["soft"]
    assert s.error is None and s.finish_reason == "deadline_truncated"
    assert 3 <= len(s.token_ids) < 50 and s.token_ids == list(range(6, 6 + len(s.token_ids)))
    assert s.finish_time <= t0 + 0.15 + 0.011
    assert done["vip"].finish_reason == "length" and len(done["vip"].token_ids) == 40
