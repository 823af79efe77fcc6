"""The admission queue on its own and through the engine: ordering, caps, overflow
policies, the urgent lane, remove-by-id, config, metrics, scale. Virtual time only."""
import argparse
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchserve.cli import add_engine_args, engine_config
from batchserve.config import ConfigError, LevelConfig, QueueConfig
from batchserve.core.queue import AdmissionQueue
from batchserve.request import OverloadedError, Request, SamplingParams

P = SamplingParams(max_tokens=4)
THREE = (LevelConfig("high", tuple(range(7, 11)), capacity=3, overflow="reject"),
         LevelConfig("normal", (4, 5, 6), capacity=3, overflow="drop_oldest"),
         LevelConfig("low", (0, 1, 2, 3)))


def req(rid, prio=5, arrival=0.0, **kw):
    return Request(str(rid), [1, 2, 3], P, arrival, priority=prio, **kw)


def no_service(r):
    return 0.0


def aged(r, now, after_ms):
    return after_ms is not None and (now - r.arrival_time) * 1000 > after_ms


def spec_key(r, levels, served=None):
    """The queue's comparator: aged requests first, then higher levels; within a level the urgent
    lane, then priority (higher first), then the tenant served least, then the earlier
    deadline, then arrival_time."""
    rank = sorted(levels, key=lambda lv: -max(lv.priorities)).index(next(lv for lv in levels if r.priority in lv.priorities))
    vtc = (served or {}).get((r.level, r.tenant), 0.0)
    return (-1 if r.aged else rank, not r.urgent, -r.priority, vtc, r.deadline or float("inf"), r.arrival_time)


# --- ordering -----------------------------------------------------------------------------
ops = st.lists(st.one_of(
    st.tuples(st.just("push"), st.integers(0, 10), st.floats(0, 10), st.booleans(),
              st.one_of(st.none(), st.floats(1, 5000)), st.sampled_from([None, "a", "b"])),
    st.tuples(st.just("credit"), st.integers(0, 200), st.integers(1, 50)),
    st.tuples(st.just("pop")),
    st.tuples(st.just("remove"), st.integers(0, 200)),
    st.tuples(st.just("refresh"), st.floats(0, 2)),
), max_size=120)


@settings(max_examples=300, deadline=None)
@given(ops=ops, after_ms=st.one_of(st.none(), st.floats(0, 3000)), split=st.booleans())
def test_order_is_the_spec_comparator(ops, after_ms, split):
    levels = THREE if split else (LevelConfig("all"),)
    levels = tuple(LevelConfig(lv.name, lv.priorities) for lv in levels)  # no caps here
    q = AdmissionQueue(QueueConfig(levels=levels, urgent_after_ms=after_ms, urgent_slack_ms=None))
    model: dict[str, Request] = {}
    order: dict[str, int] = {}  # push order breaks exact ties
    now, n = 0.0, 0
    for op in ops:
        if op[0] == "push":
            r = req(n, op[1], op[2], urgent=op[3], deadline_ms=op[4], deadline_kind="soft", tenant=op[5])
            q.push(r)
            r.urgent_given = op[3]
            model[r.request_id], order[r.request_id] = r, n
            n += 1
        elif op[0] == "pop" and model:
            expect = min(model.values(), key=lambda r: (*spec_key(r, levels, q.served), order[r.request_id]))
            got = q.pop()
            assert got is expect
            del model[got.request_id]
        elif op[0] == "credit" and str(op[1]) in model:
            before = q.tenant_service(now)
            q.credit(model[str(op[1])], op[2], now)
            assert sum(q.tenant_service(now).values()) == pytest.approx(sum(before.values()) + op[2])
        elif op[0] == "remove":
            rid = str(op[1])
            assert (q.remove(rid) is not None) == (rid in model)
            model.pop(rid, None)
        elif op[0] == "refresh":
            now += op[1]
            lost = q.refresh(now, no_service)  # soft deadlines passed: the caller ends them
            assert {r.request_id for r in lost} == {rid for rid, r in model.items()
                                                     if r.deadline is not None and now >= r.deadline}
            for r in lost:
                q.remove(r.request_id)
                del model[r.request_id]
            for r in model.values():  # the queue must have promoted exactly these
                assert r.aged == aged(r, now, after_ms)
                assert r.urgent == (r.urgent_given or r.aged)
        assert len(q) == len(model)
        assert all(rid in q for rid in model)
        p = op[1] if op[0] == "push" else 5  # the work queued at or above a priority, as deadlines read it
        assert q.prompt_work_from(p) == (sum(len(r.prompt_token_ids) for r in model.values() if r.priority >= p),
                                         sum(r.priority >= p for r in model.values()))
    expect = sorted(model.values(), key=lambda r: (*spec_key(r, levels, q.served), order[r.request_id]))
    assert list(q) == expect
    assert [q.pop() for _ in range(len(q))] == expect
    assert q.peek() is None


def test_urgent_first_then_priority_then_arrival_across_levels():
    q = AdmissionQueue(QueueConfig(levels=THREE, urgent_after_ms=500, urgent_slack_ms=None))
    for rid, prio, t in [("lo-old", 1, 0.0), ("hi-late", 9, 0.8), ("hi-early", 9, 0.6), ("mid", 5, 0.7)]:
        q.offer(req(rid, prio, t), now=t)
    assert [r.request_id for r in q] == ["hi-early", "hi-late", "mid", "lo-old"]
    q.refresh(0.9, no_service)  # lo-old has waited 900 ms > 500 ms
    assert [r.request_id for r in q] == ["lo-old", "hi-early", "hi-late", "mid"]
    assert q.stats(0.9).promotions == {"wait": 1, "slack": 0}
    assert q.stats(0.9).levels["low"].urgent_length == 1


def test_slack_urgency_stays_inside_its_level():
    """A low request about to miss its deadline goes first among the low ones: ahead of the high
    class with one level (the seed's comparator), never ahead of a higher level with levels."""
    def order(levels):
        q = AdmissionQueue(QueueConfig(levels=levels, urgent_slack_ms=50))
        q.offer(req("low-old", 1, 0.0), now=0.0)
        q.offer(req("low-urgent", 1, 0.0, deadline_ms=100, deadline_kind="soft"), now=0.0)
        q.offer(req("high", 9, 0.01), now=0.01)
        q.refresh(0.06, no_service)  # slack 40 ms < 50 ms
        return [r.request_id for r in q]

    assert order((LevelConfig("one"),)) == ["low-urgent", "high", "low-old"]
    assert order(tuple(LevelConfig(lv.name, lv.priorities) for lv in THREE)) == ["high", "low-urgent", "low-old"]


def test_tenants_share_a_level_by_recent_service():
    q = AdmissionQueue(QueueConfig(tenant_memory_s=10.0))
    for i in range(4):
        q.push(req(f"a{i}", arrival=0.1 * i, tenant="a"))
    q.push(req("b0", arrival=0.5, tenant="b"))
    a0 = q.pop()
    assert a0.request_id == "a0"  # equal counters: arrival order
    q.credit(a0, 10, now=1.0)  # a0 ran and was served 10 tokens
    b0 = q.pop()
    assert b0.request_id == "b0"  # b, served less, goes before a's earlier requests
    q.credit(b0, 3, now=1.0)
    assert [r.request_id for r in q] == ["a1", "a2", "a3"]
    q.push(req("b1", arrival=2.0, tenant="b"))
    assert q.peek().request_id == "b1"
    svc = q.tenant_service(11.0)  # ten seconds later: e^-1 of it still counts
    assert svc[("default", "a")] == pytest.approx(10 / math.e) and svc[("default", "b")] == pytest.approx(3 / math.e)
    q.credit(b0, 20, now=11.0)  # b's new service outweighs a's decayed past
    assert [r.request_id for r in q] == ["a1", "a2", "a3", "b1"]
    q.credit(a0, 1, now=1e5)  # far later: the counters are rescaled, the order still follows them
    assert q.tenant_service(1e5)[("default", "a")] == pytest.approx(1.0)
    assert q.peek().request_id == "b1"


# --- caps and overflow --------------------------------------------------------------------
def test_reject_when_level_full_other_levels_unaffected():
    q = AdmissionQueue(QueueConfig(levels=THREE, retry_after_s=2.0))
    for i in range(3):
        q.offer(req(f"h{i}", 9, i), now=i)
    with pytest.raises(OverloadedError) as e:
        q.offer(req("h3", 8, 3.0), now=3.0)
    assert e.value.level == "high" and e.value.retry_after_s >= 2.0 and "full" in str(e.value)
    assert "h3" not in q and len(q) == 3
    q.offer(req("lo", 0, 3.0), now=3.0)  # the low level has room
    assert q.lengths_by_level() == {"high": 3, "normal": 0, "low": 1}
    assert q.stats(3.0).levels["high"].rejected == 1 and q.stats(3.0).rejected == 1
    q.pop()
    q.offer(req("h4", 10, 4.0), now=4.0)  # room again after one left


def test_drop_oldest_returns_the_oldest_with_a_clear_error():
    q = AdmissionQueue(QueueConfig(levels=THREE))
    for i, t in enumerate([0.3, 0.1, 0.2]):
        q.offer(req(f"n{i}", 5, t), now=0.3)
    dropped = q.offer(req("n3", 4, 0.4), now=0.4)
    assert dropped.request_id == "n1"  # arrived first
    assert "dropped" in dropped.error and "normal" in dropped.error
    assert "n1" not in q and "n3" in q and q.lengths_by_level()["normal"] == 3
    assert q.stats(0.4).levels["normal"].dropped == 1


def test_requeue_after_preemption_is_never_refused():
    q = AdmissionQueue(QueueConfig.bounded(2))
    q.offer(req("a"), now=0.0)
    q.offer(req("b"), now=0.0)
    q.push(req("preempted", arrival=-1.0))  # over the cap, on purpose
    assert len(q) == 3 and q.peek().request_id == "preempted"
    with pytest.raises(OverloadedError):
        q.offer(req("c"), now=0.1)


def test_engine_drop_oldest_ends_it_as_rejected_in_next_step(make_fake_engine):
    eng = make_fake_engine(max_num_seqs=1,
                           queue=QueueConfig(levels=(LevelConfig("all", capacity=2, overflow="drop_oldest"),)))
    eng.add_request([1, 2, 3], P, now=0.0, request_id="running")
    eng.step(now=0.0)
    eng.add_request([1, 2, 3], P, now=0.01, request_id="old")
    eng.add_request([1, 2, 3], P, now=0.02, request_id="mid")
    eng.add_request([1, 2, 3], P, now=0.03, request_id="new")
    outs = {o.request_id: o for o in eng.step(now=0.03).outputs}
    assert outs["old"].finished and outs["old"].finish_reason == "rejected"
    assert "dropped" in outs["old"].error and outs["old"].token_ids == []
    assert "mid" in eng.scheduler.waiting and "new" in eng.scheduler.waiting
    done = {}
    while eng.has_unfinished:
        done.update({o.request_id: o for o in eng.step(now=eng.clock.now()).outputs if o.finished})
        eng.clock.advance(0.01)
    assert {r: o.finish_reason for r, o in done.items()} == {"running": "length", "mid": "length",
                                                           "new": "length"}


def test_engine_reject_raises_and_leaves_nothing_behind(make_fake_engine):
    eng = make_fake_engine(queue=QueueConfig.bounded(1))
    eng.add_request([1, 2], P, now=0.0, request_id="a")
    with pytest.raises(OverloadedError) as e:
        eng.add_request([1, 2], P, now=0.0, request_id="b")
    assert e.value.retry_after_s >= 1.0
    assert "b" not in eng.scheduler.requests
    eng.abort("a", now=0.0)
    assert [o.finish_reason for o in eng.step(now=0.0).outputs] == ["abort"]


# --- urgent lane --------------------------------------------------------------------------
def test_promotion_by_wait_only_after_threshold():
    q = AdmissionQueue(QueueConfig(urgent_after_ms=100, urgent_slack_ms=None))
    q.offer(req("low", 0, 0.0), now=0.0)
    q.offer(req("high", 10, 0.05), now=0.05)
    q.refresh(0.1, no_service)  # waited exactly 100 ms: not yet
    assert q.peek().request_id == "high"
    q.refresh(0.1001, no_service)
    assert q.peek().request_id == "low" and q.peek().urgent
    q.refresh(0.2, no_service)  # high also waited > 100 ms now: both urgent, priority decides
    assert [r.request_id for r in q] == ["high", "low"]
    assert q.stats(0.2).promotions["wait"] == 2


def test_promotion_by_slack_and_hard_doom():
    q = AdmissionQueue(QueueConfig(urgent_slack_ms=50))
    service = {"soft": 0.2, "hard": 0.2, "free": 0.0}
    q.offer(req("free", 10, 0.0), now=0.0)
    q.offer(req("soft", 1, 0.0, deadline_ms=1000, deadline_kind="soft"), now=0.0)
    hard = req("hard", 1, 0.0, deadline_ms=1100, deadline_kind="hard")
    q.offer(hard, now=0.0)
    svc = lambda r: service[r.request_id]  # noqa: E731
    assert q.refresh(0.5, svc) == [] and q.peek().request_id == "free"
    # soft: slack = 1.0 - 0.76 - 0.2 = 40 ms <= 50 ms; hard: slack 140 ms
    assert q.refresh(0.76, svc) == []
    assert [r.request_id for r in q] == ["soft", "free", "hard"]
    assert q.stats(0.76).promotions == {"wait": 0, "slack": 1}
    service["hard"] = 0.5  # a slower prediction now: noticed at the next looked-at time
    assert q.refresh(0.86, svc) == [hard]
    q.remove("hard")
    assert q.refresh(0.9, svc) == []  # soft requests are not doomed by a prediction...
    assert [r.request_id for r in q.refresh(1.0, svc)] == ["soft"]  # ...only once their deadline passes


def test_remove_by_id():
    q = AdmissionQueue()
    for i in range(5):
        q.push(req(i, prio=i))
    assert q.remove("3").request_id == "3" and q.remove("3") is None and q.remove("nope") is None
    assert "3" not in q and len(q) == 4
    assert [r.request_id for r in q] == ["4", "2", "1", "0"]
    assert [q.pop().request_id for _ in range(4)] == ["4", "2", "1", "0"]
    with pytest.raises(IndexError):
        q.pop()


@pytest.mark.slow
def test_hundred_thousand_requests_scale():
    """Not timed: an O(n) step inside push/pop/remove/refresh would make this O(n^2) and hang."""
    rng = random.Random(0)
    q = AdmissionQueue(QueueConfig(levels=tuple(LevelConfig(lv.name, lv.priorities) for lv in THREE),
                                   urgent_after_ms=1000, urgent_slack_ms=20))
    n = 100_000
    for i in range(n):
        dl = rng.choice([None, rng.uniform(100, 5000)])
        q.offer(req(i, rng.randint(0, 10), i * 1e-4, deadline_ms=dl, deadline_kind="soft"), now=i * 1e-4)
    for i in rng.sample(range(n), n // 10):
        q.remove(str(i))
    now, out = 10.0, []
    while q:
        q.refresh(now, no_service)
        for _ in range(1000):
            if q:
                out.append(q.pop())
        now += 0.05
    assert len(out) == n - n // 10
    assert q._num_entries <= 2 * len(q) + 1024 and len(q._heads) <= 2 * len(q) + 1024 and len(q._checks) <= 2 * len(q) + 1024
    keys = [spec_key(r, THREE) for r in out[:1000]]
    assert keys == sorted(keys)


# --- config, flags, metrics ---------------------------------------------------------------
def test_config_validation_and_from_dict():
    with pytest.raises(ConfigError, match="priority 5"):
        QueueConfig(levels=(LevelConfig("a", (0, 5)), LevelConfig("b", tuple(range(5, 11)))))
    with pytest.raises(ConfigError, match="no level takes"):
        QueueConfig(levels=(LevelConfig("a", (0, 1)),))
    with pytest.raises(ConfigError, match="overflow"):
        LevelConfig("a", overflow="maybe")
    cfg = QueueConfig.from_dict({"queue": {"urgent_after_ms": 200, "levels": {
        "high": {"priorities": "7-10", "capacity": 5000, "deadline_ms": 200},
        "low": {"priorities": [0, 1, 2, 3, 4, 5, 6], "overflow": "drop_oldest", "deadline_kind": "soft"}}}})
    assert [lv.name for lv in cfg.levels] == ["high", "low"] and cfg.levels[0].priorities == (7, 8, 9, 10)
    with pytest.raises(ConfigError, match="unknown"):
        QueueConfig.from_dict({"levels": [{"name": "x", "cap": 3}]})
    q = AdmissionQueue(cfg)
    r = req("x", 8)
    q.resolve(r)
    assert (r.level, r.deadline_ms, r.deadline_kind) == ("high", 200, "hard")
    r = req("y", 2, deadline_ms=50)
    q.resolve(r)
    assert (r.level, r.deadline_ms, r.deadline_kind) == ("low", 50, "soft")


def parse(argv):
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return engine_config(p.parse_args(argv))


def test_cli_flags(tmp_path):
    assert parse([]).queue == QueueConfig()
    a = parse(["--queue-capacity", "7"])
    lv = a.queue.levels
    assert len(lv) == 1 and lv[0].capacity == 7 and lv[0].overflow == "reject"
    f = tmp_path / "q.yaml"
    f.write_text("levels:\n  - {name: hi, priorities: 6-10, capacity: 10}\n"
                 "  - {name: lo, priorities: 0-5, overflow: drop_oldest, capacity: 20}\n")
    cfg = parse(["--queue-config", str(f)]).queue
    assert [(lv.name, lv.capacity, lv.overflow) for lv in cfg.levels] == [("hi", 10, "reject"),
                                                                         ("lo", 20, "drop_oldest")]
    with pytest.raises(ConfigError):
        parse(["--queue-config", str(f), "--queue-capacity", "3"])


def test_wait_metrics_through_engine(make_fake_engine):
    eng = make_fake_engine(max_num_seqs=1)
    for i in range(4):
        eng.add_request([1, 2, 3], SamplingParams(max_tokens=2), now=0.0, request_id=f"r{i}")
    assert eng.scheduler.waiting.lengths_by_level() == {"default": 4}
    t = 0.0
    while eng.has_unfinished:
        eng.step(now=t)
        t += 0.01
    s = eng.queue_stats(t)
    # each request holds the one seat for 2 steps: waits 0, 20, 40, 60 ms
    assert s.levels["default"].wait_p50_ms == pytest.approx(20) and s.wait_p99_ms == pytest.approx(60)
    assert s.finished == 4 and s.timeout_rate == 0.0 and s.length == 0
